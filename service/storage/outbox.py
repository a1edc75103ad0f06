"""The extraction outbox: messages that left the window, kept durably until long-term memory has them.

Each backend implements :class:`Outbox` (``storage/<backend>/outbox.py``); this module holds what they
share: the entry, how entries are made from pruned messages (keys, fingerprints), the protocol.
docs/memory.md ("How nothing is lost") gives the invariant, a row's states and how delivery runs.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Protocol, TypeAlias

import orjson
from langchain_core.messages import BaseMessage

from reducing_saver.reducer import message_digest, message_key
from reducing_saver.service.messages_codec import EncodedMessage

#: ``(namespace, key)``: what makes an outbox row unique.
EntryKey: TypeAlias = tuple[tuple[str, ...], str]

TABLE = "reducing_saver_outbox"
#: What a delivered row drops (a ``SET`` list): its message (JSON null) and what only delivery needed.
DELIVERED_DROPS = (
    "message = 'null', message_class = NULL, checkpoint_id = NULL, claimed_by = NULL, last_error = NULL"
)
#: The columns an entry is read from, in every backend's table.
COLUMNS = "namespace, key, thread_id, checkpoint_id, message, message_class, pruned_at, attempts, last_error"
_MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class OutboxEntry:
    """One pruned message waiting for (or done with) extraction.

    Attributes:
        namespace: The run's memory namespace.
        key: The message's key in that namespace: its id, or a stable digest for id-less messages
            (``reducer.message_key``).
        thread_id: The thread the message was pruned from.
        checkpoint_id: The checkpoint whose put pruned it, when known.
        message: The message's ``model_dump()`` dict, JSON-clean; ``None`` once delivered (the row
            keeps its key, the store the message).
        pruned_at: When it was recorded (UTC).
        attempts: How many times a worker has claimed it (this claim included, for claimed entries).
        message_class: ``"module:Class"`` of the message as serialized, when known; lets the extractor
            rebuild the right LangChain class without importing anything the payload names.
        last_error: The last extraction error (dead letters and retried rows).
        fingerprint: What the message says (:func:`message_fingerprint`; keyed per tenant under
            ``--encryption``): a record with another one is a newer version of the message.
    """

    namespace: tuple[str, ...]
    key: str
    thread_id: str
    checkpoint_id: str | None
    message: dict[str, Any] | None
    pruned_at: datetime
    attempts: int = 0
    message_class: str | None = None
    last_error: str | None = None
    fingerprint: str | None = None

    @property
    def ident(self) -> EntryKey:
        """``(namespace, key)``."""
        return (self.namespace, self.key)


def make_entries(
    messages: Iterable[Any],
    namespace: Sequence[str],
    *,
    thread_id: str,
    checkpoint_id: str | None = None,
    pruned_at: datetime | None = None,
) -> list[OutboxEntry]:
    """Outbox entries for pruned messages, keyed as the reducer keys them (one per key).

    Args:
        messages: ``EncodedMessage`` (the service), LangChain message objects (in-process) or
            ``model_dump()`` dicts.
        namespace: The memory namespace they belong to.
        thread_id: The thread they were pruned from.
        checkpoint_id: The checkpoint whose put pruned them.
        pruned_at: Defaults to now (UTC).

    Returns:
        One entry per distinct message key, in input order.

    Raises:
        TypeError: If a message is neither a message object nor a mapping.
    """
    namespace = tuple(str(label) for label in namespace)
    when = as_utc(pruned_at) if pruned_at is not None else datetime.now(UTC)
    entries: dict[str, OutboxEntry] = {}
    for message in messages:
        if isinstance(message, EncodedMessage):
            fields, cls = dict(message), f"{message.module}:{message.name}"
        elif isinstance(message, BaseMessage):
            fields, cls = message.model_dump(), f"{type(message).__module__}:{type(message).__name__}"
        elif isinstance(message, Mapping):
            fields, cls = dict(message), None
        else:
            raise TypeError(f"a pruned message must be a message or a mapping, got {type(message).__name__}")
        key = message_key(message, namespace)
        if key not in entries:
            entries[key] = OutboxEntry(
                namespace,
                key,
                str(thread_id),
                checkpoint_id,
                json_clean(fields),
                when,
                0,
                cls,
                fingerprint=message_fingerprint(message),
            )
    return list(entries.values())


def message_fingerprint(message: Any) -> str:
    """What a message says, as 32 hex digits: a digest of the bytes the client sent
    (``EncodedMessage.ext``, read again the same way from every put that carries it), else of its fields
    (``reducer.message_digest``)."""
    if isinstance(message, EncodedMessage):
        return hashlib.blake2b(message.ext, digest_size=16).hexdigest()
    return message_digest(message).hex()


def json_clean(value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` as plain JSON data: bytes become base64 text, dates and times ISO 8601 text, durations
    seconds, sets lists, other objects (UUID, Decimal, addresses, paths) their ``str``."""
    try:
        return orjson.loads(orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS))
    except orjson.JSONEncodeError:  # integers beyond 64 bits, say: the slower encoder copes
        return json.loads(json.dumps(value, default=_json_default))


def _json_default(obj: Any) -> Any:
    # The standard values a message may carry (messages_codec.SAFE_VALUE_TYPES) get their usual JSON
    # forms; orjson writes most of them itself, the standard encoder (the fallback) none.
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if isinstance(obj, (set, frozenset, deque)):
        return list(obj)
    if isinstance(obj, (date, time)):  # datetime is a date
        return obj.isoformat()
    if isinstance(obj, timedelta):
        return obj.total_seconds()
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return str(obj)


def json_text(value: Any) -> str:
    return orjson.dumps(value).decode()


def as_utc(when: datetime) -> datetime:
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def error_text(error: str) -> str:
    """An error message as a ``last_error`` column can hold it: cut to a few thousand characters, NUL
    (which PostgreSQL text refuses) and lone surrogates (which no driver can encode) escaped. An
    extractor's or a model's error may quote the content it failed on: storing it must not fail too."""
    if "\x00" in error:
        error = error.replace("\x00", "\\x00")
    error = error.encode("utf-8", "backslashreplace").decode("utf-8")
    return error if len(error) <= _MAX_ERROR_CHARS else error[: _MAX_ERROR_CHARS - 1] + "…"


def sorted_unique(entries: Iterable[OutboxEntry]) -> list[OutboxEntry]:
    """One entry per ``(namespace, key)``, in key order: every writer inserts in the same order, so two
    transactions waiting on each other's uncommitted keys cannot deadlock."""
    unique: dict[EntryKey, OutboxEntry] = {}
    for entry in entries:
        unique.setdefault(entry.ident, entry)
    return [unique[ident] for ident in sorted(unique)]


class CheckpointRecords:
    """The outbox entries of one put, written in the same transaction as its checkpoint.

    Where the backend's saver can (``records_with_checkpoint`` on its outbox: PostgreSQL), the entries a
    put records are not inserted on their own before the checkpoint: they travel with the put, as its
    ``records=`` argument, and the saver inserts them ahead of the checkpoint, in its pipeline, which
    PostgreSQL runs as one transaction. The rows and the checkpoint are then stored together or not at
    all, in one round trip instead of two, and the invariant above holds as before: no checkpoint drops a
    message that is not in the outbox.

    Attributes:
        entries: What the put recorded.
        written: The saver inserted ``entries`` (committed once the put returns).
    """

    def __init__(self) -> None:
        self.entries: list[OutboxEntry] = []
        self.written = False


def check_fail_args(retry_at: datetime | None, dead: bool) -> None:
    if (retry_at is None) == (not dead):
        raise TypeError("fail() needs exactly one of retry_at=<datetime> or dead=True")


class Outbox(Protocol):
    """What every outbox offers; see :class:`PostgresOutbox` for the full contract."""

    #: The backend's savers write a put's entries in the checkpoint's own transaction
    #: (:class:`CheckpointRecords`).
    records_with_checkpoint: bool
    #: Claims take sealed rows too (set under ``--encryption``, whose outbox opens them); without it they
    #: leave sealed rows, which only a process with the key ring can deliver, alone.
    claims_sealed: bool

    def setup(self) -> None: ...
    def record(self, entries: Iterable[OutboxEntry]) -> int: ...
    def forget(self, entries: Iterable[OutboxEntry]) -> int: ...
    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]: ...
    def renew(self, worker_id: str, keys: Iterable[EntryKey] | None, lease_seconds: float) -> int: ...
    def complete(self, worker_id: str, keys: Iterable[EntryKey]) -> int: ...
    def fail(
        self,
        worker_id: str,
        key: EntryKey,
        error: str,
        *,
        retry_at: datetime | None = None,
        dead: bool = False,
    ) -> bool: ...
    def release(self, worker_id: str, keys: Iterable[EntryKey] | None = None) -> int: ...
    def status(self, *, namespace_prefix: Sequence[str] | None = None) -> dict[str, Any]: ...
    def dead_letters(
        self, limit: int = 100, *, namespace_prefix: Sequence[str] | None = None
    ) -> list[OutboxEntry]: ...
    def retry_dead(
        self, keys: Iterable[EntryKey] | None = None, *, namespace_prefix: Sequence[str] | None = None
    ) -> int: ...
    def purge_delivered(self, older_than_seconds: float) -> int: ...
    def close(self) -> None: ...


#: What a sealed outbox message's one key is (``encryption.ENVELOPE_TYPE``, which this module cannot import).
SEALED_KEY = "reducing-saver/aesgcm"
#: How a sealed message's stored JSON text starts, whoever wrote it (the key first, no space).
SEALED_START = '{"' + SEALED_KEY + '"'


def claim_order(entry: OutboxEntry) -> tuple[Any, ...]:
    return (entry.namespace, entry.pruned_at, entry.key)
