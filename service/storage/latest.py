"""The latest-checkpoint cache: each thread's newest checkpoint as the process last wrote or read it.

LangGraph starts every run with ``get_tuple`` of a thread's latest checkpoint, which the service wrote
moments before. A backend that keeps a :class:`LatestCache` answers that read from memory when it
proves, with a cheap query, that what it holds is still what the database would return; it never
answers from memory on trust. What an entry holds and how it is proven is the backend's (PostgreSQL:
``postgres/saver.py``); this module keeps the entries, bounded by threads (least recently used first
out), and counts the outcomes for the metrics.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

#: The outcomes of a read of a thread's latest checkpoint, as the metric labels them.
RESULTS = ("hit", "miss", "stale")
#: An entry whose values (``entry.size``, bytes) are larger than this is not kept.
MAX_ENTRY_BYTES = 64 * 1024
#: Namespaces kept per thread: every subgraph call has a namespace of its own, so a thread's newest ones
#: (and its root namespace) are kept, the oldest dropped.
MAX_NAMESPACES = 8


class LatestCache:
    """Up to ``threads`` threads' latest checkpoints (per namespace), least recently used dropped first;
    an entry of more than :data:`MAX_ENTRY_BYTES` is not kept, and a thread keeps at most
    :data:`MAX_NAMESPACES` namespaces, so the memory held stays under ``threads`` times their product.

    Thread-safe: the service's savers (one per pooled connection) share one cache. Entries are opaque
    to it and never changed in place: an update replaces one.

    Args:
        threads: How many threads to keep; 0 keeps none (every read goes to the database).

    Attributes:
        counts: Reads answered from memory (``hit``), with no entry (``miss``), and with an entry the
            database had moved past (``stale``).
    """

    def __init__(self, threads: int) -> None:
        if threads < 0:
            raise ValueError(f"threads must be 0 or more, not {threads}")
        self.threads = threads
        self._threads: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(RESULTS, 0)

    @property
    def enabled(self) -> bool:
        return self.threads > 0

    def __len__(self) -> int:
        """Threads held."""
        return len(self._threads)

    def get(self, thread_id: str, checkpoint_ns: str) -> Any:
        """The entry of a thread's namespace, or ``None``; the thread becomes the most recently used."""
        with self._lock:
            namespaces = self._threads.get(thread_id)
            if namespaces is None:
                return None
            self._threads.move_to_end(thread_id)
            return namespaces.get(checkpoint_ns)

    def update(self, thread_id: str, checkpoint_ns: str, change: Callable[[Any], Any]) -> None:
        """Replace an entry by ``change(current entry or None)`` under the cache's lock; a result of
        ``None`` drops the entry. Used by writes, so two writes of one thread in this process compose
        one after the other (an entry larger than :data:`MAX_ENTRY_BYTES` is dropped too)."""
        if not self.threads:
            return
        with self._lock:
            namespaces = self._threads.get(thread_id)
            entry = change(namespaces.get(checkpoint_ns) if namespaces is not None else None)
            if entry is None or entry.size > MAX_ENTRY_BYTES:
                if namespaces is not None:
                    namespaces.pop(checkpoint_ns, None)
                    if not namespaces:
                        del self._threads[thread_id]
                return
            if namespaces is None:
                namespaces = self._threads[thread_id] = {}
            elif checkpoint_ns not in namespaces and len(namespaces) >= MAX_NAMESPACES:
                del namespaces[next(ns for ns in namespaces if ns != "")]  # the oldest subgraph's
            namespaces[checkpoint_ns] = entry
            self._threads.move_to_end(thread_id)
            while len(self._threads) > self.threads:
                self._threads.popitem(last=False)

    def put(self, thread_id: str, checkpoint_ns: str, entry: Any) -> None:
        """Keep ``entry`` for a thread's namespace (``None`` drops it)."""
        self.update(thread_id, checkpoint_ns, lambda _current: entry)

    def discard(self, thread_ids: Iterable[str]) -> None:
        """Forget threads (deleted or pruned): only memory is at stake, reads prove their entries anyway."""
        with self._lock:
            for thread_id in thread_ids:
                self._threads.pop(thread_id, None)

    def clear(self) -> None:
        with self._lock:
            self._threads.clear()

    def count(self, result: str) -> None:
        """Count one read's outcome (one of :data:`RESULTS`)."""
        with self._lock:
            self.counts[result] += 1


__all__ = ["MAX_ENTRY_BYTES", "MAX_NAMESPACES", "RESULTS", "LatestCache"]
