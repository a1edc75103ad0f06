"""TTL sweeps: threads idle for longer than their time to live are pruned to their head, or deleted.

The sweeper finds expired threads in the per-thread ledger (``reducing_saver_threads``), locks and
re-checks each one, applies the ``ttl_strategy`` and logs what it freed. It runs in a background thread
of each service process and as ``reducing-saver sweep [--dry-run]``. docs/operations.md ("How a sweep
works") has the design: the ledger, several sweepers at once, the bytes it counts and its limits.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from reducing_saver.reducer import thread_namespace, validate_namespace
from reducing_saver.service.encryption import EncryptedValueRefused, Sealer, encrypting, sealer_for
from reducing_saver.service.encryption.records import seal_entries
from reducing_saver.service.encryption.saver import is_sealed
from reducing_saver.service.leased_worker import default_worker_id
from reducing_saver.service.messages_codec import SafeMessagesCodec
from reducing_saver.service.security.tenancy import TenantScope, stored_thread_to_agent
from reducing_saver.service.storage.background import FailureLog
from reducing_saver.service.storage.ledger import (
    LOG_DAYS,
    TOUCH_CACHE_SIZE,
    TOUCH_EVERY,
    TTL_KEY,
    InvalidTTLError,
    Policy,
    Strategy,
    SweepReport,
    Window,
)
from reducing_saver.service.storage.outbox import OutboxEntry, make_entries
from reducing_saver.service.ttl.durations import parse_duration

logger = logging.getLogger(__name__)


# -- the status route's body -----------------------------------------------------------------------


class ProcessSweepFigures(BaseModel):
    """Sweeps run by the process that answers, since it started; with API keys, the counts cover only the
    calling tenant's threads (when and how long sweeps ran stays the process's)."""

    last_sweep_at: datetime | None = Field(description="When this process's last sweep finished.")
    last_sweep_seconds: float | None = Field(description="How long it took.")
    sweeps: int
    threads_pruned: int
    threads_deleted: int
    threads_refused: int = Field(description="keep_latest refused (the thread uses a DeltaChannel).")
    bytes_reclaimed: int
    errors: int = Field(description="Threads a sweep failed on (retried by the next sweep).")
    outbox_rows_purged: int = Field(
        0, description="Delivered outbox rows older than the retention that this process's sweeps deleted."
    )


class DatabaseSweepFigures(BaseModel):
    """Every process and ``reducing-saver sweep`` run on this database, from the sweep log; with API keys,
    counting only the calling tenant's threads."""

    threads_tracked: int = Field(description="Threads in the ledger.")
    threads_expired: int = Field(description="Threads past their TTL, waiting for a sweep.")
    threads_pruned: int
    threads_deleted: int
    bytes_reclaimed: int
    last_swept_at: datetime | None = Field(description="When a sweep last handled a thread.")
    log_days: int = Field(description="How many days the sweep log (and so these totals) covers.")


class SweepStatus(BaseModel):
    """``GET /v1/sweeps/status``."""

    strategy: Strategy
    default_ttl_seconds: float | None = Field(description="TTL of threads without their own; null: none.")
    sweep_interval_seconds: float
    sweeping: bool = Field(description="This process runs the background sweeper.")
    process: ProcessSweepFigures
    database: DatabaseSweepFigures


# -- the sweeper -----------------------------------------------------------------------------------


class _Metrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.sweeps = Counter("reducing_saver_sweeps", "TTL sweeps run by this process.", registry=registry)
        self.pruned = Counter(
            "reducing_saver_sweep_threads_pruned",
            "Expired threads pruned to their head checkpoint (keep_latest) by this process.",
            registry=registry,
        )
        self.deleted = Counter(
            "reducing_saver_sweep_threads_deleted",
            "Expired threads deleted (delete) by this process, after recording their window.",
            registry=registry,
        )
        self.bytes = Counter(
            "reducing_saver_sweep_bytes_reclaimed",
            "Bytes of checkpoint rows removed by this process's TTL sweeps.",
            registry=registry,
        )
        self.errors = Counter(
            "reducing_saver_sweep_errors",
            "Threads a TTL sweep failed on (retried next sweep).",
            registry=registry,
        )
        self.purged = Counter(
            "reducing_saver_outbox_purged",
            "Delivered outbox rows older than the retention deleted by this process's sweeps.",
            registry=registry,
        )
        self.retention = Gauge(
            "reducing_saver_outbox_retention_seconds",
            "How long delivered outbox rows are kept before a sweep deletes them.",
            multiprocess_mode="livemax",
            registry=registry,
        )
        self.last = Gauge(
            "reducing_saver_sweep_last_timestamp_seconds",
            "Unix time the last TTL sweep of this service finished (0: none yet; with several workers, "
            "the latest of theirs).",
            multiprocess_mode="max",
            registry=registry,
        )


_METRICS: weakref.WeakKeyDictionary[Any, _Metrics] = weakref.WeakKeyDictionary()
_METRICS_LOCK = threading.Lock()


def _metrics_for(registry: Any) -> _Metrics:
    """The sweep metrics of a registry, registered once (an app's lifespan may run more than once)."""
    with _METRICS_LOCK:
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = _METRICS[registry] = _Metrics(registry)
        return metrics


#: The counts of a sweep's report that this process adds up (``ProcessSweepFigures``).
_COUNTED = ("threads_pruned", "threads_deleted", "threads_refused", "bytes_reclaimed", "errors")


class Sweeper:
    """TTL bookkeeping on the put path, and the sweeps.

    Args:
        ledger: The backend's ledger (:func:`open_sweeper` builds it).
        policy: Strategy and default TTL.
        namespace_key: The ``configurable`` key naming a run's memory namespace.
        interval: Seconds between background sweeps.
        batch_size: Expired threads listed at a time.
        extract_on_delete: Whether :meth:`delete_thread` records the thread's window first.
        registry: A Prometheus registry for the sweep metrics (None: no metrics).
        tenant_mode: Stored thread ids are ``tenant:thread``: this process's figures are also kept per
            tenant, so a tenant's status shows only what sweeps did to its threads.
        outbox: The extraction outbox: explicit deletes record the window in it (SQLite, memory; PostgreSQL
            records in the transaction's own connection), and each sweep purges its delivered rows (None:
            neither).
        outbox_retention: Seconds delivered rows are kept (None: no purge).
    """

    def __init__(
        self,
        ledger: Any,
        policy: Policy,
        *,
        namespace_key: str = "memory_namespace",
        interval: float = 300.0,
        batch_size: int = 100,
        extract_on_delete: bool = False,
        registry: Any = None,
        tenant_mode: bool = False,
        outbox: Any = None,
        outbox_retention: float | None = None,
        encrypt_step: Callable[[], Any] | None = None,
    ) -> None:
        self.ledger = ledger
        self.encrypt_step = encrypt_step
        self.tenant_mode = tenant_mode
        self.outbox = outbox
        self.outbox_retention = outbox_retention
        self.policy = policy
        self.namespace_key = namespace_key
        self.interval = interval
        self.batch_size = batch_size
        self.extract_on_delete = extract_on_delete
        self._metrics = _metrics_for(registry) if registry is not None else None
        if self._metrics is not None and outbox_retention is not None:
            self._metrics.retention.set(outbox_retention)
        self._touched: OrderedDict[str, tuple[float, float | None, tuple[str, ...] | None]] = OrderedDict()
        self._touched_lock = threading.Lock()
        self._figures: dict[str, Any] = {
            "last_sweep_at": None,
            "last_sweep_seconds": None,
            "sweeps": 0,
            "threads_pruned": 0,
            "threads_deleted": 0,
            "threads_refused": 0,
            "bytes_reclaimed": 0,
            "errors": 0,
            "outbox_rows_purged": 0,
        }
        #: Thread prefix ("tenant:") -> that tenant's share of the counts in _figures (tenant mode only).
        self._tenant_figures: dict[str, dict[str, int]] = {}
        self._figures_lock = threading.Lock()
        self._sweep_lock = threading.Lock()
        self._discovered = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = FailureLog("sweep", logger)

    # -- the put path --------------------------------------------------------------------------------

    def thread_ttl(self, configurable: Mapping[str, Any]) -> float | None:
        """A put's own TTL (``checkpoint_ttl``: a duration string or seconds), or None.

        Raises:
            InvalidTTLError: If the value is not a positive duration.
        """
        value = configurable.get(TTL_KEY)
        if value is None:
            return None
        try:
            return parse_duration(value, name=f"config.configurable.{TTL_KEY}")
        except ValueError as exc:
            raise InvalidTTLError(str(exc)) from None

    def touch(self, config: Mapping[str, Any]) -> None:
        """Note a write to the config's thread, before it is stored: its age restarts, its TTL and memory
        namespace are kept. Skipped when this process touched the thread with the same TTL and
        namespace less than ``min(1 h, ttl / 10)`` ago.

        Raises:
            InvalidTTLError: If the put's ``checkpoint_ttl`` is not a duration (nothing is noted).
        """
        configurable = config.get("configurable") or {}
        thread_id = str(configurable["thread_id"])
        ttl = self.thread_ttl(configurable)
        given = configurable.get(self.namespace_key)
        namespace = None
        if isinstance(given, (str, list, tuple)):
            namespace = (given,) if isinstance(given, str) else tuple(given)
            try:
                validate_namespace(namespace)
            except ValueError:
                # Refused (422) by puts that write messages; never kept for the thread's last window.
                namespace = None
        now = time.monotonic()
        with self._touched_lock:
            seen = self._touched.get(thread_id)
        if seen is not None:
            at, seen_ttl, seen_namespace = seen
            same = (ttl is None or ttl == seen_ttl) and (namespace is None or namespace == seen_namespace)
            effective = seen_ttl if seen_ttl is not None else self.policy.default_ttl
            every = TOUCH_EVERY if effective is None else min(TOUCH_EVERY, effective / 10)
            if same and now - at < every:
                return
            ttl = ttl if ttl is not None else seen_ttl
            namespace = namespace if namespace is not None else seen_namespace
        self.ledger.touch(thread_id, ttl, namespace)
        with self._touched_lock:
            self._touched[thread_id] = (now, ttl, namespace)
            self._touched.move_to_end(thread_id)
            while len(self._touched) > TOUCH_CACHE_SIZE:
                self._touched.popitem(last=False)

    def copied(self, source_thread_id: str, target_thread_id: str) -> None:
        """Note, before a copy, that ``target`` is written now, with ``source``'s own TTL."""
        self.ledger.copy(str(source_thread_id), str(target_thread_id))
        with self._touched_lock:
            self._touched.pop(str(target_thread_id), None)

    def delete_extracting(self, thread_id: str) -> None:
        """A client's ``delete_thread`` under ``extract_on_delete``: the messages in the thread's window go
        to the outbox, then the thread is deleted (on PostgreSQL in one transaction, which waits for a
        sweep of the thread to finish). The ledger row stays: a later sweep removes it."""
        self.ledger.delete_extracting(str(thread_id), self.outbox)

    # -- sweeps --------------------------------------------------------------------------------------

    def sweep(self, *, dry_run: bool = False) -> SweepReport:
        """Handle every expired thread (or, with ``dry_run``, list them with the bytes they hold that the
        strategy would free, changing nothing). Failures are logged and counted; the thread is retried
        by the next sweep."""
        report = SweepReport(self.policy.strategy, self.policy.default_ttl, dry_run=dry_run)
        started = time.monotonic()
        with self._sweep_lock, self.ledger.session(self.policy) as session:
            if not self._discovered:
                found = self.ledger.discover(session=session)
                self._discovered = True
                if found:
                    logger.info(
                        "TTL ledger: %d thread(s) found without a row, aged by their newest checkpoint", found
                    )
            if dry_run:
                for thread_id in self.ledger.candidates(self.policy, None, (), session=session):
                    report.threads.append({"thread_id": thread_id, "bytes": session.measure(thread_id)})
            else:
                self._sweep(session, report)
                self.ledger.forget_log(LOG_DAYS, session=session)
        if not dry_run:
            self._purge_outbox(report)
            self._encrypt_rows(report)
        report.seconds = time.monotonic() - started
        if not dry_run:
            self._settle(report)
        return report

    def _sweep(self, session: Any, report: SweepReport) -> None:
        skip: list[str] = []
        seen: set[str] = set()
        while not self._stop.is_set():
            ids = self.ledger.candidates(self.policy, self.batch_size, skip, session=session)
            if not ids:
                return
            for thread_id in ids:
                if self._stop.is_set():
                    return
                if thread_id in seen:
                    skip.append(thread_id)  # still listed after being handled: never loop on it
                    continue
                seen.add(thread_id)
                try:
                    outcome = session.handle(thread_id)
                except Exception as exc:
                    self._failures.failed(
                        exc, f"TTL sweep failed on thread {thread_id!r}; the next sweep retries it"
                    )
                    report.errors += 1
                    self._count_for_tenant(thread_id, errors=1)
                    skip.append(thread_id)
                    continue
                if outcome is None:
                    skip.append(thread_id)
                    continue
                counted = f"threads_{outcome.action}"
                setattr(report, counted, getattr(report, counted) + 1)
                report.bytes_reclaimed += outcome.bytes
                self._count_for_tenant(thread_id, **{counted: 1, "bytes_reclaimed": outcome.bytes})

    def _count_for_tenant(self, thread_id: str, **counts: int) -> None:
        if not self.tenant_mode:
            return
        prefix = thread_id.partition(":")[0] + ":"
        with self._figures_lock:
            figures = self._tenant_figures.setdefault(prefix, dict.fromkeys(_COUNTED, 0))
            for name, amount in counts.items():
                figures[name] += amount

    def _purge_outbox(self, report: SweepReport) -> None:
        if self.outbox is None or self.outbox_retention is None or self._stop.is_set():
            return
        report.outbox_retention_seconds = self.outbox_retention
        try:
            report.outbox_rows_purged = self.outbox.purge_delivered(self.outbox_retention)
        except Exception as exc:
            self._failures.failed(exc, "purging delivered outbox rows failed; the next sweep retries")
            report.errors += 1

    def _encrypt_rows(self, report: SweepReport) -> None:
        """``--encryption migrate``: one pass of the encryption sweep (plain rows and old keys to the
        primary key)."""
        if self.encrypt_step is None or self._stop.is_set():
            return
        try:
            done = self.encrypt_step()
        except Exception as exc:
            self._failures.failed(exc, "the encryption sweep failed; the next sweep retries")
            report.errors += 1
            return
        if done.rewritten or done.remaining:
            logger.info(
                "encryption sweep: %d row(s) rewritten, %d left", sum(done.rewritten.values()), done.remaining
            )

    def _settle(self, report: SweepReport) -> None:
        with self._figures_lock:
            figures = self._figures
            figures["last_sweep_at"] = datetime.now(UTC)
            figures["last_sweep_seconds"] = round(report.seconds, 6)
            figures["sweeps"] += 1
            for name in _COUNTED:
                figures[name] += getattr(report, name)
            figures["outbox_rows_purged"] += report.outbox_rows_purged or 0
        if self._metrics is not None:
            self._metrics.purged.inc(report.outbox_rows_purged or 0)
            self._metrics.sweeps.inc()
            self._metrics.pruned.inc(report.threads_pruned)
            self._metrics.deleted.inc(report.threads_deleted)
            self._metrics.bytes.inc(report.bytes_reclaimed)
            self._metrics.errors.inc(report.errors)
            self._metrics.last.set(time.time())
        handled = (
            report.threads_pruned
            + report.threads_deleted
            + report.threads_refused
            + report.errors
            + (report.outbox_rows_purged or 0)
        )
        logger.log(
            logging.INFO if handled else logging.DEBUG,
            "TTL sweep (%s): %d pruned, %d deleted, %d refused, %d failed, %d bytes reclaimed, %d delivered "
            "outbox rows purged in %.3f s",
            report.strategy,
            report.threads_pruned,
            report.threads_deleted,
            report.threads_refused,
            report.errors,
            report.bytes_reclaimed,
            report.outbox_rows_purged or 0,
            report.seconds,
        )

    # -- the background thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Sweep now and then every ``interval`` seconds, in a daemon thread, until :meth:`stop`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="reducing-saver-sweeper", daemon=True)
        self._thread.start()
        logger.info(
            "TTL sweeper started (%s, default TTL %s, every %g s)",
            self.policy.strategy,
            "none" if self.policy.default_ttl is None else f"{self.policy.default_ttl:g} s",
            self.interval,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                report = self.sweep()
            except Exception as exc:
                self._failures.failed(exc, f"TTL sweep failed; retrying in {self.interval:g} s")
            else:
                if not report.errors:
                    self._failures.succeeded()
            self._stop.wait(self.interval)

    def status_figure(self, name: str) -> Any:
        """One of this process's sweep figures (``ProcessSweepFigures``)."""
        with self._figures_lock:
            return self._figures[name]

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the background thread; a sweep in progress stops after the thread it is handling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self, timeout: float | None = 30.0) -> None:
        self.stop(timeout)
        self.ledger.close()

    def status(self, interval: float | None = None, *, thread_prefix: str = "") -> dict[str, Any]:
        """The body of ``/v1/sweeps/status`` (see :class:`SweepStatus`).

        Args:
            interval: The sweep interval to report (default: this sweeper's).
            thread_prefix: Count only the threads (and sweep-log rows) whose stored id starts with it: a
                tenant's ``"tenant:"``; ``""`` counts the whole database and every thread this process
                swept.
        """
        with self._figures_lock:
            process = dict(self._figures)
            if thread_prefix:
                # When and how long sweeps ran is the process's; what they did, the tenant's own share.
                process.update(self._tenant_figures.get(thread_prefix) or dict.fromkeys(_COUNTED, 0))
        return {
            "strategy": self.policy.strategy,
            "default_ttl_seconds": self.policy.default_ttl,
            "sweep_interval_seconds": self.interval if interval is None else interval,
            "sweeping": self.running,
            "process": process,
            "database": self.ledger.database_status(self.policy, thread_prefix=thread_prefix),
        }


def window_reader(
    codec: SafeMessagesCodec,
    messages_key: str,
    agent_thread_id: Callable[[str], str] = str,
    sealer: Sealer | None = None,
) -> Window:
    """Reads the messages in the head checkpoint of a thread's root namespace, as outbox entries.

    ``agent_thread_id`` maps a stored thread id to the one the entries carry (tenant mode strips the
    tenant, as ``Memory.record`` does). ``sealer`` (``--encryption``): the head is opened, and the
    entries sealed, as the service's savers and ``Memory.record`` do. Without one, a head another process
    sealed cannot be read: ``EncryptedValueRefused`` (the thread is not deleted unextracted; a process with
    the key ring handles it).
    """

    def window(saver: Any, thread_id: str, namespace: tuple[str, ...]) -> list[OutboxEntry]:
        if sealer is not None:
            saver = encrypting(saver, sealer)
        item = saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
        if item is None:
            return []
        value = (item.checkpoint.get("channel_values") or {}).get(messages_key)
        if sealer is None and is_sealed(value):
            raise EncryptedValueRefused(f"the messages of thread {thread_id!r}")
        messages = codec.decode(value) if value is not None else None
        if messages is None:
            if value is not None:
                logger.warning("thread %r: its messages channel cannot be read; nothing extracted", thread_id)
            return []
        entries = make_entries(
            messages, namespace, thread_id=agent_thread_id(thread_id), checkpoint_id=item.checkpoint["id"]
        )
        return seal_entries(sealer, entries)

    return window


def open_sweeper(
    settings: Any,
    backend: Any,
    *,
    outbox: Any = None,
    registry: Any = None,
    tenant_mode: bool = False,
) -> Sweeper:
    """The sweeper for the service's settings, over the backend's ledger (set up).

    Args:
        settings: The service ``Settings``.
        backend: The process's open backend (``storage.open_backend``).
        outbox: The extraction outbox: deleted threads' windows are recorded in it (SQLite and memory;
            PostgreSQL records in the sweep's own transaction), and each sweep purges its delivered rows older
            than ``settings.outbox_retention``. ``None`` (a dry run): neither.
        registry: Prometheus registry for the sweep metrics.
        tenant_mode: API keys are configured: stored thread ids are ``tenant:thread``.
    """
    window = window_reader(
        SafeMessagesCodec(settings.allowed_message_classes),
        settings.messages_key,
        lambda thread_id: stored_thread_to_agent(thread_id, tenant_mode),
        sealer_for(settings, tenant_mode=tenant_mode),
    )
    ledger = backend.ledger(window=window, recorder=outbox, worker_id=default_worker_id())
    if tenant_mode:

        def tenant_namespace(thread_id: str) -> tuple[str, ...]:
            # As security.TenantScope.config_in makes it: ("tenants", tenant, "memories", thread).
            tenant, _, agent_thread = thread_id.partition(":")
            return TenantScope(tenant).namespace(thread_namespace(agent_thread))

        ledger.fallback_namespace = tenant_namespace
    return Sweeper(
        ledger,
        Policy(settings.ttl_strategy, settings.default_ttl),
        namespace_key=settings.namespace_key,
        interval=settings.sweep_interval,
        batch_size=settings.sweep_batch_size,
        extract_on_delete=settings.extract_on_delete,
        registry=registry,
        tenant_mode=tenant_mode,
        outbox=outbox,
        outbox_retention=settings.outbox_retention,
        encrypt_step=_encrypt_step(settings, backend, registry, tenant_mode),
    )


def _encrypt_step(settings: Any, backend: Any, registry: Any, tenant_mode: bool) -> Callable[[], Any] | None:
    """Under ``--encryption migrate`` on PostgreSQL or SQLite, a pass of ``encrypt-sweep`` with each TTL
    sweep."""
    if getattr(settings, "encryption", "off") != "migrate" or backend.kind not in ("postgres", "sqlite"):
        return None
    from reducing_saver.service.encryption.sweep import SweepStep, encrypt_sweep_of

    sealer = sealer_for(settings, tenant_mode=tenant_mode)
    assert sealer is not None, "--encryption migrate has a key ring"
    return SweepStep(encrypt_sweep_of(backend, sealer), registry)
