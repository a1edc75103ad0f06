"""Long-term memory: the outbox the put path records into, and the deliverer that empties it.

Every message that leaves the window is recorded in the outbox *before* the checkpoint that drops it
is stored (``record`` is the ``ReducingSaver``'s ``record_pruned``): at every instant a message is in
the thread's latest checkpoint, pending in the outbox, or extracted. The outbox's key
``(namespace, message key)`` makes the several puts of one turn, and several replicas, record a message
once; the deliverer hands each row to the extractor and marks it done.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint

from reducing_saver.service.extraction import (
    Deliverer,
    StoreExtractor,
    load_extractor,
    open_store,
    validate_namespace,
)
from reducing_saver.service.outbox import make_entries, open_outbox
from reducing_saver.service.reducer import message_key
from reducing_saver.service.security import load_api_keys, stored_thread_to_agent
from reducing_saver.service.settings import Settings

logger = logging.getLogger(__name__)


def escape_label(label: str) -> str:
    """A thread id as a store namespace label: ``%`` -> ``%25``, ``.`` -> ``%2E`` (stores refuse dots)."""
    return label.replace("%", "%25").replace(".", "%2E")


def store_namespace(config: RunnableConfig, namespace_key: str) -> tuple[str, ...]:
    """The memory namespace of a run, as the store keeps it.

    ``config["configurable"][namespace_key]`` as given (a label the store would refuse raises
    ``ValueError``), else ``("memories", thread_id)`` with the thread id escaped by :func:`escape_label`.
    """
    configurable = config.get("configurable") or {}
    namespace = configurable.get(namespace_key)
    if namespace is None:
        return ("memories", escape_label(str(configurable.get("thread_id", ""))))
    labels = (namespace,) if isinstance(namespace, str) else tuple(namespace)
    validate_namespace(labels)
    return labels


#: Outbox keys a process remembers having committed (oldest forgotten first).
RECORDED_KEYS_REMEMBERED = 100_000
#: Connections of a deliverer's own outbox pool (claims, renewals, completions) and of its store's, in a
#: process without a backend pool (``reducing-saver worker``).
DELIVERER_POOL_SIZE = 2


class Memory:
    """The outbox and, when this process delivers, the store and the deliverer.

    On PostgreSQL in the service (``pool`` given: the backend's), recording, delivery and the store all
    use that one pool, so a process never holds more than ``pool_size`` connections; delivery takes
    one or two of them for a moment per batch. A worker process opens small pools of its own.
    """

    def __init__(self, settings: Settings, *, pool: Any = None) -> None:
        self.settings = settings
        self.outbox = open_outbox(settings.database, pool=pool, pool_size=DELIVERER_POOL_SIZE)
        self._pool = pool
        self._tenant_mode = load_api_keys(settings) is not None
        self.deliverer: Deliverer | None = None
        self._closers: list[Callable[[], None]] = []
        self._recorded: OrderedDict[tuple[tuple[str, ...], str], None] = OrderedDict()
        self._recorded_lock = threading.Lock()

    def record(self, pruned: list[Any], namespace: tuple[str, ...], config: RunnableConfig, checkpoint: Checkpoint) -> None:
        """Durably record pruned messages before their checkpoint is stored (raises on failure)."""
        namespace = store_namespace(config, self.settings.namespace_key)
        # In tenant mode the config holds the stored id (tenant:thread); rows carry the agent's own.
        thread_id = stored_thread_to_agent(str(config["configurable"]["thread_id"]), self._tenant_mode)
        # LangGraph hands every put of a turn the same unreduced list, so most records repeat keys this
        # process already committed: those rows are durable, and need neither entries nor a round trip.
        namespace = tuple(str(label) for label in namespace)
        with self._recorded_lock:
            unseen = [
                message for message in pruned if (namespace, message_key(message, namespace)) not in self._recorded
            ]
        if not unseen:
            return
        fresh = make_entries(unseen, namespace, thread_id=thread_id, checkpoint_id=checkpoint["id"])
        self.outbox.record(fresh)
        with self._recorded_lock:
            for entry in fresh:
                self._recorded[entry.ident] = None
            while len(self._recorded) > RECORDED_KEYS_REMEMBERED:
                self._recorded.popitem(last=False)
        if self.deliverer is not None:
            self.deliverer.wake()  # deliver now rather than after the idle sleep

    def deliverer_for(self) -> Deliverer:
        """A deliverer writing to the store (or the configured extractor)."""
        store, close_store = open_store(
            self.settings.database, pool_size=DELIVERER_POOL_SIZE, pool=self._pool
        )
        self._closers.append(close_store)
        extractor = (
            load_extractor(self.settings.extractor, store) if self.settings.extractor else StoreExtractor(store)
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
        self.deliverer_for().start()
        logger.info("extraction delivery started (%s)", self.deliverer.worker_id)

    def close(self, timeout: float = 30.0) -> None:
        """Stop delivering (rows in hand are handed back), then close the store and the outbox."""
        if self.deliverer is not None:
            self.deliverer.stop(timeout)
            self.deliverer.release()
            self.deliverer = None
        for close in reversed(self._closers):
            close()
        self._closers.clear()
        self.outbox.close()
