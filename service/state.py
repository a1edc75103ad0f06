"""What every request of one app shares: settings, keys, the reducer, metrics, and the open backend.

``Service.open`` (the app's lifespan) opens the backend once, wraps its savers in reducing savers, and
starts the extraction deliverer and the TTL sweeper; ``Service.close`` stops them. Requests reach the
database only through :meth:`Service.call` (a saver operation) and :meth:`Service.blocking` (anything
else): both run in worker threads and give up after ``db_timeout_seconds`` with a 503, so the event loop
never waits on the database.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from reducing_saver.reducer import MessageReducer, ReducingSaver, Removals
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.configuration.store import store_options
from reducing_saver.service.encryption import Sealer, encrypting, keyless, sealer_for
from reducing_saver.service.errors import Unavailable
from reducing_saver.service.extraction.recorder import Memory, PutRecords
from reducing_saver.service.imports import import_callable
from reducing_saver.service.messages_codec import SafeMessagesCodec, to_message
from reducing_saver.service.security.extensions import ExtensionPolicy
from reducing_saver.service.storage import Backend, SaverPool, open_backend
from reducing_saver.service.storage.latest import LatestCache
from reducing_saver.service.storage.watch import StorageWatch
from reducing_saver.service.summaries.setup import RunningSummaries
from reducing_saver.service.ttl.sweeper import Sweeper, open_sweeper

logger = logging.getLogger("reducing_saver.service")

T = TypeVar("T")

#: Worker threads for database work that needs no saver (probes, outbox status, sweep status).
BLOCKING_THREADS = 4
_STOPPED = "the service is starting or stopping"


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def finish_within(deadline: float, what: str, step: Callable[[], Any]) -> bool:
    """Run ``step`` in a daemon thread until it ends or ``deadline`` (``time.monotonic()``) passes.

    Returns:
        Whether it ended in time; a step left running is logged and never waited for again.
    """
    done = threading.Event()

    def run() -> None:
        try:
            step()
        except Exception:
            logger.exception("shutdown: %s failed", what)
        finally:
            done.set()

    threading.Thread(target=run, name=f"shutdown: {what}", daemon=True).start()
    if done.wait(_left(deadline)):
        return True
    logger.warning(
        "shutdown: %s did not end in time (the database does not answer); leaving it behind: outbox rows "
        "this process held come back when their lease ends",
        what,
    )
    return False


def _close_backend(backend: Backend, deadline: float) -> None:
    backend.close(timeout=_left(deadline))


def _message_hooks(paths: list[str]) -> list[Callable[..., Any]]:
    """Operator hooks get the pruned messages as LangChain objects (or dicts for custom classes)."""
    hooks = []
    for path in paths:
        hook = import_callable(path, "--on-prune")

        def call(messages: list[Any], namespace: tuple[str, ...], hook: Callable[..., Any] = hook) -> Any:
            return hook([to_message(m) for m in messages], namespace)

        hooks.append(call)
    return hooks


class Service:
    """The state of one app: built with the app, opened by its lifespan.

    Args:
        settings: The service settings.
        extra_hooks: More ``on_prune`` hooks (embedding, tests), called with the pruned messages as
            ``model_dump()`` dicts and the namespace.
        metrics: Makes the app's metrics from the messages codec (``ServiceMetrics`` of
            ``http/observability.py``, whose middleware records every request in them; the app passes it,
            so this layer imports nothing of the HTTP edge).
    """

    def __init__(
        self,
        settings: Settings,
        extra_hooks: list[Callable[..., Any]] | None = None,
        *,
        metrics: Callable[[SafeMessagesCodec], Any],
    ) -> None:
        self.settings = settings
        #: API key digests and tenants; None in single-tenant mode (no key configured).
        self.api_keys = settings.api_key_set
        self.tenant_mode = self.api_keys is not None
        self.backend_kind = settings.backend
        self.codec = SafeMessagesCodec(settings.allowed_message_classes)
        #: What extensions in stored values may name (every channel and pending write).
        self.extension_policy = ExtensionPolicy(settings.allowed_state_types, self.codec.allowed)
        self.metrics = metrics(self.codec)
        hooks = [*_message_hooks(settings.on_prune), *(extra_hooks or []), self.metrics.count_delivered]
        self.reducer = MessageReducer(settings.reducer_config(on_prune=hooks))
        self.backend: Backend | None = None
        self.savers: SaverPool | None = None
        self.memory: Memory | None = None
        self.sweeper: Sweeper | None = None
        self.storage_watch: StorageWatch | None = None
        #: Running summaries (``--summarizer``), else None.
        self.running_summaries: RunningSummaries | None = None
        #: The latest checkpoint of recently used threads (PostgreSQL; ``storage/latest.py``), shared by
        #: the savers; ``latest_cache_threads=0`` keeps none.
        self.latest_cache = LatestCache(settings.latest_cache_threads)
        self._blocking = ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="service")
        self._metrics_stop = threading.Event()

    # -- opening and closing ----------------------------------------------------------------------

    def open(self) -> None:
        """Open the backend, migrate its tables (or check them: ``--no-migrate``), start delivery and sweeps
        (blocking; the lifespan's)."""
        settings = self.settings
        backend = open_backend(
            settings.database,
            pool_size=settings.pool_size,
            timeout=settings.db_timeout_seconds,
            migrate=settings.migrate,
            postgres=settings.postgres,
            store_options=store_options(settings),
        )
        try:
            backend.setup()
            # Opened here, once, before any request or deliverer can ask for it concurrently; a backend
            # that cannot serve the store's settings refuses to start.
            backend.store()
            codec = self.metrics.measuring()
            if settings.summarizer:
                self.running_summaries = RunningSummaries(
                    settings,
                    backend,
                    wrap=codec.wrap,
                    registry=self.metrics.registry,
                    tenant_mode=self.tenant_mode,
                )
            summaries = self.running_summaries.summaries if self.running_summaries is not None else None

            sealer = self.sealer()
            # One policy for the pool: its note of each thread's last message list serves every saver.
            removals = Removals(settings.remember_removed, forget=self._forget)

            def wrap(inner: Any) -> ReducingSaver:
                # Without a key ring, a value another process sealed is refused, never passed on.
                inner = encrypting(inner, sealer) if sealer is not None else keyless(inner)
                return ReducingSaver(
                    inner,
                    self.reducer,
                    messages_key=settings.messages_key,
                    codec=codec,
                    record_pruned=self._record,
                    summaries=summaries,
                    removals=removals,
                )

            savers = SaverPool(
                [
                    wrap(inner)
                    for inner in backend.savers(
                        settings.pool_size,
                        latest_cache=self.latest_cache,
                        keep_checkpoints=settings.keep_checkpoints,
                    )
                ],
                timeout=settings.db_timeout_seconds,
                wrap_exceptions=backend.wrap_exceptions,
            )
            memory = Memory(settings, backend, tenant_mode=self.tenant_mode)
            self.memory = memory
            if settings.extract:
                memory.start()
                if self.running_summaries is not None:
                    self.running_summaries.start()
            # Before the savers are served: every put notes its thread's write in the TTL ledger.
            self.sweeper = open_sweeper(
                settings,
                backend,
                outbox=memory.outbox,
                registry=self.metrics.registry,
                tenant_mode=self.tenant_mode,
            )
            if settings.sweep:
                self.sweeper.start()
            if settings.storage_refresh_seconds > 0:
                self.storage_watch = StorageWatch(
                    backend,
                    interval=settings.storage_refresh_seconds,
                    messages_key=settings.messages_key,
                    tenants=self.api_keys.tenants if self.api_keys is not None else None,
                )
                self.storage_watch.start()
        except BaseException:
            self.close()
            backend.close()
            raise
        self.backend, self.savers = backend, savers
        self.metrics.watch(savers, backend.pool, memory.outbox, self.storage_watch, latest=self.latest_cache)
        self._metrics_stop = threading.Event()
        self.metrics.start_updating(self._metrics_stop)
        logger.info("backend %s ready (%d savers)", backend.kind, savers.size)

    def sealer(self) -> Sealer | None:
        """What seals stored values under ``--encryption`` (``None`` when it is off)."""
        return sealer_for(self.settings, tenant_mode=self.tenant_mode)

    def _record(self, pruned: list[Any], namespace: tuple[str, ...], config: Any, checkpoint: Any) -> None:
        assert self.memory is not None, "the backend records only while the service is open"
        self.memory.record(pruned, namespace, config, checkpoint)

    def _forget(self, keys: list[str], namespace: tuple[str, ...], config: Any) -> None:
        assert self.memory is not None, "the backend records only while the service is open"
        self.memory.forget(keys, namespace, config)

    def recording_with_checkpoint(self) -> AbstractContextManager[PutRecords | None]:
        """Around a put: the records to pass as its ``records=``, so the messages it prunes are recorded
        in the checkpoint's own transaction, where the backend can (``Memory.with_checkpoint``); ``None``
        elsewhere."""
        return self.memory.with_checkpoint() if self.memory is not None else nullcontext()

    def close(self) -> None:
        """Stop sweeps and delivery, then close the backend, all within ``db_timeout_seconds``.

        Called after in-flight requests have had the shutdown grace. A database that stopped answering
        must not keep the process alive: each step runs in a daemon thread, and a step still waiting when
        the time is up is left behind (logged). Outbox rows the deliverer could not hand back then come
        back when their lease ends, as after a crash.
        """
        deadline = time.monotonic() + self.settings.db_timeout_seconds
        backend, self.backend = self.backend, None
        savers, self.savers = self.savers, None
        sweeper, self.sweeper = self.sweeper, None
        memory, self.memory = self.memory, None
        watch, self.storage_watch = self.storage_watch, None
        if watch is not None:
            finish_within(deadline, "stopping the storage figures", lambda: watch.close(_left(deadline)))
        running, self.running_summaries = self.running_summaries, None
        if running is not None:
            finish_within(deadline, "stopping the summarizer", lambda: running.close(_left(deadline)))
        if sweeper is not None:
            finish_within(deadline, "stopping the TTL sweeper", lambda: sweeper.close(_left(deadline)))
        if memory is not None:
            finish_within(deadline, "stopping extraction delivery", lambda: memory.close(_left(deadline)))
        self._metrics_stop.set()
        self.metrics.watch(None)
        self.latest_cache.clear()
        if savers is not None:
            savers.close()
        # Idle threads end now; one still waiting on the database is left to the command's exit.
        self._blocking.shutdown(wait=False, cancel_futures=True)
        if backend is not None and finish_within(
            deadline, "closing the database", lambda: _close_backend(backend, deadline)
        ):
            logger.info("backend %s closed; shutdown complete", backend.kind)

    # -- running database work off the event loop --------------------------------------------------

    def open_savers(self) -> SaverPool:
        """The saver pool, or 503 while the service starts or stops."""
        if self.savers is None:
            raise Unavailable(_STOPPED)
        return self.savers

    def open_backend(self) -> Backend:
        """The open backend, or 503 while the service starts or stops."""
        if self.backend is None:
            raise Unavailable(_STOPPED)
        return self.backend

    def open_memory(self) -> Memory:
        """The outbox and deliverer, or 503 while the service starts or stops."""
        if self.memory is None:
            raise Unavailable(_STOPPED)
        return self.memory

    async def call(self, op: Callable[[Service, ReducingSaver, Any], T], body: Any) -> T:
        """``op(self, saver, body)`` in a worker thread with a saver of its own (503 if none frees up in
        ``db_timeout_seconds``)."""
        return await self.open_savers().call(lambda saver: op(self, saver, body))

    def background(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """``fn()`` in a worker thread, with the request's context; the future ends when ``fn`` does (no
        timeout: for work the caller waits for only as long as it chooses)."""
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self._blocking, context.run, fn)

    async def blocking(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """``fn(*args)`` in a worker thread; 503 when it has not finished within ``timeout`` seconds
        (default ``db_timeout_seconds``). The request's context (tenant, caps) goes with it."""
        limit = self.settings.db_timeout_seconds if timeout is None else timeout
        context = contextvars.copy_context()
        wrap_exceptions = self.backend.wrap_exceptions if self.backend is not None else nullcontext

        def run() -> T:
            with wrap_exceptions():  # the backend's driver errors, as storage errors
                return fn(*args)

        future = asyncio.get_running_loop().run_in_executor(self._blocking, context.run, run)
        try:
            return await asyncio.wait_for(future, limit)
        except TimeoutError:
            raise Unavailable(f"the database is unavailable: no answer within {limit:g} s") from None
