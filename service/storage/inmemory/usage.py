"""What threads hold in memory (``memory://``): ``len`` of every serialized value, per thread.

Checkpoints count their serialized checkpoint and metadata, blobs and writes their serialized value,
outbox rows their message's JSON, store items their value's JSON. See
:mod:`reducing_saver.service.storage.usage` for the figures and the plain estimate.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import orjson

from reducing_saver.service.msgpack_headers import array_length
from reducing_saver.service.storage.usage import (
    Head,
    Selection,
    ThreadStorage,
    assemble,
    checkpoints_had,
    tenant_of_namespace,
)


def _selected(selection: Selection, thread_id: str) -> bool:
    if selection.thread is not None:
        return thread_id == selection.thread
    return thread_id.startswith(selection.thread_prefix)


def measure(
    saver: Any, outbox: Any, store: Any, selection: Selection, *, messages_key: str
) -> list[ThreadStorage]:
    """Every thread of ``selection`` with its figures, largest first.

    Args:
        saver: The backend's ``InMemoryLifecycleSaver`` (read under its lock).
        outbox: The backend's ``MemoryOutbox``.
        store: The backend's ``InMemoryStore`` (``None``: not opened).
        selection: Which threads.
        messages_key: The messages channel.
    """
    threads: dict[str, ThreadStorage] = {}
    with saver.lock:
        for thread_id, namespaces in saver.storage.items():
            if not _selected(selection, thread_id) or not any(namespaces.values()):
                continue
            thread = threads[thread_id] = ThreadStorage(thread_id)
            for ns, checkpoints in namespaces.items():
                if not checkpoints:
                    continue
                delta: set[str] = set(thread.delta_channels)
                for checkpoint, metadata, _ in checkpoints.values():
                    thread.checkpoints += 1
                    thread.checkpoint_bytes += len(checkpoint[1]) + len(metadata[1])
                    counters = saver.serde.loads_typed(metadata).get("counters_since_delta_snapshot")
                    if isinstance(counters, dict):
                        delta.update(counters)
                thread.delta_channels = sorted(delta)
                checkpoint, metadata, _ = checkpoints[max(checkpoints)]
                head = saver.serde.loads_typed(checkpoint)
                version = (head.get("channel_versions") or {}).get(messages_key)
                window = saver.blobs.get((thread_id, ns, messages_key, version), ("empty", b""))[1]
                thread.heads[ns] = Head(
                    window_bytes=len(window),
                    window_messages=array_length(window),
                    checkpoints_had=checkpoints_had(saver.serde.loads_typed(metadata).get("step")),
                )
        for (thread_id, _, channel, _), value in saver.blobs.items():
            if (holder := threads.get(thread_id)) is not None:
                holder.blob_bytes += len(value[1])
                if channel == messages_key:
                    holder.messages_bytes += len(value[1])
        for (thread_id, _, _), writes in saver.writes.items():
            if (holder := threads.get(thread_id)) is not None:
                holder.write_bytes += sum(len(write[2][1]) for write in writes.values())
    wanted = selection.thread_tenant()
    agent = selection.agent_thread()

    def add(figures: dict[Any, list[int]], namespace: Any, thread_id: Any, size: int) -> None:
        tenant = tenant_of_namespace(namespace, selection.tenant_mode)
        if tenant is None or (wanted is not None and tenant != wanted) or not isinstance(thread_id, str):
            return
        if agent is not None and thread_id != agent:
            return
        figure = figures[(tenant, thread_id)]
        figure[0] += 1
        figure[1] += size

    outbox_figures: dict[Any, list[int]] = defaultdict(lambda: [0, 0])
    for namespace, thread_id, size in outbox.sizes():
        add(outbox_figures, namespace, thread_id, size)
    store_figures: dict[Any, list[int]] = defaultdict(lambda: [0, 0])
    if store is not None:
        # The default extractor's items name their thread in the value (``StoreExtractor.value``).
        # InMemoryStore keeps them in ``_data`` (namespace -> key -> Item): read as they are, without
        # paging every namespace through search.
        for namespace, items in list(store._data.items()):
            for item in list(items.values()):
                add(
                    store_figures,
                    namespace,
                    item.value.get("thread_id"),
                    len(orjson.dumps(item.value, default=str, option=orjson.OPT_NON_STR_KEYS)),
                )
    return assemble(
        threads,
        {key: (n, size) for key, (n, size) in outbox_figures.items()},
        {key: (n, size) for key, (n, size) in store_figures.items()},
        selection.tenant_mode,
    )
