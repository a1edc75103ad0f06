"""The storage figures ``/metrics`` shows: measured every ``storage_refresh_seconds`` in a thread of their
own, answered from memory at scrape time.

A pass measures every thread (``Backend.storage``) and adds the figures up per tenant. The ``tenant``
label takes bounded values: the tenants of the configured API keys (at most :data:`MAX_TENANT_LABELS`,
the largest first), ``"other"`` for the rest (stored ids of a tenant whose key is gone, the smaller
tenants past the cap), and ``"default"`` in single-tenant mode. Thread ids never become labels.

Every process measures the whole database: replicas report the same figures (aggregate with ``max``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from reducing_saver.service.storage.background import FailureLog
from reducing_saver.service.storage.usage import Selection, ThreadStorage

logger = logging.getLogger("reducing_saver.service")

#: Most tenant label values; the smaller tenants past it add up under "other".
MAX_TENANT_LABELS = 100
#: The label of single-tenant mode's one tenant, and of the tenants beyond the cap.
DEFAULT_TENANT, OTHER_TENANT = "default", "other"
#: ``kind`` label -> the ``ThreadStorage`` field it adds up.
KINDS = {
    "checkpoints": "checkpoint_bytes",
    "blobs": "blob_bytes",
    "writes": "write_bytes",
    "outbox": "outbox_bytes",
    "store": "store_bytes",
}


@dataclass
class TenantFigures:
    """One tenant's figures, added up over its threads."""

    threads: int = 0
    checkpoints: int = 0
    plain_estimate: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, thread: ThreadStorage) -> None:
        self.threads += 1
        self.checkpoints += thread.checkpoints
        self.plain_estimate += thread.plain_estimate
        for kind, name in KINDS.items():
            self.bytes[kind] += getattr(thread, name)

    def merge(self, other: TenantFigures) -> None:
        self.threads += other.threads
        self.checkpoints += other.checkpoints
        self.plain_estimate += other.plain_estimate
        for kind in KINDS:
            self.bytes[kind] += other.bytes[kind]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def per_tenant(threads: Iterable[ThreadStorage], tenants: frozenset[str] | None) -> dict[str, TenantFigures]:
    """``threads`` added up per tenant label (see the module docstring for the bounded label values).

    Args:
        threads: Measured threads.
        tenants: The configured tenants; ``None`` in single-tenant mode.
    """
    figures: dict[str, TenantFigures] = defaultdict(TenantFigures)
    for thread in threads:
        if tenants is None:
            label = DEFAULT_TENANT
        else:
            label = thread.tenant if thread.tenant in tenants else OTHER_TENANT
        figures[label].add(thread)
    named = sorted((t for t in figures if t != OTHER_TENANT), key=lambda t: -figures[t].total)
    for label in named[MAX_TENANT_LABELS:]:
        figures[OTHER_TENANT].merge(figures.pop(label))
    return dict(figures)


class StorageWatch:
    """Measures every thread's storage every ``interval`` seconds in a daemon thread.

    Args:
        backend: The open backend.
        interval: Seconds between passes (the first runs at :meth:`start`).
        messages_key: The messages channel.
        tenants: The configured tenants, or ``None`` in single-tenant mode.
    """

    def __init__(
        self, backend: Any, *, interval: float, messages_key: str, tenants: frozenset[str] | None
    ) -> None:
        self.backend = backend
        self.interval = interval
        self.messages_key = messages_key
        self.tenants = tenants
        #: The last pass's figures per tenant label (empty before the first).
        self.figures: dict[str, TenantFigures] = {}
        #: When the last pass ended (Unix time; 0: none yet) and how long it took.
        self.refreshed_at = 0.0
        self.duration = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = FailureLog("storage_figures", logger)

    def refresh(self) -> None:
        """One pass: measure every thread, replace the figures (scrapes see the old or the new, whole)."""
        started = time.monotonic()
        threads = self.backend.storage(
            Selection(tenant_mode=self.tenants is not None), messages_key=self.messages_key
        )
        self.figures = per_tenant(threads, self.tenants)
        self.duration = time.monotonic() - started
        self.refreshed_at = time.time()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:
                self._failures.failed(exc, "measuring storage for /metrics failed; the last figures stay")
            else:
                self._failures.succeeded()
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="storage-watch", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the pass in progress (waits at most ``timeout`` seconds for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def collect(self) -> Iterator[Metric]:
        """The gauges, from the last pass (no database work)."""
        figures = self.figures
        by_kind = GaugeMetricFamily(
            "reducing_saver_storage_bytes",
            "Bytes the tenant's threads hold, by kind: checkpoints, blobs, writes (the checkpoint tables), "
            "outbox and store (their cut messages).",
            labels=("tenant", "kind"),
        )
        plain = GaugeMetricFamily(
            "reducing_saver_storage_plain_estimate_bytes",
            "Bytes a plain add_messages saver would hold in the checkpoint tables for the same threads "
            "(estimate; docs/storage.md gives the formula).",
            labels=("tenant",),
        )
        threads = GaugeMetricFamily(
            "reducing_saver_storage_threads", "Threads with checkpoints.", labels=("tenant",)
        )
        checkpoints = GaugeMetricFamily(
            "reducing_saver_storage_checkpoints", "Checkpoints kept.", labels=("tenant",)
        )
        for tenant, figure in sorted(figures.items()):
            for kind, value in figure.bytes.items():
                by_kind.add_metric((tenant, kind), value)
            plain.add_metric((tenant,), figure.plain_estimate)
            threads.add_metric((tenant,), figure.threads)
            checkpoints.add_metric((tenant,), figure.checkpoints)
        yield from (by_kind, plain, threads, checkpoints)
        yield GaugeMetricFamily(
            "reducing_saver_storage_refreshed_timestamp_seconds",
            "Unix time the storage figures were last measured (0: not yet).",
            value=self.refreshed_at,
        )
        yield GaugeMetricFamily(
            "reducing_saver_storage_refresh_duration_seconds",
            "How long the last measuring pass took.",
            value=self.duration,
        )
