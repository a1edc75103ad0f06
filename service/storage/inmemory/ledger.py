"""The TTL ledger as a dictionary, for ``memory://``; every call runs under the saver's lock."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from reducing_saver.reducer import thread_namespace
from reducing_saver.service.storage.ledger import (
    Outcome,
    Policy,
    Recorder,
    Window,
    database_figures,
    from_epoch,
    row_namespace,
    uuid6_time,
)


@dataclass
class _Row:
    last_write_at: float
    ttl_seconds: float | None = None
    namespace: tuple[str, ...] | None = None
    swept_at: float | None = None

    def expired(self, policy: Policy, now: float) -> bool:
        ttl = self.ttl_seconds if self.ttl_seconds is not None else policy.default_ttl
        return ttl is not None and self.last_write_at + ttl < now


logger = logging.getLogger(__name__)


class MemoryLedger:
    """The ledger as a dictionary, for ``memory://``; every call runs under the saver's lock."""

    kind = "memory"
    #: The memory namespace of a thread whose puts named none (tenant mode: open_sweeper's).
    fallback_namespace = staticmethod(thread_namespace)

    def __init__(self, saver: Any, *, window: Window, recorder: Recorder | None, worker_id: str) -> None:
        self.saver = saver
        self.window = window
        self.recorder = recorder
        self.worker_id = worker_id
        self.rows: dict[str, _Row] = {}
        self.log: list[tuple[str, str, int, float, str]] = []

    def setup(self) -> None:
        """Nothing to create."""

    def close(self) -> None:
        """Nothing to close."""

    def touch(self, thread_id: str, ttl: float | None, namespace: tuple[str, ...] | None) -> None:
        with self.saver.lock:
            row = self.rows.get(thread_id)
            if row is None:
                self.rows[thread_id] = _Row(time.time(), ttl, namespace)
                return
            row.last_write_at, row.swept_at = time.time(), None
            row.ttl_seconds = ttl if ttl is not None else row.ttl_seconds
            row.namespace = namespace if namespace is not None else row.namespace

    def copy(self, source: str, target: str) -> None:
        with self.saver.lock:
            found = self.rows.get(source)
            self.touch(target, found.ttl_seconds if found else None, None)

    def discover(self, session: Any = None) -> int:
        with self.saver.lock:
            found = 0
            for thread_id, namespaces in self.saver.storage.items():
                heads = [max(cps) for cps in namespaces.values() if cps]
                if thread_id in self.rows or not heads:
                    continue
                when = uuid6_time(max(heads))
                self.rows[thread_id] = _Row(when or time.time())
                found += 1
            return found

    def candidates(
        self, policy: Policy, limit: int | None, skip: Sequence[str], session: Any = None
    ) -> list[str]:
        now, skipped = time.time(), set(skip)
        with self.saver.lock:
            due = sorted(
                (row.last_write_at, thread_id)
                for thread_id, row in self.rows.items()
                if thread_id not in skipped
                and row.expired(policy, now)
                and (policy.strategy == "delete" or row.swept_at is None)
            )
        ids = [thread_id for _, thread_id in due]
        return ids if limit is None else ids[:limit]

    @contextmanager
    def session(self, policy: Policy) -> Iterator[_MemorySession]:
        yield _MemorySession(self, policy)

    def delete_extracting(self, thread_id: str, recorder: Recorder | None) -> None:
        with self.saver.lock:
            row = self.rows.get(thread_id)
            entries = self.window(
                self.saver, thread_id, row_namespace(self, thread_id, row.namespace if row else None)
            )
            if entries and recorder is not None:
                recorder.record(entries)
            self.saver.delete_thread(thread_id)

    def thread_bytes(self, thread_id: str, *, heads_only: bool = False) -> int:
        saver, total = self.saver, 0
        for ns, checkpoints in saver.storage.get(thread_id, {}).items():
            if not checkpoints:
                continue
            head = max(checkpoints)
            for checkpoint_id, (checkpoint, metadata, _) in checkpoints.items():
                if heads_only and checkpoint_id != head:
                    continue
                total += len(checkpoint[1]) + len(metadata[1])
                for _, _, value, _ in saver.writes.get((thread_id, ns, checkpoint_id), {}).values():
                    total += len(value[1])
            versions = (
                saver.serde.loads_typed(checkpoints[head][0])["channel_versions"] if heads_only else None
            )
            for (t, blob_ns, channel, version), value in saver.blobs.items():
                if (
                    t == thread_id
                    and blob_ns == ns
                    and (versions is None or versions.get(channel) == version)
                ):
                    total += len(value[1])
        return total

    def database_status(self, policy: Policy, *, thread_prefix: str = "") -> dict[str, Any]:
        now = time.time()
        with self.saver.lock:
            rows = [row for thread_id, row in self.rows.items() if thread_id.startswith(thread_prefix)]
            entries = [entry for entry in self.log if entry[0].startswith(thread_prefix)]
            expired = sum(
                1
                for row in rows
                if row.expired(policy, now) and (policy.strategy == "delete" or row.swept_at is None)
            )
            log = {
                "pruned": sum(1 for entry in entries if entry[1] == "pruned"),
                "deleted": sum(1 for entry in entries if entry[1] == "deleted"),
                "bytes": sum(entry[2] for entry in entries),
                "last": from_epoch(max((entry[3] for entry in entries), default=None)),
            }
            return database_figures(len(rows), expired, log)

    def forget_log(self, older_than_days: int, session: Any = None) -> int:
        cutoff = time.time() - older_than_days * 86400
        with self.saver.lock:
            kept = [entry for entry in self.log if entry[3] >= cutoff]
            gone, self.log[:] = len(self.log) - len(kept), kept
            return gone


class _MemorySession:
    def __init__(self, ledger: MemoryLedger, policy: Policy) -> None:
        self.ledger = ledger
        self.policy = policy

    def measure(self, thread_id: str) -> int:
        with self.ledger.saver.lock:
            total = self.ledger.thread_bytes(thread_id)
            if self.policy.strategy == "delete":
                return total
            return max(0, total - self.ledger.thread_bytes(thread_id, heads_only=True))

    def handle(self, thread_id: str) -> Outcome | None:
        ledger, policy = self.ledger, self.policy
        with ledger.saver.lock:
            row = ledger.rows.get(thread_id)
            if row is None or not row.expired(policy, time.time()):
                return None
            if policy.strategy == "keep_latest" and row.swept_at is not None:
                return None
            before = ledger.thread_bytes(thread_id)
            if before == 0:
                del ledger.rows[thread_id]
                return None
            if policy.strategy == "delete":
                entries = ledger.window(
                    ledger.saver, thread_id, row_namespace(ledger, thread_id, row.namespace)
                )
                if entries and ledger.recorder is not None:
                    ledger.recorder.record(entries)
                ledger.saver.prune([thread_id], strategy="delete")
                del ledger.rows[thread_id]
                ledger.log.append((thread_id, "deleted", before, time.time(), ledger.worker_id))
                return Outcome(thread_id, "deleted", before)
            try:
                ledger.saver.prune([thread_id], strategy="keep_latest")
            except NotImplementedError as exc:
                row.swept_at = time.time()
                logger.warning("TTL sweep left thread %r as it is: %s", thread_id, exc)
                return Outcome(thread_id, "refused", 0)
            freed = max(0, before - ledger.thread_bytes(thread_id))
            row.swept_at = time.time()
            ledger.log.append((thread_id, "pruned", freed, time.time(), ledger.worker_id))
            return Outcome(thread_id, "pruned", freed)
