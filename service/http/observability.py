"""What the service tells its operators: Prometheus metrics, request ids and structured logs.

* ``ServiceMetrics`` owns one Prometheus registry per app: HTTP requests by route template, the bytes of
  the messages channel received and stored, messages pruned, unreadable messages channels, the backend's
  savers and the PostgreSQL pool, the extraction outbox's figures with their age, and the storage figures
  per tenant (``storage/watch.py``: measured in a thread of their own, never during a scrape).
* ``ObservabilityMiddleware`` is pure ASGI: it accepts or makes the request id, echoes it in
  ``X-Request-ID``, exposes it to log records, counts and times the request, and writes one access log
  line.
* ``configure_logging`` installs one handler on the root logger: JSON lines (or text), with the request
  id on every record and the database password redacted from every line.

With several uvicorn workers (``serve --workers N``), every worker answers ``/metrics`` with the figures
of all of them added up (prometheus_client's multiprocess mode, in a folder ``serve`` creates and
removes). ``/metrics`` never waits on the database: its figures are read in the background and carry
their age.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import math
import os
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any, Literal
from urllib.parse import unquote, urlsplit

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reducing_saver.service.http.errors import send_error
from reducing_saver.service.messages_codec import SafeMessagesCodec
from reducing_saver.service.storage import background
from reducing_saver.service.version import __version__
from reducing_saver.wire import (
    DELTA_HISTORY_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    PER_STEP_PATHS,
    READY_PATH,
    Blob,
)

access_logger = logging.getLogger("reducing_saver.access")
logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-ID"
MAX_REQUEST_ID_LENGTH = 128

#: Routes whose successful requests are access-logged at DEBUG, not INFO: those polled by probes and
#: scrapers, and the per-step saver calls (six a chat turn; a log line costs more CPU than the routing),
#: DeltaChannel history among them (LangGraph asks for it at the start of every run).
#: Errors are logged at INFO everywhere; the request metrics count every request.
QUIET_ROUTES = frozenset({HEALTH_PATH, READY_PATH, METRICS_PATH, DELTA_HISTORY_PATH, *PER_STEP_PATHS})

#: The status counted and logged for a request whose client closed the connection before its answer began
#: (nginx's "client closed request"): the client's doing, not a server error. Nothing is sent.
CLIENT_CLOSED = 499
#: The detail of the 503 sent to requests still running when the shutdown grace ends.
SHUTTING_DOWN = "the service is shutting down; retry (another replica, or this one once it is back)"

#: Latency buckets in seconds: a put is ~1 ms on loopback, so the default buckets (from 5 ms) are too coarse.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

_request_id: ContextVar[str | None] = ContextVar("reducing_saver_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being handled, or ``None`` outside a request."""
    return _request_id.get()


def accept_request_id(value: str | None) -> str:
    """``value`` when it is a usable request id (1 to 128 printable ASCII characters), else a new one."""
    if value and len(value) <= MAX_REQUEST_ID_LENGTH and value.isascii() and value.isprintable():
        return value
    return os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID


# -- measuring the messages channel ---------------------------------------------------------------


class _PutMeasure:
    """What the codec saw of one request's messages channel; settled when the request succeeds."""

    __slots__ = ("decoded", "kept", "received", "seen", "stored")

    def __init__(self) -> None:
        self.seen = False
        self.received = 0
        self.stored: int | None = None  # None: stored as received (not re-encoded)
        self.decoded = 0
        self.kept: int | None = None


# Set by the middleware for each request. The route runs in a worker thread with a copy of the context,
# which holds this same object, so the codec's notes reach the middleware.
_put_measure: ContextVar[_PutMeasure | None] = ContextVar("reducing_saver_put_measure", default=None)


class MeasuringCodec:
    """A ``MessagesCodec`` that notes, for the request in progress, the bytes and messages of a put.

    A put's messages channel is decoded once, by ``decode`` (by the put's operation, which hands the
    messages to ``ReducingSaver.put``, or by the reducer), and ``encode`` runs only when the reducer pruned
    something; a value that is not re-encoded is stored as received. The notes are
    settled into the counters by ``ObservabilityMiddleware`` once the request has succeeded, so a
    counter never counts a put that failed, and never moves backwards. Outside a request (no middleware)
    nothing is counted.
    """

    def __init__(self, inner: SafeMessagesCodec) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"MeasuringCodec({self.inner!r})"

    @property
    def unreadable(self) -> int:
        return self.inner.unreadable

    @property
    def allowed(self) -> frozenset[tuple[str, str]]:
        return self.inner.allowed

    def decode_write(self, value: Any) -> list[Any] | None:
        """``inner.decode_write``: the state before a step, read for what the agent removed (not a put's)."""
        return self.inner.decode_write(value)

    def decode_seed(self, value: Any) -> list[Any] | None:
        return self.inner.decode_seed(value)

    def is_snapshot(self, value: Any) -> bool:
        return self.inner.is_snapshot(value)

    def decode(self, value: Any) -> list[Any] | None:
        """``inner.decode(value)``, its bytes and messages noted as the put's."""
        messages = self.inner.decode(value)
        measure = _put_measure.get()
        if measure is not None and isinstance(value, Blob):
            measure.seen = True
            measure.received = len(value.data)
            measure.decoded = len(messages) if messages is not None else 0
        return messages

    def wrap(self, message: Any) -> Any:
        return self.inner.wrap(message)

    def encode(self, kept: list[Any], original: Any) -> Any:
        encoded = self.inner.encode(kept, original)
        measure = _put_measure.get()
        if measure is not None and measure.seen and isinstance(encoded, Blob):
            measure.stored = len(encoded.data)
            measure.kept = len(kept)
        return encoded


# -- metrics --------------------------------------------------------------------------------------


class ServiceMetrics:
    """The service's Prometheus metrics, in a registry of their own (one per app).

    Figures the process holds (requests, bytes, savers, the PostgreSQL pool) are always current. The
    extraction outbox's figures come from the database: a scrape starts a read in a worker thread and
    waits for it at most :data:`OUTBOX_WAIT_SECONDS`, so ``/metrics`` answers at once whatever the
    database does; ``reducing_saver_outbox_status_age_seconds`` says how old the outbox figures are (they
    are absent until a first read succeeded).

    With ``PROMETHEUS_MULTIPROC_DIR`` set (``serve --workers N`` sets it for its workers), every worker
    writes its figures there and a scrape of any worker adds up all of them: counters and histograms are
    summed, the saver and pool gauges are summed over the live workers, and the outbox figures are the
    most recently read ones.

    Args:
        codec: The service's codec; its ``unreadable`` count is read at scrape time.

    Attributes:
        registry: The registry of this process's metrics.
        multiprocess_dir: Where the workers' figures are (``None``: one process).
    """

    def __init__(self, codec: SafeMessagesCodec) -> None:
        self.codec = codec
        self.registry = CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_ENV) or None
        labels = ("method", "route", "status")
        self.requests = Counter(
            "reducing_saver_http_requests",
            "HTTP requests handled, by method, route template and status code.",
            labels,
            registry=self.registry,
        )
        self.latency = Histogram(
            "reducing_saver_http_request_duration_seconds",
            "Time from receiving a request to sending the last byte of its response.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.received_bytes = Counter(
            "reducing_saver_messages_received_bytes",
            "Bytes of the messages channel received by successful checkpoint puts (the serialized blob).",
            registry=self.registry,
        )
        self.stored_bytes = Counter(
            "reducing_saver_messages_stored_bytes",
            "Bytes of the messages channel stored by those puts, after reduction.",
            registry=self.registry,
        )
        self.pruned = Counter(
            "reducing_saver_messages_pruned",
            "Messages cut from the messages channel by successful puts, counted on every put that cuts "
            "them (before dedupe: LangGraph hands each put of a turn the whole list, so a message can "
            "count several times).",
            registry=self.registry,
        )
        self.delivered = Counter(
            "reducing_saver_messages_delivered",
            "Pruned messages handed to the on_prune hooks (after dedupe: once per message and namespace "
            "while the reducer remembers it).",
            registry=self.registry,
        )
        self.unreadable = Counter(
            "reducing_saver_messages_unreadable",
            "Messages channel values the service could not read (another serde, not a list of messages) "
            "and stored unreduced.",
            registry=self.registry,
        )
        self._unreadable_counted = 0
        self.latest_reads = Counter(
            "reducing_saver_latest_cache",
            "Reads of a thread's latest checkpoint (PostgreSQL, latest_cache_threads > 0), by result: hit "
            "(answered from memory once a query proved it current), miss (not held: read in full) or stale "
            "(held, but the database had moved on: read in full).",
            ("result",),
            registry=self.registry,
        )
        self._latest: Any = None
        self._latest_counted = dict.fromkeys(("hit", "miss", "stale"), 0)
        self.background_errors = Counter(
            "reducing_saver_background_errors",
            "Failed rounds of background work, by task (delivery, lease_renewal, summaries, sweep, "
            "storage_figures) and kind: transient (the database could not serve: an outage, a failover, a "
            "cut connection, a cancelled statement; logged once, as a warning) or fault (logged with its "
            "traceback).",
            ("task", "kind"),
            registry=self.registry,
        )
        self._background_counted = background.failures()
        self.idle_replaced = Counter(
            "reducing_saver_db_idle_connections_replaced",
            "Pooled PostgreSQL connections found broken by the check before lending an idle one (cut by a load "
            "balancer, a proxy or a restart) and replaced, unseen by any request (postgres_check_idle_seconds).",
            registry=self.registry,
        )
        self._idle_replaced_counted = 0
        build_info = Gauge(
            "reducing_saver_build_info",
            "The release this process runs, in the version label (always 1): during a rollout, the replicas "
            "of each release.",
            ("version",),
            multiprocess_mode="max",
            registry=self.registry,
        )
        build_info.labels(__version__).set(1)
        self._gauges: dict[str, Gauge] = {}
        self._backend: Any = None
        self._pool: Any = None
        self._outbox: Any = None
        self._storage: Any = None
        self._outbox_read_at: float | None = None
        self._outbox_reading: asyncio.Future[None] | None = None
        self._lock = threading.Lock()
        #: (method, route, status) -> the request counter's and latency histogram's children: looked up
        #: once (prometheus_client validates labels and takes a lock on every ``labels()``).
        self._request_children: dict[tuple[str, str, int], _RequestChildren] = {}
        self.registry.register(_StorageCollector(self))

    def measuring(self) -> MeasuringCodec:
        """The codec to hand the backend: the service's codec, with the put measurements."""
        return MeasuringCodec(self.codec)

    def count_delivered(self, messages: list[Any], namespace: tuple[str, ...]) -> None:
        """An ``on_prune`` hook: counts the messages the reducer delivers."""
        self.delivered.inc(len(messages))

    def watch(
        self, savers: Any, pool: Any = None, outbox: Any = None, storage: Any = None, *, latest: Any = None
    ) -> None:
        """Report the savers, the connection pool (PostgreSQL), the extraction outbox, the storage
        figures (``storage_watch.StorageWatch``, measured apart, read from memory) and the
        latest-checkpoint cache (``storage.latest.LatestCache``).

        ``None`` stops watching.
        """
        self._backend, self._pool, self._outbox, self._storage = savers, pool, outbox, storage
        self._latest = latest
        if savers is not None:
            self.update()

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        children = self._request_children.get((method, route, status))
        if children is None:
            labels = (method if method in _METHODS else "other", route, str(status))
            children = _request_children(self.requests.labels(*labels), self.latency.labels(*labels))
            if method in _METHODS:  # other methods share one label: their names are unbounded
                self._request_children[(method, route, status)] = children
        count, add_seconds, buckets, bounds = children
        count(1)
        add_seconds(seconds)
        buckets[bisect_left(bounds, seconds)](1)  # the first bucket whose bound is >= seconds, as observe()

    def settle(self, measure: _PutMeasure) -> None:
        self.received_bytes.inc(measure.received)
        self.stored_bytes.inc(measure.received if measure.stored is None else measure.stored)
        if measure.kept is not None:
            self.pruned.inc(measure.decoded - measure.kept)

    def _gauge(self, name: str, help_text: str, mode: Literal["livesum", "livemostrecent"]) -> Gauge:
        """The gauge ``name``, registered on first use (absent from scrapes until then)."""
        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = Gauge(name, help_text, multiprocess_mode=mode, registry=self.registry)
            self._gauges[name] = gauge
        return gauge

    def update(self) -> None:
        """Copy what the process holds (savers, pool, unreadable count) into the metrics; no I/O.

        Run at every scrape, and every :data:`UPDATE_SECONDS` by each worker when several share the
        figures (:meth:`start_updating`), so a scrape of one worker sees the others' current figures.
        """
        with self._lock:
            for (task, kind), count in background.failures().items():
                counted = self._background_counted.get((task, kind), 0)
                if count > counted:
                    self.background_errors.labels(task, kind).inc(count - counted)
                    self._background_counted[(task, kind)] = count
            unreadable = self.codec.unreadable
            if unreadable > self._unreadable_counted:
                self.unreadable.inc(unreadable - self._unreadable_counted)
                self._unreadable_counted = unreadable
            backend, pool, latest = self._backend, self._pool, self._latest
            if latest is not None:
                for result, count in dict(latest.counts).items():
                    if count > self._latest_counted[result]:
                        self.latest_reads.labels(result).inc(count - self._latest_counted[result])
                        self._latest_counted[result] = count
                self._gauge(
                    "reducing_saver_latest_cache_threads",
                    "Threads whose latest checkpoint the process holds in memory (latest_cache_threads).",
                    "livesum",
                ).set(len(latest))
            if backend is not None:
                self._gauge(
                    "reducing_saver_backend_savers",
                    "Saver instances of the backend (parallel saver calls).",
                    "livesum",
                ).set(backend.size)
                self._gauge(
                    "reducing_saver_backend_savers_borrowed",
                    "Saver instances lent to a call right now.",
                    "livesum",
                ).set(backend.borrowed)
            if pool is not None:
                replaced = getattr(pool, "replaced_idle", 0)
                if replaced > self._idle_replaced_counted:
                    self.idle_replaced.inc(replaced - self._idle_replaced_counted)
                    self._idle_replaced_counted = replaced
                stats = pool.get_stats()
                size, available = stats.get("pool_size", 0), stats.get("pool_available", 0)
                for name, help_text, value in (
                    ("size", "PostgreSQL connections open in the pool.", size),
                    ("available", "PostgreSQL connections idle in the pool.", available),
                    ("in_use", "PostgreSQL connections lent out by the pool.", size - available),
                    (
                        "requests_waiting",
                        "Callers waiting for a PostgreSQL connection.",
                        stats.get("requests_waiting", 0),
                    ),
                ):
                    self._gauge(f"reducing_saver_db_pool_{name}", help_text, "livesum").set(value)
            if self._outbox_read_at is not None:
                self._gauge(
                    "reducing_saver_outbox_status_age_seconds",
                    "Seconds since the outbox figures (reducing_saver_outbox_*) were read from the database: "
                    "they grow while the database does not answer.",
                    "livemostrecent",
                ).set(time.monotonic() - self._outbox_read_at)

    def start_updating(self, stop: threading.Event) -> None:
        """With several workers: :meth:`update` every :data:`UPDATE_SECONDS` in a daemon thread until
        ``stop`` is set."""
        if self.multiprocess_dir is None:
            return

        def run() -> None:
            while not stop.wait(UPDATE_SECONDS):
                try:
                    self.update()
                except Exception:
                    logger.exception("updating the metrics failed")

        threading.Thread(target=run, name="metrics", daemon=True).start()

    def read_outbox(self) -> None:
        """Read the outbox's figures from the database into the metrics (blocking)."""
        outbox = self._outbox
        if outbox is None:
            return
        status = outbox.status()
        for name, help_text in _OUTBOX_FIGURES:
            self._gauge(f"reducing_saver_outbox_{name}", help_text, "livemostrecent").set(status[name])
        self._gauge(
            "reducing_saver_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending message (0 when none is pending), when the figures were read.",
            "livemostrecent",
        ).set(status["oldest_pending_age_seconds"] or 0)
        self._outbox_read_at = time.monotonic()

    async def refresh(self, start: Callable[[Callable[[], None]], asyncio.Future[None]]) -> None:
        """Before a scrape: read the outbox's figures (``start`` runs a function in a worker thread), waiting
        at most :data:`OUTBOX_WAIT_SECONDS`. One read at a time: a read the database holds up is not
        repeated until it ends, and the scrape answers with the figures it has."""
        if self._outbox is None:
            return
        reading = self._outbox_reading
        if reading is None or reading.done():
            reading = self._outbox_reading = start(self.read_outbox)
            reading.add_done_callback(_log_failed_read)
        await asyncio.wait({reading}, timeout=OUTBOX_WAIT_SECONDS)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The metrics in the exposition format ``accept`` asks for (Prometheus text by default): this
        process's, or with several workers, all of theirs added up.

        Returns:
            ``(body, content_type)``.
        """
        self.update()
        registry = self.registry
        if self.multiprocess_dir is not None:
            registry = CollectorRegistry()
            WorkersCollector(registry, path=self.multiprocess_dir)
            # Every worker measures the whole database: its own storage figures are everyone's.
            registry.register(_StorageCollector(self))
        encoder, content_type = choose_encoder(accept or "")
        return encoder(registry), content_type


class WorkersCollector(MultiProcessCollector):
    """prometheus_client's collector of the workers' figures, passing over the files a worker has created
    but not yet sized. A worker starting (or restarting) creates each file empty and sizes it a moment
    later; read in that moment, an empty file made the whole scrape fail (``struct.error``: a 500)."""

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        self.folder = path
        super().__init__(registry, path=path)

    def collect(self) -> Iterable[Metric]:
        files = []
        for name in glob.glob(os.path.join(self.folder, "*.db")):
            try:
                if os.path.getsize(name) > 0:
                    files.append(name)
            except FileNotFoundError:  # a dead worker's file, removed meanwhile
                continue
        return self.merge(files, accumulate=True)


#: How long a scrape waits for the outbox's figures before answering with the ones it has.
OUTBOX_WAIT_SECONDS = 0.5
#: With several workers, how often each copies its own figures to where the others' scrapes read them.
UPDATE_SECONDS = 1.0
#: The environment variable that names the workers' shared metrics folder (prometheus_client's).
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

_OUTBOX_FIGURES = (
    ("pending", "Pruned messages waiting for extraction (retries included)."),
    ("in_flight", "Pruned messages claimed by a deliverer right now."),
    ("delivered", "Pruned messages delivered to long-term memory."),
    ("dead", "Pruned messages whose extraction failed every attempt (dead letters)."),
)


class _StorageCollector(Collector):
    """The storage figures per tenant, as the storage watch last measured them (no I/O)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        if self._metrics._storage is not None:
            yield from self._metrics._storage.collect()


#: What one request adds to (:func:`_request_children`): the request count, the latency sum, each latency
#: bucket (with the buckets' upper bounds).
_RequestChildren = tuple[
    Callable[[float], object], Callable[[float], object], list[Callable[[float], object]], list[float]
]


def _request_children(counter: Any, latency: Any) -> _RequestChildren:
    """What one request adds to: the counter's value, the histogram's sum and buckets (with their upper
    bounds), taken from the labelled children once. ``Counter.inc`` and ``Histogram.observe`` check that
    the metric is a child and look for exemplars, then walk the buckets in Python, on every call; these are
    the values they end up adding to (prometheus_client's, in-process or multiprocess alike)."""
    try:
        return (
            counter._value.inc,
            latency._sum.inc,
            [bucket.inc for bucket in latency._buckets],
            list(latency._upper_bounds),
        )
    except AttributeError:  # another prometheus_client layout: its public API
        return counter.inc, latency.observe, [lambda _: None], [math.inf]


def _log_failed_read(reading: asyncio.Future[None]) -> None:
    if not reading.cancelled() and (error := reading.exception()) is not None:
        logger.warning("reading the extraction outbox for /metrics failed: %s", error)


# -- the middleware -------------------------------------------------------------------------------


def _route_template(scope: Scope, paths: frozenset[str]) -> str:
    """The matched route's path template (never the raw path, whose values are unbounded)."""
    path = getattr(scope.get("route"), "path", None)
    if path is not None:
        return path
    # Answered before routing (the hot path, a 413 from the body limit), or matched nothing. Every route
    # of the service is a fixed path, so a set lookup answers.
    return scope["path"] if scope["path"] in paths else "unmatched"


class ObservabilityMiddleware:
    """Request id, access log and request metrics for every HTTP request, as pure ASGI.

    The request id comes from the ``X-Request-ID`` header when it is 1 to 128 printable ASCII characters,
    else it is 32 new random hex digits; it is echoed in the response's ``X-Request-ID`` and carried by
    every log record written while the request runs (threads the route runs in included).

    Args:
        app: The ASGI app to wrap.
        metrics: Where request counts, latencies and put measurements go.
        paths: The app's route paths (all fixed): the label of a request to one of them is its path,
            of any other request ``"unmatched"``.
    """

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value.decode("latin-1")
                break
        request_id = accept_request_id(given)
        id_header = (b"x-request-id", request_id.encode("ascii"))
        measure = _PutMeasure()
        status = 0
        disconnected = False

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        async def receive_noting_disconnect() -> Message:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
            return message

        id_token = _request_id.set(request_id)
        measure_token = _put_measure.set(measure)
        try:
            await self.app(scope, receive_noting_disconnect, send_with_id)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when the shutdown grace ends: the database work
            # they wait for is moot, the client may retry elsewhere. A 503, never a 500 with a traceback.
            if not status:
                await send_error(send_with_id, 503, SHUTTING_DOWN, [(b"retry-after", b"1")])
        except Exception:
            if status or not disconnected:
                raise
            # The client went away before its answer began: what failed after that is moot.
        finally:
            if not status:
                # No answer at all: the client closed the request (nginx's 499), or the app raised before
                # answering (Starlette's error middleware sends the 500).
                status = CLIENT_CLOSED if disconnected else 500
            seconds = time.perf_counter() - started
            route = _route_template(scope, self.paths)
            self.metrics.observe_request(scope["method"], route, status, seconds)
            if measure.seen and status < 400:
                self.metrics.settle(measure)
            level = logging.DEBUG if route in QUIET_ROUTES and status < 400 else logging.INFO
            if access_logger.isEnabledFor(level):
                duration_ms = round(seconds * 1000, 3)
                access_logger.log(
                    level,
                    "%s %s %d %.1fms",
                    scope["method"],
                    scope["path"],
                    status,
                    duration_ms,
                    extra={
                        "method": scope["method"],
                        "route": route,
                        "status": status,
                        "duration_ms": duration_ms,
                    },
                )
            _put_measure.reset(measure_token)
            _request_id.reset(id_token)


# -- logging --------------------------------------------------------------------------------------


class RequestIdFilter(logging.Filter):
    """Puts the current request id (or ``None``) on each record as ``request_id``.

    Attach it to a handler, not a logger: handler filters see records propagated from every logger.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


class _Redacting:
    """Replaces secrets (the database password) in every formatted line with ``***``."""

    secrets: tuple[str, ...] = ()

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


# Attributes every LogRecord has; anything else on a record came from ``extra=`` and goes in the JSON.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "request_id",
    "color_message",  # uvicorn's ANSI-coloured copy of the message
}


class JsonFormatter(_Redacting, logging.Formatter):
    """One JSON object per record: ``timestamp``, ``level``, ``logger``, ``message``, ``request_id``, the
    record's ``extra`` fields, and ``exception`` / ``stack`` when present.

    Args:
        secrets: Strings that must never appear in a log line; each is replaced by ``***``.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and key not in payload:
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            payload["exception"] = record.exc_text
        if record.stack_info:
            payload["stack"] = self.formatStack(record.stack_info)
        line = orjson.dumps(payload, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        return self.redact(line)


class TextFormatter(_Redacting, logging.Formatter):
    """``time LEVEL logger [request id] message``, for people reading a terminal."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s", defaults={"request_id": "-"}
        )
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            # A copy: other handlers of the same record must still see None.
            record = logging.makeLogRecord({**record.__dict__, "request_id": "-"})
        return self.redact(super().format(record))


def url_secrets(url: str) -> tuple[str, ...]:
    """The password of ``url`` as written and percent-decoded (empty when there is none)."""
    password = urlsplit(url).password
    if not password:
        return ()
    return tuple({password, unquote(password)})


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def log_handler(
    log_format: str = "auto", *, secrets: Iterable[str] = (), stream: IO[str] | None = None
) -> logging.Handler:
    """A stream handler with the service's formatter and the request id filter.

    Args:
        log_format: ``"json"`` (one object per line), ``"text"``, or ``"auto"``: text when ``stream`` is a
            terminal, JSON otherwise.
        secrets: Strings redacted from every line.
        stream: Where lines go (default: stderr).
    """
    stream = stream or sys.stderr
    if log_format == "auto":
        log_format = "text" if _is_terminal(stream) else "json"
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(secrets) if log_format == "json" else TextFormatter(secrets))
    handler.addFilter(RequestIdFilter())
    handler._reducing_saver = True  # type: ignore[attr-defined]
    return handler


def configure_logging(settings: Any, *, stream: IO[str] | None = None) -> logging.Handler:
    """Route every log record of the process (uvicorn's included) through one handler on the root logger.

    Replaces a handler this function installed before; leaves other handlers alone. Start uvicorn with
    ``log_config=None`` so it adds no handlers of its own.

    Args:
        settings: The service ``Settings`` (``log_format``, ``log_level``, ``database``).
        stream: Where lines go (default: stderr).

    Returns:
        The installed handler.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_reducing_saver", False):
            root.removeHandler(handler)
    # Plain API keys (REDUCING_SAVER_API_KEYS) are redacted too, should one ever reach a log line.
    keys = getattr(settings, "api_keys", None)
    plain = [pair.partition("=")[2].strip() for pair in keys.get_secret_value().split(",")] if keys else []
    secrets = (*url_secrets(settings.database), *(key for key in plain if key))
    handler = log_handler(settings.log_format, secrets=secrets, stream=stream)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    return handler


__all__ = [
    "REQUEST_ID_HEADER",
    "JsonFormatter",
    "MeasuringCodec",
    "ObservabilityMiddleware",
    "RequestIdFilter",
    "ServiceMetrics",
    "TextFormatter",
    "accept_request_id",
    "configure_logging",
    "current_request_id",
    "log_handler",
    "url_secrets",
]
