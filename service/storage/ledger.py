"""The TTL ledger: what a backend provides to the sweeper, and the pieces every backend's ledger shares.

The design (why a ledger table, how sweeps and writes stay safe together) is in ``ttl/sweeper.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import orjson

from reducing_saver.service.storage.outbox import OutboxEntry

#: The ``configurable`` key of a put that sets its thread's own TTL.
TTL_KEY = "checkpoint_ttl"
TABLE = "reducing_saver_threads"
LOG_TABLE = "reducing_saver_sweep_log"
#: How long the sweep log keeps a handled thread's row.
LOG_DAYS = 30
#: A process re-touches a thread at most this often (seconds), and at most every tenth of its TTL.
TOUCH_EVERY = 3600.0
#: Threads a process remembers having touched (least recently touched forgotten first).
TOUCH_CACHE_SIZE = 100_000
_UUID_EPOCH = 0x01B21DD213814000  # 100 ns intervals from 1582-10-15 to 1970-01-01

Strategy = Literal["keep_latest", "delete"]


class InvalidTTLError(ValueError):
    """A put's ``checkpoint_ttl`` is not a duration (the put is refused with 422)."""


@dataclass(frozen=True)
class Policy:
    """What a sweep does: the strategy, and the TTL of threads without one of their own (None: none)."""

    strategy: Strategy
    default_ttl: float | None


@dataclass(frozen=True)
class Outcome:
    """One thread handled by a sweep: ``pruned``, ``deleted`` or ``refused`` (keep_latest on a thread
    that uses a DeltaChannel), and the bytes that freed."""

    thread_id: str
    action: Literal["pruned", "deleted", "refused"]
    bytes: int


@dataclass
class SweepReport:
    """What one sweep did (or, with ``dry_run``, would do)."""

    strategy: Strategy
    default_ttl_seconds: float | None
    dry_run: bool = False
    threads_pruned: int = 0
    threads_deleted: int = 0
    threads_refused: int = 0
    bytes_reclaimed: int = 0
    errors: int = 0
    #: Delivered outbox rows older than the retention this sweep deleted (None: not purged).
    outbox_rows_purged: int | None = None
    outbox_retention_seconds: float | None = None
    seconds: float = 0.0
    threads: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dry_run": self.dry_run,
            "strategy": self.strategy,
            "default_ttl_seconds": self.default_ttl_seconds,
            "threads_pruned": self.threads_pruned,
            "threads_deleted": self.threads_deleted,
            "threads_refused": self.threads_refused,
            "bytes_reclaimed": self.bytes_reclaimed,
            "errors": self.errors,
            "outbox_rows_purged": self.outbox_rows_purged,
            "outbox_retention_seconds": self.outbox_retention_seconds,
            "seconds": round(self.seconds, 3),
        }
        if self.dry_run:
            out = {
                "dry_run": True,
                "strategy": self.strategy,
                "default_ttl_seconds": self.default_ttl_seconds,
                "threads": self.threads,
                "thread_count": len(self.threads),
                "bytes_reclaimable": sum(t["bytes"] for t in self.threads),
            }
        return out


def uuid6_time(checkpoint_id: str) -> float | None:
    """The Unix time inside a uuid6 checkpoint id (LangGraph's ids), or None for any other id."""
    try:
        value = uuid.UUID(checkpoint_id)
    except (ValueError, TypeError, AttributeError):
        return None
    if value.version != 6:
        return None
    high = value.int >> 64
    ticks = ((high >> 32) << 28) | (((high >> 16) & 0xFFFF) << 12) | (high & 0x0FFF)
    return (ticks - _UUID_EPOCH) / 1e7


def iso_time(ts: Any) -> float | None:
    if not isinstance(ts, str):
        return None
    try:
        when = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


#: ``window(saver, thread_id, namespace)``: outbox entries for the messages in the thread's head.
Window = Callable[[Any, str, tuple[str, ...]], list[OutboxEntry]]


class Recorder(Protocol):
    def record(self, entries: Sequence[OutboxEntry]) -> int: ...


# -- shared helpers ----------------------------------------------------------------------------------


def namespace_json(namespace: tuple[str, ...] | None) -> str | None:
    return orjson.dumps(list(namespace)).decode() if namespace else None


def row_namespace(ledger: Any, thread_id: str, stored: Any) -> tuple[str, ...]:
    """A ledger row's namespace (a list, or JSON text on SQLite), else the thread's default
    (``ledger.fallback_namespace``)."""
    if isinstance(stored, str):
        stored = orjson.loads(stored)
    return tuple(stored) if stored else ledger.fallback_namespace(thread_id)


def from_epoch(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def database_figures(tracked: int, expired: int, log: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "threads_tracked": int(tracked),
        "threads_expired": int(expired),
        "threads_pruned": int(log["pruned"]),
        "threads_deleted": int(log["deleted"]),
        "bytes_reclaimed": int(log["bytes"]),
        "last_swept_at": log["last"],
        "log_days": LOG_DAYS,
    }
