"""Running summaries in a service process: the put path's :class:`Summaries` and the summarizer."""

from __future__ import annotations

import logging
from typing import Any

from reducing_saver.reducer import MessageReducer, Summaries, batch_fingerprint
from reducing_saver.service.encryption import sealer_for
from reducing_saver.service.encryption.records import sealed_store
from reducing_saver.service.encryption.summaries import SummarySealer
from reducing_saver.service.storage.outbox import message_fingerprint
from reducing_saver.service.summaries.metrics import SummaryMetrics
from reducing_saver.service.summaries.summarizer import SummaryWorker, load_summarizer, tenant_of

logger = logging.getLogger(__name__)


class RunningSummaries:
    """The book, the put path's :class:`Summaries` and, where this process summarizes, the worker.

    Args:
        settings: The service ``Settings`` (summary group, reducer, extraction retries).
        backend: The process's open backend.
        wrap: The codec's ``wrap`` (the summary message as an element of a decoded list).
        registry: The metrics registry.
        tenant_mode: Stored thread ids are ``tenant:thread``.

    Raises:
        SummarizerError: If ``settings.summarizer`` names nothing usable.
    """

    def __init__(self, settings: Any, backend: Any, *, wrap: Any, registry: Any, tenant_mode: bool) -> None:
        self.settings = settings
        self.tenant_mode = tenant_mode
        self.summarizer = load_summarizer(
            settings.summarizer,
            max_input_tokens=settings.summary_max_input_tokens,
            max_tokens=settings.summary_max_tokens,
        )
        self.book = backend.summaries()
        #: Under --encryption, what seals the book's summaries and batches and the store's copy.
        self.sealer = sealer_for(settings, tenant_mode=tenant_mode)
        if self.sealer is not None and hasattr(self.book, "sealer"):  # memory:// keeps nothing at rest
            self.book.sealer = SummarySealer(self.sealer)
        self.backend = backend
        self.metrics = SummaryMetrics(registry, self.book) if registry is not None else None
        tenants = set(settings.summarize_tenants) if settings.summarize_tenants else None
        keys = settings.api_key_set
        # Tenants whose keys carry no-summary (the keys file): never sent to the summarizer.
        opted_out = keys.no_summary if keys is not None and tenant_mode else frozenset()

        def enabled(thread_id: str) -> bool:
            tenant = tenant_of(thread_id, tenant_mode)
            return tenant not in opted_out and (tenants is None or tenant in tenants)

        self.summaries = Summaries(
            self.book,
            hard_limit=MessageReducer(settings.summary_hard_reducer()),
            wrap=wrap,
            enabled=enabled if tenants or opted_out else None,
            on_uncovered=self._uncovered,
            on_request=self._wake,
            fingerprint=self._fingerprint,
        )
        self.workers: list[SummaryWorker] = []

    def _fingerprint(self, thread_id: str, batch: Any) -> str:
        """What a batch says (a digest of the bytes its messages were sent as), part of its step's id;
        keyed per tenant under encryption, so a step id reveals nothing of the text."""
        plain = batch_fingerprint(batch, lambda message: bytes.fromhex(message_fingerprint(message)))
        if self.sealer is None:
            return plain
        return self.sealer.cipher.fingerprint(bytes.fromhex(plain), self.sealer.tenant(thread_id))

    def _wake(self, thread_id: str) -> None:
        self.wake()

    def wake(self) -> None:
        """Cut this process's summarizers' idle sleep short (a batch became claimable)."""
        for worker in self.workers:
            worker.wake()

    def _uncovered(self, thread_id: str, count: int) -> None:
        logger.warning(
            "thread %r: %d message(s) cut past the summary hard limit before a summary covered them; they are "
            "summarized when the summarizer catches up",
            thread_id,
            count,
        )
        if self.metrics is not None:
            self.metrics.cut_uncovered(tenant_of(thread_id, self.tenant_mode), count)

    def start(self) -> list[SummaryWorker]:
        """Summarize in background threads of this process, ``summary_concurrency`` calls at once."""
        settings = self.settings
        store = sealed_store(self.backend.store(), self.sealer)
        for _ in range(settings.summary_concurrency):
            worker = SummaryWorker(
                self.book,
                self.summarizer,
                store=store,
                tenant_mode=self.tenant_mode,
                metrics=self.metrics,
                lease_seconds=settings.summary_lease_seconds,
                max_attempts=settings.extraction_max_attempts,
                base_backoff=settings.extraction_base_backoff,
                max_backoff=settings.extraction_max_backoff,
                idle_sleep=min(settings.extraction_idle_seconds, 0.5),
            )
            worker.start()
            self.workers.append(worker)
        logger.info("running summaries started (%s, %d at once)", self.summarizer.name, len(self.workers))
        return self.workers

    def close(self, timeout: float = 30.0) -> None:
        workers, self.workers = self.workers, []
        for worker in workers:
            worker.stop(0)  # all of them are told first, then waited for
        for worker in workers:
            worker.stop(timeout)
