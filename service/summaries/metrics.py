"""Metrics of running summaries, in the service's registry: calls, failures, tokens, uncovered cuts (per
tenant, with a bounded label set), and the lag read from the book at scrape time."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

#: Tenants that get a label of their own; the others share :data:`OTHER_TENANTS`.
MAX_TENANT_LABELS = 50
OTHER_TENANTS = "other"


class SummaryMetrics:
    """Counters of the summarizer and of the put path, and the lag gauges.

    Args:
        registry: The service's registry.
        book: Read at scrape time for the lag (``status()``).
    """

    def __init__(self, registry: CollectorRegistry, book: Any) -> None:
        self._tenants: set[str] = set()
        self._lock = threading.Lock()
        self.calls = Counter(
            "reducing_saver_summary_calls",
            "Summarizer calls that returned a summary, by tenant.",
            ("tenant",),
            registry=registry,
        )
        self.failures = Counter(
            "reducing_saver_summary_failures",
            "Summarizer calls that failed (retried, then dead letters).",
            ("tenant",),
            registry=registry,
        )
        self.input_tokens = Counter(
            "reducing_saver_summary_input_tokens",
            "Tokens sent to the summarizer (its usage report, else counted approximately).",
            ("tenant",),
            registry=registry,
        )
        self.output_tokens = Counter(
            "reducing_saver_summary_output_tokens",
            "Tokens of the summaries written.",
            ("tenant",),
            registry=registry,
        )
        self.uncovered = Counter(
            "reducing_saver_summary_uncovered_cuts",
            "Messages cut past the hard limit before a summary covered them (summarized later).",
            ("tenant",),
            registry=registry,
        )
        registry.register(_LagCollector(book))

    def tenant(self, tenant: str | None) -> str:
        """The label of ``tenant``: its own for the first :data:`MAX_TENANT_LABELS` seen, else ``other``."""
        name = tenant or ""
        with self._lock:
            if name in self._tenants:
                return name
            if len(self._tenants) < MAX_TENANT_LABELS:
                self._tenants.add(name)
                return name
        return OTHER_TENANTS

    def called(self, tenant: str | None, summary: Any, seconds: float) -> None:
        label = self.tenant(tenant)
        self.calls.labels(label).inc()
        self.input_tokens.labels(label).inc(summary.input_tokens)
        self.output_tokens.labels(label).inc(summary.output_tokens)

    def failed(self, tenant: str | None) -> None:
        self.failures.labels(self.tenant(tenant)).inc()

    def cut_uncovered(self, tenant: str | None, count: int) -> None:
        self.uncovered.labels(self.tenant(tenant)).inc(count)


class _LagCollector(Collector):
    def __init__(self, book: Any) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
        try:
            status = self._book.status()
        except Exception:  # noqa: BLE001
            logger.exception("reading the summary book for /metrics failed")
            return
        for name, key, help_text in (
            (
                "lag_messages",
                "messages_awaiting_summary",
                "Cut messages awaiting a summary (still in windows).",
            ),
            ("pending_steps", "pending_steps", "Batches awaiting a summary."),
            (
                "dead_steps",
                "dead_steps",
                "Batches whose summary failed every attempt (retry-dead re-runs them).",
            ),
        ):
            yield GaugeMetricFamily(f"reducing_saver_summary_{name}", help_text, value=status[key])
        yield GaugeMetricFamily(
            "reducing_saver_summary_oldest_pending_age_seconds",
            "Age of the oldest batch awaiting a summary (0 when none is).",
            value=status["oldest_pending_age_seconds"] or 0,
        )
