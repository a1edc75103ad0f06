"""Delivery of pruned messages from the outbox to long-term memory (a LangGraph ``BaseStore``).

A :class:`Deliverer` claims batches of outbox rows, groups them by memory namespace, hands each group to
an extractor and marks the rows done. While the extractor runs, a renewal thread keeps the claim's lease
alive, so a slow extractor does not let another worker take (and deliver again) the same rows; rows held
by a crashed process come back once their lease runs out. A failed group is retried message by message
(so one bad message does not hold back its neighbours); a failed message waits with exponential backoff
and jitter, and after ``max_attempts`` becomes a dead letter. An extractor raising
:class:`PermanentExtractionError` (a namespace the store refuses, a value the database cannot hold) parks
the message at once.

The extractor is any callable ``extractor(entries, namespace)`` (its result may be awaitable):

* :class:`StoreExtractor` (the default) writes each message into a ``BaseStore`` under the namespace,
  keyed by message id, as langchain_core's ``message_to_dict`` form plus ``thread_id`` and ``pruned_at``.
  Writing the same key again overwrites, so a redelivery leaves one item per message.
* :func:`load_extractor` wraps a ``module:callable`` of the user's, called as
  ``callable(messages, namespace, store)`` (sync or async).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import socket
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from itertools import groupby
from pathlib import Path
from typing import Any

from langchain_core.messages import BaseMessage, message_to_dict, messages_from_dict
from langgraph.store.base import BaseStore, InvalidNamespaceError, PutOp

from reducing_saver.service.imports import import_callable
from reducing_saver.service.messages_codec import EncodedMessage, to_message
from reducing_saver.service.outbox import EntryKey, Outbox, OutboxEntry
from reducing_saver.service.pglock import setup_lock

__all__ = [
    "CallableExtractor",
    "Deliverer",
    "PermanentExtractionError",
    "StoreExtractor",
    "entry_message",
    "load_extractor",
    "open_store",
    "validate_namespace",
]

logger = logging.getLogger(__name__)

#: Advisory lock key for the store migrations (distinct from the saver's and the outbox's).
_STORE_SETUP_LOCK_KEY = 0x72732D73746F7265  # "rs-store"

Extractor = Callable[[list[OutboxEntry], tuple[str, ...]], Any]


class PermanentExtractionError(Exception):
    """An extraction that no retry can fix: the rows go straight to the dead letters."""


def validate_namespace(namespace: Sequence[str]) -> None:
    """Refuse a memory namespace a LangGraph store would refuse, before anything is stored.

    The rules are those of ``BaseStore.put`` (PostgresStore joins labels with ``.``): at least one label;
    each a non-empty string without ``.`` or NUL; the first label not ``"langgraph"``.

    Raises:
        ValueError: Naming the offending label, e.g. for a 422 at put time.
    """
    labels = tuple(namespace)
    if not labels:
        raise ValueError("memory namespace is empty; it needs at least one label")
    for index, label in enumerate(labels):
        if not isinstance(label, str):
            raise ValueError(
                f"memory namespace {list(labels)!r}: label {index} ({label!r}) is a "
                f"{type(label).__name__}, not a string"
            )
        if not label:
            raise ValueError(f"memory namespace {list(labels)!r}: label {index} is an empty string")
        if "." in label:
            raise ValueError(
                f"memory namespace {list(labels)!r}: label {label!r} contains '.', which LangGraph stores "
                "refuse in namespace labels (a thread id used as a label must not contain dots either)"
            )
        if "\x00" in label:
            raise ValueError(f"memory namespace {list(labels)!r}: label {index} contains a NUL character")
    if labels[0] == "langgraph":
        raise ValueError(f"memory namespace {list(labels)!r}: the first label cannot be 'langgraph'")


def entry_message(entry: OutboxEntry) -> BaseMessage | dict[str, Any]:
    """The LangChain message an outbox entry holds; a dict for a class the service does not know.

    Built from the recorded ``module:Class`` through ``messages_codec.to_message`` (nothing is imported),
    or, for entries recorded from plain dicts, from the message's ``type``.
    """
    if entry.message_class:
        module, _, name = entry.message_class.partition(":")
        return to_message(EncodedMessage(entry.message, b"", module, name))
    try:
        return messages_from_dict([{"type": entry.message.get("type"), "data": entry.message}])[0]
    except Exception:
        return dict(entry.message)


class StoreExtractor:
    """The default extractor: every message becomes one item of a LangGraph ``BaseStore``.

    ``store.put(namespace, key, value)`` where ``key`` is the message id (the stable digest for id-less
    messages) and ``value`` is ``{**message_to_dict(message), "thread_id": ..., "pruned_at": <ISO 8601>}``
    (``{"type": ..., "data": <the dict>}`` for message classes the service does not know). Idempotent:
    delivering a message again overwrites its item. One ``store.batch`` per namespace group.

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
        ops = [PutOp(tuple(namespace), entry.key, self.value(entry)) for entry in entries]
        try:
            self.store.batch(ops)
        except InvalidNamespaceError as exc:
            raise PermanentExtractionError(str(exc)) from exc
        except Exception as exc:
            # A value the database cannot hold (PostgreSQL jsonb refuses "\u0000") fails the same way on
            # every retry; connection errors and the like stay retryable.
            if _is_data_error(exc):
                raise PermanentExtractionError(f"{type(exc).__name__}: {exc}") from exc
            raise

    @staticmethod
    def value(entry: OutboxEntry) -> dict[str, Any]:
        """The store item's value for ``entry``."""
        message = entry_message(entry)
        if isinstance(message, BaseMessage):
            body = message_to_dict(message)
        else:
            body = {"type": entry.message.get("type"), "data": dict(entry.message)}
        return {**body, "thread_id": entry.thread_id, "pruned_at": entry.pruned_at.isoformat()}


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


def load_extractor(path: str, store: BaseStore | None = None) -> CallableExtractor:
    """Import a custom extractor named ``module:callable``.

    Args:
        path: The import path, e.g. ``"myapp.memory:extract"``.
        store: Handed to the callable as its third argument.

    Returns:
        An extractor for :class:`Deliverer`; the callable's awaitable results are awaited.

    Raises:
        ValueError: If ``path`` is not ``module:name``, cannot be imported, or names no callable.
    """
    return CallableExtractor(import_callable(path, "extractor"), store)


def open_store(
    database_url: str, *, pool_size: int = 2, pool: Any = None
) -> tuple[BaseStore, Callable[[], None]]:
    """The long-term memory store for a service database URL, set up, and a function that closes it.

    ``postgresql://`` gives a ``PostgresStore`` over ``pool`` (a ``ConnectionPool`` with autocommit and
    dict rows, left open by the closer) or else over a pool of its own of ``pool_size`` connections
    (migrations under an advisory lock, so replicas starting together do not race), ``sqlite:///path`` a
    ``SqliteStore`` in that file, ``memory://`` an ``InMemoryStore``.
    """
    from reducing_saver.service.settings import BACKEND_SCHEMES, sqlite_path

    kind = BACKEND_SCHEMES.get(database_url.split(":", 1)[0])
    if kind == "memory":
        from langgraph.store.memory import InMemoryStore

        return InMemoryStore(), lambda: None
    if kind == "sqlite":
        from langgraph.store.sqlite import SqliteStore

        path = Path(sqlite_path(database_url))
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30.0)
        store = SqliteStore(conn)
        store.setup()
        return store, conn.close
    if kind == "postgres":
        import psycopg
        from langgraph.store.postgres import PostgresStore
        from psycopg.rows import dict_row
        from psycopg_pool import ConnectionPool

        close_pool: Callable[[], None] = lambda: None
        if pool is None:
            pool = ConnectionPool(
                database_url,
                min_size=1,
                max_size=pool_size,
                kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
                open=False,
                name="reducing-saver-store",
            )
            pool.open(wait=True, timeout=30.0)
            close_pool = pool.close
        try:
            store = PostgresStore(pool)
            # The lock gets a connection of its own: setup() takes pool connections while it is held.
            with psycopg.connect(database_url, autocommit=True) as conn:
                with setup_lock(conn, _STORE_SETUP_LOCK_KEY):
                    store.setup()
        except BaseException:
            close_pool()
            raise
        return store, close_pool
    raise ValueError(f"unsupported database URL {database_url!r}; use postgresql://, sqlite:/// or memory://")


# -- delivery --------------------------------------------------------------------------------------


def default_worker_id() -> str:
    """``host:pid:random``: unique per Deliverer, readable in the outbox's ``claimed_by``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Deliverer:
    """Moves outbox rows to an extractor: claim, renew while extracting, complete or retry, park.

    Args:
        outbox: Where the pruned messages wait.
        extractor: ``extractor(entries, namespace)``, called once per namespace group (its result is
            awaited when awaitable); raising means the group failed.
        worker_id: This deliverer's identity in ``claimed_by``; unique per instance (default
            ``host:pid:random``).
        batch_size: Rows claimed at a time.
        lease_seconds: How long a claim lasts without renewal; renewed every third of it while the
            extractor runs. Rows of a crashed worker come back after at most this long.
        max_attempts: Claims a row may take; a failure on the last one makes it a dead letter. A row
            claimed more often than this without any outcome (a worker crashing on it) is parked too.
        base_backoff: Seconds before the first retry; doubled each attempt, with jitter (50–100 %).
        max_backoff: The longest wait between attempts.
        idle_sleep: How long ``run_forever`` sleeps when there was less than a batch to do.
        linger: After a :meth:`wake`, how long to let more rows gather before claiming: one claim, one
            store batch and one completion then cover the pruned messages of many puts instead of one.
        rng: Source of the jitter (seed it for reproducible tests).
    """

    def __init__(
        self,
        outbox: Outbox,
        extractor: Extractor,
        *,
        worker_id: str | None = None,
        batch_size: int = 100,
        lease_seconds: float = 30.0,
        max_attempts: int = 8,
        base_backoff: float = 1.0,
        max_backoff: float = 300.0,
        idle_sleep: float = 1.0,
        linger: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if base_backoff < 0 or max_backoff < base_backoff:
            raise ValueError(
                f"need 0 <= base_backoff <= max_backoff, got base_backoff={base_backoff}, "
                f"max_backoff={max_backoff}"
            )
        self.outbox = outbox
        self.extractor = extractor
        self.worker_id = worker_id or default_worker_id()
        self.batch_size = batch_size
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.idle_sleep = idle_sleep
        self.linger = linger
        self.rng = rng or random.Random()
        #: Rows the last ``run_once`` claimed.
        self.last_claimed = 0
        self._stop_event: threading.Event | None = None
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"Deliverer({self.worker_id!r}, {self.extractor!r})"

    # -- one batch ---------------------------------------------------------------------------------

    def run_once(self) -> int:
        """Claim one batch and deliver it.

        Returns:
            How many rows were delivered (marked done).
        """
        entries = self.outbox.claim(self.worker_id, self.batch_size, self.lease_seconds)
        self.last_claimed = len(entries)
        if not entries:
            return 0
        renewer = _LeaseRenewer(self.outbox, self.worker_id, self.lease_seconds, [e.ident for e in entries])
        renewer.start()
        delivered = 0
        stopped = False
        try:
            for namespace, group in groupby(entries, key=lambda e: e.namespace):
                if self._stop_event is not None and self._stop_event.is_set():
                    stopped = True
                    break
                delivered += self._deliver_group(namespace, list(group), renewer)
        finally:
            renewer.stop()
        if stopped:
            # Shutting down: hand the untouched rows back at once instead of waiting out their lease.
            self.outbox.release(self.worker_id, renewer.outstanding())
        return delivered

    def _deliver_group(
        self, namespace: tuple[str, ...], group: list[OutboxEntry], renewer: _LeaseRenewer
    ) -> int:
        crashed = [e for e in group if e.attempts > self.max_attempts]
        for entry in crashed:
            message = (
                f"claimed {entry.attempts} times without an outcome (a worker crashed or lost its lease "
                "each time)"
            )
            self._fail(entry, message, permanent=True, renewer=renewer)
        group = [e for e in group if e.attempts <= self.max_attempts]
        if not group:
            return 0
        error = self._extract(group, namespace)
        if error is None:
            return self._complete(group, renewer)
        if len(group) == 1:
            permanent = isinstance(error, PermanentExtractionError)
            self._fail(group[0], _describe(error), permanent=permanent, renewer=renewer)
            return 0
        # One bad message must not hold back the others: retry the group one message at a time.
        delivered = 0
        for entry in group:
            single_error = self._extract([entry], namespace)
            if single_error is None:
                delivered += self._complete([entry], renewer)
            else:
                self._fail(
                    entry,
                    _describe(single_error),
                    permanent=isinstance(single_error, PermanentExtractionError),
                    renewer=renewer,
                )
        return delivered

    def _extract(self, entries: list[OutboxEntry], namespace: tuple[str, ...]) -> Exception | None:
        try:
            result = self.extractor(entries, namespace)
            if inspect.isawaitable(result):
                self._event_loop().run_until_complete(result)
        except Exception as exc:
            logger.warning(
                "extractor %r failed on %d message(s) of namespace %r: %s",
                self.extractor,
                len(entries),
                namespace,
                _describe(exc),
            )
            return exc
        return None

    def _complete(self, entries: list[OutboxEntry], renewer: _LeaseRenewer) -> int:
        keys = [e.ident for e in entries]
        # Stop renewing first: a renewal racing the completion would report a lost lease.
        renewer.finished(keys)
        done = self.outbox.complete(self.worker_id, keys)
        if done < len(keys):
            logger.warning(
                "%s: %d of %d delivered rows had been claimed by another worker (lease lost); they may be "
                "delivered again",
                self.worker_id,
                len(keys) - done,
                len(keys),
            )
        return done

    def _fail(self, entry: OutboxEntry, error: str, *, permanent: bool, renewer: _LeaseRenewer) -> None:
        renewer.finished([entry.ident])
        if permanent or entry.attempts >= self.max_attempts:
            held = self.outbox.fail(self.worker_id, entry.ident, error, dead=True)
            if held:
                logger.error(
                    "message %r of namespace %r is a dead letter after %d attempt(s): %s",
                    entry.key,
                    entry.namespace,
                    entry.attempts,
                    error,
                )
        else:
            retry_at = datetime.now(UTC) + timedelta(seconds=self.backoff(entry.attempts))
            self.outbox.fail(self.worker_id, entry.ident, error, retry_at=retry_at)

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt: exponential, capped, 50–100 % jitter."""
        delay = min(self.max_backoff, self.base_backoff * 2 ** max(attempts - 1, 0))
        return delay / 2 + self.rng.uniform(0, delay / 2)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        # One loop for the deliverer's life: async clients bound to a loop keep working across calls.
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop

    # -- running -----------------------------------------------------------------------------------

    def run_forever(self, stop_event: threading.Event) -> None:
        """Deliver until ``stop_event`` is set, then hand back what this worker still holds.

        Sleeps ``idle_sleep`` whenever a claim found less than a full batch; database errors are logged
        and retried with backoff, never raised.
        """
        self._stop_event = stop_event
        errors = 0
        try:
            while not stop_event.is_set():
                try:
                    self.run_once()
                    errors = 0
                except Exception:
                    errors += 1
                    logger.exception("%s: delivery round failed", self.worker_id)
                    stop_event.wait(min(self.max_backoff, self.idle_sleep * 2 ** min(errors, 8)))
                    continue
                if self.last_claimed < self.batch_size and not stop_event.is_set():
                    woken = self._wakeup.wait(self.idle_sleep)
                    self._wakeup.clear()
                    if woken and self.linger:
                        stop_event.wait(self.linger)
        finally:
            self.release()

    def wake(self) -> None:
        """Cut the current idle sleep short: rows were just recorded (same process) or it should stop."""
        self._wakeup.set()

    def start(self) -> threading.Thread:
        """Run :meth:`run_forever` in a daemon thread; :meth:`stop` ends it."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self!r} is already running")
        stop_event = threading.Event()
        self._stop_event = stop_event
        self._thread = threading.Thread(
            target=self.run_forever, args=(stop_event,), name=f"deliverer-{self.worker_id}", daemon=True
        )
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread :meth:`start` began: it finishes the namespace group in hand, hands back the
        rest of its batch, and ends."""
        if self._stop_event is not None:
            self._stop_event.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(
                    "%s: still extracting after %.0f s; its leases will expire", self.worker_id, timeout or 0
                )
            self._thread = None

    def release(self) -> int:
        """Hand back every row this worker holds (lease cleared, claim not counted), and close the event
        loop of async extractors.

        Returns:
            How many rows were handed back.
        """
        try:
            return self.outbox.release(self.worker_id)
        except Exception:
            logger.exception("%s: could not hand back its rows; their leases will expire", self.worker_id)
            return 0
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()


class _LeaseRenewer(threading.Thread):
    """Renews the lease of the rows in hand every third of the lease, until stopped."""

    def __init__(
        self, outbox: Outbox, worker_id: str, lease_seconds: float, keys: Iterable[EntryKey]
    ) -> None:
        super().__init__(name=f"lease-renewer-{worker_id}", daemon=True)
        self._outbox = outbox
        self._worker_id = worker_id
        self._lease = lease_seconds
        self._keys = set(keys)
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def finished(self, keys: Iterable[EntryKey]) -> None:
        with self._lock:
            self._keys.difference_update(keys)

    def outstanding(self) -> list[EntryKey]:
        with self._lock:
            return sorted(self._keys)

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def run(self) -> None:
        interval = max(self._lease / 3, 0.05)
        while not self._stopped.wait(interval):
            keys = self.outstanding()
            if not keys:
                continue
            try:
                renewed = self._outbox.renew(self._worker_id, keys, self._lease)
            except Exception:
                logger.exception("%s: lease renewal failed; retrying", self._worker_id)
                continue
            # Rows finished meanwhile are not renewed either; only count those still in hand.
            still = len(set(keys).intersection(self.outstanding()))
            if renewed < still:
                logger.warning(
                    "%s: lost the lease of %d row(s) to another worker", self._worker_id, still - renewed
                )


def _is_data_error(exc: BaseException) -> bool:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg comes with the server extra
        return False
    return isinstance(exc, psycopg.DataError)


def _describe(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
