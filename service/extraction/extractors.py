"""What a delivered batch of pruned messages is handed to: the default store writer, or an operator's
``module:callable``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.messages import BaseMessage, message_to_dict, messages_from_dict
from langgraph.store.base import BaseStore, InvalidNamespaceError, PutOp

from reducing_saver.reducer import validate_namespace
from reducing_saver.service.imports import import_callable
from reducing_saver.service.messages_codec import EncodedMessage, to_message
from reducing_saver.service.storage.outbox import OutboxEntry
from reducing_saver.wire.nul import encode_memory_value

Extractor = Callable[[list[OutboxEntry], tuple[str, ...]], Any]


class PermanentExtractionError(Exception):
    """An extraction that no retry can fix: the rows go straight to the dead letters."""


def entry_message(entry: OutboxEntry) -> BaseMessage | dict[str, Any]:
    """The LangChain message an outbox entry holds; a dict for a class the service does not know.

    Built from the recorded ``module:Class`` through ``messages_codec.to_message`` (nothing is imported),
    or, for entries recorded from plain dicts, from the message's ``type``.
    """
    message = _recorded(entry)
    if entry.message_class:
        module, _, name = entry.message_class.partition(":")
        return to_message(EncodedMessage(message, b"", module, name))
    try:
        return messages_from_dict([{"type": message.get("type"), "data": message}])[0]
    except Exception:
        return dict(message)


def _recorded(entry: OutboxEntry) -> dict[str, Any]:
    """The message ``entry`` holds: an extractor gets entries that hold one (the deliverer hands those of
    deleted messages to ``forget``)."""
    if entry.message is None:
        raise ValueError(
            f"outbox entry {entry.key!r} holds no message: a deletion is forgotten, not extracted"
        )
    return entry.message


class StoreExtractor:
    """The default extractor: every message becomes one item of a LangGraph ``BaseStore``.

    ``store.put(namespace, key, value)`` where ``key`` is the message id (the stable digest for id-less
    messages) and ``value`` is ``{**message_to_dict(message), "thread_id": ..., "pruned_at": <ISO 8601>}``
    (``{"type": ..., "data": <the dict>}`` for message classes the service does not know). A value holding
    U+0000 anywhere is stored escaped and marked ``"nul_escaped": true``
    (``reducing_saver.wire.nul``; ``decode_memory_value`` restores it). Idempotent:
    delivering a message again overwrites its item. One ``store.batch`` per namespace group, or for several
    groups at once (:meth:`extract_groups`).

    Args:
        store: Any sync-capable ``BaseStore`` (PostgresStore, SqliteStore, InMemoryStore).
    """

    def __init__(self, store: BaseStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"StoreExtractor({type(self.store).__name__})"

    def __call__(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> None:
        try:
            validate_namespace(namespace)
        except ValueError as exc:
            raise PermanentExtractionError(str(exc)) from exc
        try:
            self.store.batch(self._puts(namespace, entries))
        except InvalidNamespaceError as exc:
            raise PermanentExtractionError(str(exc)) from exc
        except Exception as exc:
            # A value the database refuses fails the same way on every retry; connection errors and
            # the like stay retryable.
            if _is_data_error(exc):
                raise PermanentExtractionError(f"{type(exc).__name__}: {exc}") from exc
            raise

    def extract_groups(self, groups: list[tuple[tuple[str, ...], list[OutboxEntry]]]) -> None:
        """Every group's messages in one ``store.batch`` (one transaction on PostgreSQL), as ``__call__``
        stores each group. The deliverer calls it with the namespace groups of one claim, and on any failure
        hands each group to ``__call__`` on its own (a put repeated overwrites its item)."""
        ops = []
        for namespace, entries in groups:
            validate_namespace(namespace)
            ops += self._puts(namespace, entries)
        self.store.batch(ops)

    def _puts(self, namespace: tuple[str, ...], entries: list[OutboxEntry]) -> list[PutOp]:
        """The store writes of one namespace group's messages. The store's default TTL (--store-ttl)
        applies to extracted memories as to any item put without one."""
        ttl = (getattr(self.store, "ttl_config", None) or {}).get("default_ttl")
        return [PutOp(tuple(namespace), entry.key, self.value(entry), ttl=ttl) for entry in entries]

    def forget(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> None:
        """Remove the entries' keys from the store (a message the agent deleted on purpose)."""
        self.store.batch([PutOp(tuple(namespace), entry.key, None) for entry in entries])

    @staticmethod
    def value(entry: OutboxEntry) -> dict[str, Any]:
        """The store item's value for ``entry``."""
        message = entry_message(entry)
        if isinstance(message, BaseMessage):
            body = message_to_dict(message)
        else:
            recorded = _recorded(entry)
            body = {"type": recorded.get("type"), "data": dict(recorded)}
        # PostgreSQL's jsonb cannot hold U+0000 (tool output has it): such a value is stored escaped and
        # marked, losslessly (wire.nul; readers decode with decode_memory_value).
        value = {**body, "thread_id": entry.thread_id, "pruned_at": entry.pruned_at.isoformat()}
        return encode_memory_value(value)


class CallableExtractor:
    """A user extractor ``func(messages, namespace, store)``; ``messages`` are LangChain message objects
    (dicts for unknown classes), oldest first. ``func`` may be sync or async."""

    def __init__(self, func: Callable[..., Any], store: BaseStore | None) -> None:
        self.func = func
        self.store = store

    def __repr__(self) -> str:
        return f"CallableExtractor({getattr(self.func, '__qualname__', self.func)!r})"

    def __call__(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> Any:
        messages = [entry_message(entry) for entry in entries]
        return self.func(messages, namespace, self.store)

    def forget(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> None:
        """Remove the entries' keys from the store, where the default extractor keeps a message; what
        ``func`` derived from the message elsewhere is its own to remove."""
        if self.store is not None:
            self.store.batch([PutOp(tuple(namespace), entry.key, None) for entry in entries])


def load_extractor(path: str, store: BaseStore | None = None) -> CallableExtractor:
    """Import a custom extractor named ``module:callable``.

    Args:
        path: The import path, e.g. ``"myapp.memory:extract"``.
        store: Handed to the callable as its third argument.

    Returns:
        An extractor for :class:`Deliverer`; the callable's awaitable results are awaited.

    Raises:
        ResolveError: A ``ValueError`` saying why ``path`` names no callable (module not found, attribute
            not found, ...: :mod:`reducing_saver.service.imports`).
    """
    return CallableExtractor(import_callable(path, "--extractor"), store)


def _is_data_error(exc: BaseException) -> bool:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg comes with the server extra
        return False
    return isinstance(exc, psycopg.DataError)
