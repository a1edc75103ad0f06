"""Storage by backend: PostgreSQL, SQLite or memory, chosen once, from the database URL.

Each backend is a package of its own (``postgres/``, ``sqlite/``, ``inmemory/``) holding its saver
extensions, outbox, TTL ledger, connection handling and SQL. What a backend provides is
:class:`Backend`; :func:`open_backend` is the one place that picks one. :class:`SaverPool` lends the
service's reducing savers to calls, off the event loop and with a bounded wait.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.store.base import BaseStore
from pydantic import BaseModel, Field

from reducing_saver.reducer import ReducingSaver
from reducing_saver.wire.bodies import StoredValues

T = TypeVar("T")

#: URL scheme -> backend name.
BACKEND_SCHEMES = {"postgresql": "postgres", "postgres": "postgres", "sqlite": "sqlite", "memory": "memory"}
#: Backend name -> the module that opens it.
_MODULES = {
    "postgres": "reducing_saver.service.storage.postgres",
    "sqlite": "reducing_saver.service.storage.sqlite",
    "memory": "reducing_saver.service.storage.inmemory",
}


def backend_kind(url: str) -> str:
    """``"postgres"``, ``"sqlite"`` or ``"memory"`` for a database URL.

    Raises:
        ValueError: For any other scheme, naming the ones supported.
    """
    scheme = urlsplit(url).scheme
    if scheme not in BACKEND_SCHEMES:
        raise ValueError(
            f"unsupported database URL scheme {scheme!r}; use postgresql://, sqlite:/// or memory://"
        )
    return BACKEND_SCHEMES[scheme]


class PostgresSettings(BaseModel):
    """How every PostgreSQL connection the service opens behaves (docs/operations.md, managed PostgreSQL).

    Every one: the pool, the start-up checks and set-up locks, a sweep's own connections, the commands. A
    group of the service's settings (``configuration/settings.py``), read by ``postgres/connections.py``.
    """

    postgres_prepared_statements: bool = Field(
        True,
        description="Prepare each statement on the server at its first use and reuse it by name (psycopg's "
        "prepare_threshold=0, as PostgresSaver.from_conn_string does). Turn it off behind a pooler in "
        "transaction mode that does not keep prepared statements per client: PgBouncer before 1.21 (Debian "
        "12 ships 1.18), or 1.21 and later with max_prepared_statements = 0. Left on there, the service "
        "refuses to start, naming this setting.",
    )
    postgres_check_idle_seconds: float = Field(
        1.0,
        ge=0,
        description="A pooled connection idle for longer than this is checked with one round trip before it "
        "is lent; one a load balancer, proxy or restart has cut is replaced, and no caller sees it. 0 checks "
        "every connection lent.",
    )
    postgres_keepalives_idle_seconds: int = Field(
        10, ge=1, description="TCP keepalive: seconds a connection is idle before the first probe."
    )
    postgres_keepalives_interval_seconds: int = Field(
        5, ge=1, description="TCP keepalive: seconds between probes that get no answer."
    )
    postgres_keepalives_count: int = Field(
        3, ge=1, description="TCP keepalive: probes without an answer before the connection counts as lost."
    )
    postgres_tcp_user_timeout_seconds: float = Field(
        15.0,
        ge=0,
        description="How long sent bytes may stay unacknowledged before the kernel drops the connection (a "
        "statement sent into a partition fails then, not after about 15 minutes of retransmissions); 0 "
        "leaves the kernel's default.",
    )


class StorageError(Exception):
    """The database a URL names cannot be opened or is unfit for the service (unreachable, missing, an
    encoding other than UTF-8). The message is one line for an operator, naming the database (without
    its password) and the problem; the command line prints it as it is."""


class DatabaseUnavailable(Exception):
    """The database cannot serve now: unreachable, a connection broken or not free in time, a statement
    cancelled, a file locked. The same call may succeed later (a 503); the message names the cause.

    Each backend raises it for its driver's errors (``<backend>/errors.py``: ``wrap_exceptions``)."""


class DatabaseTimeout(Exception):
    """The database cancelled a statement that ran past a limit the operator set (``statement_timeout``,
    ``lock_timeout``): not an outage, and the same call is likely to run as long again (a 504 the client
    does not retry); the message names the limit the database gave."""


class ValueRefused(Exception):
    """The database refused a value of the request (PostgreSQL's text and JSONB cannot hold U+0000, say):
    the same call fails again (a 422); the message names what was refused."""


class StoredDataError(Exception):
    """A stored value cannot be read as the encryption mode demands; the message names where it lives.

    ``encryption/envelope.py`` raises its subclasses (an integrity failure, an unknown key, plain text
    under ``required``); the storage raises :class:`EncryptedValueRefused`."""


class EncryptedValueRefused(StoredDataError):
    """A process running ``--encryption off`` met a value another process sealed (a rollout between
    modes): it has no key ring to open it, and never hands the envelope on as if it were the value (a 500
    naming it; a replica with the key ring can serve it)."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"{where} is encrypted at rest, and this process runs with --encryption off (no key ring): it "
            "cannot read it; a process with --encryption migrate or required and the key ring can"
        )


#: Each backend's test of whether a driver error is the database's passing trouble rather than a fault
#: of the code: an outage (what its ``wrap_exceptions`` turns into :class:`DatabaseUnavailable`) or a
#: statement cancelled by a limit (:class:`DatabaseTimeout`). Returns a one-line reason, else ``None``;
#: backends register theirs when imported (:func:`transient_test`).
_TRANSIENT_TESTS: list[Callable[[BaseException], str | None]] = []


def transient_test(test: Callable[[BaseException], str | None]) -> Callable[[BaseException], str | None]:
    """Register a backend's test for :func:`transient` (a decorator)."""
    _TRANSIENT_TESTS.append(test)
    return test


def transient(exc: BaseException) -> str | None:
    """Why the database could not do this now, when ``exc`` (or an error it was raised from) is passing
    trouble: :class:`DatabaseUnavailable`, :class:`DatabaseTimeout`, a busy saver pool, or a driver error a
    backend counts as one. ``None`` for anything else (a fault to log with its traceback). Background
    work (delivery, summaries, sweeps) logs these once, as a warning."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (DatabaseUnavailable, DatabaseTimeout, SaversBusy)):
            return str(error)
        for test in _TRANSIENT_TESTS:
            reason = test(error)
            if reason is not None:
                return reason
        error = error.__cause__ or error.__context__
    return None


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


def sqlite_path(url: str) -> str:
    """``sqlite:///relative/file`` -> ``relative/file``; ``sqlite:////abs/file`` -> ``/abs/file``."""
    return url.split("sqlite://", 1)[1][1:] if url.startswith("sqlite://") else ""


class Backend(Protocol):
    """What a backend provides. One instance per process, opened by :func:`open_backend`."""

    #: ``"postgres"``, ``"sqlite"`` or ``"memory"``.
    kind: str
    #: The process's PostgreSQL connection pool (``None`` elsewhere); for metrics.
    pool: Any

    #: Whether the backend migrates its tables when it sets them up (``False``: ``--no-migrate``).
    migrates: bool

    def setup(self) -> None:
        """Bring every table up to date (:meth:`migrate`), or, when the backend may not migrate, check
        that they are (:meth:`check_schema`)."""

    def migrate(self) -> list[str]:
        """Apply what the database lacks: the service's own migrations (``<backend>/migrations.py``), then
        langgraph's (the checkpointer's and the store's ``setup()``); safe when replicas start together.
        Returns one line per migration applied.

        Raises:
            SchemaError: If the database has the service's tables at a version newer than the code knows.
        """

    def check_schema(self, why: str = ...) -> None:
        """Raise ``SchemaError`` unless every table is at the version the code uses (``why``: why this
        process does not migrate, for the message of a database that is behind)."""

    def refuse_newer_schema(self) -> None:
        """Raise ``SchemaError`` if the service's tables are at a version newer than the code knows (a
        command that only reads them: an older database is fine)."""

    def savers(
        self, count: int, latest_cache: Any = None, *, keep_checkpoints: int | None = None
    ) -> list[BaseCheckpointSaver]:
        """Up to ``count`` savers with every lifecycle capability, storing client blobs verbatim.

        ``latest_cache`` (``storage.latest.LatestCache``): PostgreSQL's savers share it to answer reads
        of a thread's latest checkpoint from memory once proven; SQLite and memory read locally and
        ignore it. ``keep_checkpoints``: the savers keep only the newest that many checkpoints of each
        thread and namespace (``lifecycle``; ``None``: all)."""

    def outbox(self) -> Any:
        """The extraction outbox (``storage.outbox.Outbox``), set up."""

    def summaries(self) -> Any:
        """The book of running summaries (``storage/summaries.py``), set up."""

    def store(self) -> BaseStore:
        """The long-term memory store, set up (closed with the backend), made with the ``store_options``
        the backend was opened with."""

    def ledger(self, *, window: Any, recorder: Any, worker_id: str) -> Any:
        """The TTL ledger (``storage.ledger``), set up."""

    def storage(self, selection: Any, *, messages_key: str) -> list[Any]:
        """What each thread of ``selection`` (``usage.Selection``) holds, largest first: bytes in
        checkpoints, blobs, writes, outbox and store, checkpoints kept, and the plain estimate
        (``usage.ThreadStorage``). Reads in a snapshot of its own; never blocks the savers."""

    def ready(self, timeout: float) -> None:
        """Raise unless the checkpoint tables answer within ``timeout`` seconds."""

    def wrap_exceptions(self) -> AbstractContextManager[None]:
        """A context in which the driver's errors become :class:`DatabaseUnavailable` or
        :class:`ValueRefused` (others pass unchanged): every request's database work runs in one."""

    def close(self, timeout: float = 5.0) -> None:
        """Close every connection the backend opened (PostgreSQL: waiting at most ``timeout`` seconds for
        the pool's threads)."""


def open_backend(
    url: str,
    *,
    pool_size: int = 4,
    timeout: float = 5.0,
    create: bool = True,
    migrate: bool = True,
    postgres: Any = None,
    store_options: Mapping[str, Any] | None = None,
) -> Backend:
    """Open the backend a database URL names.

    Args:
        url: ``postgresql://...``, ``sqlite:///path`` or ``memory://``.
        pool_size: PostgreSQL: connections of the process's one pool.
        timeout: PostgreSQL: seconds a caller waits for a pooled connection (then the database counts as
            unavailable); SQLite: ignored (its busy timeout is fixed).
        create: SQLite: create the file (and its folder) when missing (``serve``, ``worker``); read-only
            commands pass ``False``, so a mistyped path or another working folder creates nothing.
        migrate: Apply the migrations the database lacks when the backend sets up its tables; ``False``
            (``--no-migrate``): change no table, refuse (``SchemaError``) a database that is behind.
        postgres: PostgreSQL: how every connection is opened (``Settings.postgres``: prepared statements,
            idle checks, TCP keepalives); the settings' defaults when omitted. Other backends ignore it.
        store_options: The store's keyword arguments, ``index`` and ``ttl``
            (``configuration.store.store_options``); none when omitted. Read by :meth:`Backend.store`.

    Raises:
        StorageError: If the database cannot be reached, does not exist (SQLite with ``create=False``;
            PostgreSQL always: the service creates tables, never databases) or is not UTF-8 (PostgreSQL).
    """
    return backend_module(url).open(
        url,
        pool_size=pool_size,
        timeout=timeout,
        create=create,
        migrate=migrate,
        postgres=postgres,
        store_options=store_options or {},
    )


def backend_module(url: str) -> Any:
    """The package of the backend a database URL names (its ``open`` and ``store_refusal``)."""
    return importlib.import_module(_MODULES[backend_kind(url)])


class SaversBusy(Exception):
    """No saver became free within the wait: the database is slow or hangs (a 503)."""


def stored_values(saver: BaseCheckpointSaver) -> StoredValues:
    """Which channel values ``saver.put`` stores, by the backend's markers: every value unless it
    ``stores_written_channels_only`` (then those of ``new_versions``, and primitive values too where it
    ``inlines_primitive_values``)."""
    if not getattr(saver, "stores_written_channels_only", False):
        return "all"
    return "changed_and_inline" if getattr(saver, "inlines_primitive_values", False) else "changed"


class SaverPool:
    """The service's reducing savers, lent one per call and run in worker threads.

    The event loop never runs a saver: :meth:`call` waits (at most ``timeout`` seconds) for a free saver
    on the loop, then runs the call in a thread of a pool as large as the savers. A database that hangs
    ties up threads, never the loop, so probes and other tenants' requests that need no saver still get
    answers, and calls that find no saver in time get :class:`SaversBusy`.

    PostgresSaver serializes every call on one lock per instance, so the PostgreSQL backend gets one
    saver per pooled connection; SQLite and memory have one saver. Calls run inside
    ``wrap_exceptions()`` (the backend's: driver errors become the storage errors of this module).
    """

    def __init__(
        self,
        savers: list[ReducingSaver],
        *,
        timeout: float,
        wrap_exceptions: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self._savers = savers
        self._wrap_exceptions = wrap_exceptions
        self._idle: queue.SimpleQueue[ReducingSaver] = queue.SimpleQueue()
        for saver in savers:
            self._idle.put(saver)
        self.timeout = timeout
        self.capabilities = savers[0].capabilities
        self.stored_values = stored_values(savers[0].inner)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"saver-{index}", daemon=True)
            for index in range(len(savers))
        ]
        for thread in self._threads:
            thread.start()
        self._slots: asyncio.Semaphore | None = None

    @property
    def size(self) -> int:
        return len(self._savers)

    @property
    def borrowed(self) -> int:
        """Savers lent to a call right now."""
        return len(self._savers) - self._idle.qsize()

    async def call(self, fn: Callable[[ReducingSaver], T]) -> T:
        """``fn(saver)`` in a worker thread with a saver of its own.

        Raises:
            SaversBusy: If no saver is free within ``timeout`` seconds.
        """
        if self._slots is None:
            self._slots = asyncio.Semaphore(len(self._savers))
        if self._slots.locked():  # every saver is busy: wait, but not for ever (a timer, no task)
            try:
                async with asyncio.timeout(self.timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise SaversBusy(self._busy()) from None
        else:  # a saver is free: no timer
            await self._slots.acquire()
        try:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            # The call sees the request's context (tenant, caps, metrics notes), as the loop does.
            self._jobs.put((loop, future, fn, contextvars.copy_context()))
            return await future
        finally:
            self._slots.release()

    def _work(self) -> None:
        """A worker thread: run jobs with a saver each, hand results back to their loop.

        Leaner than ``loop.run_in_executor``: no concurrent future to chain, one wake-up each way
        (measured: 10-25 us against 35-80 us a hop on this kind of machine).
        """
        while (job := self._jobs.get()) is not None:
            loop, future, fn, context = job
            try:
                saver = self._take()  # borrow(), without its generator: every saver call comes here
                try:
                    with self._wrap_exceptions():
                        result = context.run(fn, saver)
                finally:
                    self._idle.put(saver)
            except BaseException as exc:  # handed to the awaiting request, which maps it to a status
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    @contextmanager
    def borrow(self) -> Iterator[ReducingSaver]:
        """A saver for one blocking call (worker threads, not the event loop); waits at most ``timeout``.

        Raises:
            SaversBusy: If none is free in time (a sweep or a stuck call holds them).
        """
        saver = self._take()
        try:
            yield saver
        finally:
            self._idle.put(saver)

    def _take(self) -> ReducingSaver:
        """A free saver, waiting at most ``timeout`` (:class:`SaversBusy` after that)."""
        try:
            return self._idle.get(timeout=self.timeout)
        except queue.Empty:
            raise SaversBusy(self._busy()) from None

    def _busy(self) -> str:
        return (
            f"the database is unavailable: all {len(self._savers)} saver(s) stayed busy for "
            f"{self.timeout:g} s (setting db_timeout_seconds)"
        )

    def close(self) -> None:
        """Let the worker threads end once the jobs queued before this are done (they are daemons: a
        call stuck on the database does not hold the process)."""
        for _ in self._threads:
            self._jobs.put(None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the request went away (client disconnect, shutdown)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


__all__ = [
    "BACKEND_SCHEMES",
    "Backend",
    "DatabaseTimeout",
    "DatabaseUnavailable",
    "SaverPool",
    "SaversBusy",
    "ValueRefused",
    "backend_kind",
    "open_backend",
    "transient",
    "transient_test",
    "sqlite_path",
    "stored_values",
]
