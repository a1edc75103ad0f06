"""Long-term memory: the outbox the put path records into, and the deliverer that empties it.

Every message that leaves the window is recorded in the outbox *before* the checkpoint that drops it
is stored, or on PostgreSQL in the same transaction (``record`` is the ``ReducingSaver``'s
``record_pruned``; ``with_checkpoint`` gives a put records that its saver writes in its pipeline): at every
instant a message is in the thread's latest checkpoint, pending in the outbox, or extracted. The outbox's
key ``(namespace, message key)`` makes the several puts of one turn, and several replicas, record a message
once; the deliverer hands each row to the extractor and marks it done.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint

from reducing_saver.reducer import message_key
from reducing_saver.service.encryption import sealer_for
from reducing_saver.service.encryption.records import (
    keyed_fingerprint,
    seal_entries,
    sealed_outbox,
    sealed_store,
)
from reducing_saver.service.extraction.deliverer import Deliverer
from reducing_saver.service.extraction.extractors import StoreExtractor, load_extractor
from reducing_saver.service.security import stored_thread_to_agent
from reducing_saver.service.storage.outbox import (
    CheckpointRecords,
    OutboxEntry,
    make_entries,
    message_fingerprint,
)

logger = logging.getLogger(__name__)

#: Outbox keys a process remembers having committed (oldest forgotten first).
RECORDED_KEYS_REMEMBERED = 100_000


class Memory:
    """The outbox and, when this process delivers, the store and the deliverer.

    Everything goes through the process's backend: on PostgreSQL, recording, delivery and the store share
    its one pool, so a process never holds more than ``pool_size`` connections; delivery takes one or two
    of them for a moment per batch.

    Args:
        settings: The service ``Settings`` (extraction group, ``namespace_key``).
        backend: The process's open backend (``storage.open_backend``).
        tenant_mode: API keys are configured: stored thread ids are ``tenant:thread``.
    """

    def __init__(self, settings: Any, backend: Any, *, tenant_mode: bool = False) -> None:
        self.settings = settings
        self.backend = backend
        #: Seals outbox messages and store values under ``--encryption`` (None when it is off).
        self.sealer = sealer_for(settings, tenant_mode=tenant_mode)
        self.outbox = sealed_outbox(backend.outbox(), self.sealer)
        self._tenant_mode = tenant_mode
        self.deliverer: Deliverer | None = None
        #: (namespace, key) -> the fingerprint of the version recorded.
        self._recorded: OrderedDict[tuple[tuple[str, ...], str], str | None] = OrderedDict()
        self._recorded_lock = threading.Lock()

    def record(
        self,
        pruned: list[Any],
        namespace: tuple[str, ...],
        config: RunnableConfig,
        checkpoint: Checkpoint,
        *,
        records: CheckpointRecords | None = None,
    ) -> None:
        """Durably record pruned messages before their checkpoint is stored (raises on failure).

        With ``records`` (a put's, from :meth:`with_checkpoint`), the entries are added to them instead:
        the put's saver writes them in the checkpoint's own transaction (committed with it, or not at
        all).
        """
        # In tenant mode the config holds the stored id (tenant:thread); rows carry the agent's own.
        thread_id = stored_thread_to_agent(str(config["configurable"]["thread_id"]), self._tenant_mode)
        # LangGraph hands every put of a turn the same unreduced list, so most records repeat messages this
        # process already committed: those rows are durable, and need neither entries nor a round trip. A
        # message under a recorded key that says something else (an edit) is recorded again.
        namespace = tuple(str(label) for label in namespace)
        fingerprints = [keyed_fingerprint(self.sealer, namespace, message_fingerprint(m)) for m in pruned]
        with self._recorded_lock:
            unseen = [
                message
                for message, fingerprint in zip(pruned, fingerprints, strict=True)
                if self._recorded.get((namespace, message_key(message, namespace)), False) != fingerprint
            ]
        if not unseen:
            return
        fresh = make_entries(unseen, namespace, thread_id=thread_id, checkpoint_id=checkpoint["id"])
        fresh = seal_entries(self.sealer, fresh)  # the saver's pipeline inserts them as they are
        if records is not None:
            records.entries += fresh
            return
        self.outbox.record(fresh)
        self._committed(fresh)

    def forget(self, keys: list[str], namespace: tuple[str, ...], config: RunnableConfig) -> None:
        """Durably mark messages the agent deleted on purpose as deletions (``Outbox.forget``) before the
        checkpoint without them is stored: the deliverer removes them from the store, and they are never
        recorded for memory again."""
        thread_id = stored_thread_to_agent(str(config["configurable"]["thread_id"]), self._tenant_mode)
        namespace = tuple(str(label) for label in namespace)
        now = datetime.now(UTC)
        entries = [OutboxEntry(namespace, key, thread_id, None, None, now) for key in dict.fromkeys(keys)]
        self.outbox.forget(entries)
        self._committed(entries)

    def with_checkpoint(self) -> AbstractContextManager[PutRecords | None]:
        """Around one put: the records it takes, where the backend's saver writes them in the checkpoint's
        own transaction (``records_with_checkpoint``); ``None`` elsewhere (the put records through its
        ``record_pruned``, before the checkpoint).

        Pass them as the put's ``records=`` (``ReducingSaver.put``): what the put prunes is recorded into
        them, and its saver inserts them in its pipeline. Once the put returns, their keys count as
        committed; entries the saver did not write are recorded then (an error is logged). The records
        are their own context manager (every put enters one: no generator).
        """
        return PutRecords(self) if self.outbox.records_with_checkpoint else nullcontext()

    def _stored(self, records: PutRecords) -> None:
        """After a put that returned: its records' keys are committed (recorded now if its saver did not
        write them)."""
        if not records.written:  # a put that reached no pipeline of the saver: record them now
            logger.error(
                "the saver stored a checkpoint without its %d outbox entries; recording them now",
                len(records.entries),
            )
            self.outbox.record(records.entries)
        self._committed(records.entries)

    def _committed(self, entries: list[OutboxEntry]) -> None:
        """Remember keys that are durable now, and wake the deliverer for them."""
        with self._recorded_lock:
            for entry in entries:
                self._recorded[entry.ident] = entry.fingerprint
                self._recorded.move_to_end(entry.ident)
            while len(self._recorded) > RECORDED_KEYS_REMEMBERED:
                self._recorded.popitem(last=False)
        if self.deliverer is not None:
            self.deliverer.wake()  # deliver now rather than after the idle sleep

    def deliverer_for(self) -> Deliverer:
        """A deliverer writing to the store (or the configured extractor)."""
        store = sealed_store(self.backend.store(), self.sealer)
        extractor = (
            load_extractor(self.settings.extractor, store)
            if self.settings.extractor
            else StoreExtractor(store)
        )
        self.deliverer = Deliverer(
            self.outbox,
            extractor,
            batch_size=self.settings.extraction_batch_size,
            lease_seconds=self.settings.extraction_lease_seconds,
            max_attempts=self.settings.extraction_max_attempts,
            base_backoff=self.settings.extraction_base_backoff,
            max_backoff=self.settings.extraction_max_backoff,
            idle_sleep=self.settings.extraction_idle_seconds,
            linger=self.settings.extraction_linger_seconds,
        )
        return self.deliverer

    def start(self) -> None:
        """Deliver in a background thread of this process."""
        deliverer = self.deliverer_for()
        deliverer.start()
        logger.info("extraction delivery started (%s)", deliverer.worker_id)

    def close(self, timeout: float = 30.0) -> None:
        """Stop delivering (rows in hand are handed back), then close the store and the outbox."""
        if self.deliverer is not None:
            self.deliverer.stop(timeout)
            self.deliverer.release()
            self.deliverer = None
        self.outbox.close()


class PutRecords(CheckpointRecords):
    """The records of one put (:meth:`Memory.with_checkpoint`), and its ``record_pruned``: called as the
    ``ReducingSaver`` calls that, it records the messages into itself (:meth:`Memory.record`)."""

    def __init__(self, memory: Memory) -> None:
        super().__init__()
        self._memory = memory

    def __enter__(self) -> PutRecords:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        if error is None and self.entries:  # the put returned: what it recorded is committed
            self._memory._stored(self)

    def __call__(
        self, pruned: list[Any], namespace: tuple[str, ...], config: RunnableConfig, checkpoint: Checkpoint
    ) -> None:
        self._memory.record(pruned, namespace, config, checkpoint, records=self)
