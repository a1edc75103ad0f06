"""InMemorySaver with ``copy_thread``, ``delete_for_runs`` and ``prune``, every call under one lock."""

from __future__ import annotations

import builtins
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    get_checkpoint_id,
)
from langgraph.checkpoint.memory import InMemorySaver

from reducing_saver.service.storage.lifecycle import (
    CHECKPOINT_ID_KEY,
    CheckpointPrunedError,
    PlacedHistory,
    ThreadNotEmptyError,
    check_copy_ids,
    check_prune_args,
    check_run_ids,
    checkpoints_to_drop,
    delta_needs,
    has_delta_metadata,
    is_snapshot_blob,
    is_subgraph_call,
    keep_checkpoints_of,
    parents_root,
    placed_histories,
    refuse_delta_threads,
    run_id_of,
    was_pruned,
)


class _Changes:
    """Dictionary changes computed under the lock, applied only once all are computed."""

    def __init__(self) -> None:
        self.namespaces: dict[tuple[str, str], dict[str, tuple] | None] = {}
        self.writes: dict[tuple[str, str, str], dict | None] = {}
        self.blobs: dict[tuple[str, str, str, Any], tuple[str, bytes] | None] = {}


class InMemoryLifecycleSaver(InMemorySaver):
    """InMemorySaver with ``copy_thread``, ``delete_for_runs`` and ``prune`` and their async twins.

    Constructed like InMemorySaver (its keyword arguments), plus ``keep_checkpoints``. Every method runs
    under one re-entrant lock (``lock``), so the lifecycle methods, which compute all their changes before
    applying any, are atomic to every other call. ``list`` collects its results under the lock and yields
    them after, newest first across threads and namespaces.

    Args:
        serde: InMemorySaver's: the serializer.
        factory: InMemorySaver's: the mapping its storage is made of.
        keep_checkpoints: Keep only the newest this many checkpoints of each thread and namespace, plus
            branch heads and the ancestors their DeltaChannels are rebuilt from (see ``lifecycle``);
            ``None`` keeps every one. A put's ``config["configurable"]["keep_checkpoints"]`` overrides it
            for that thread. ``set_keep_checkpoints`` changes it.

    What the policy deleted stays known (``pruned_through``): ``get_tuple``, ``list`` and a ``put``
    naming a deleted checkpoint raise ``CheckpointPrunedError`` (see ``lifecycle``).
    """

    #: ``put`` stores the values of the channels in ``new_versions``; a read finds every other channel's
    #: value by its version, in the blob the put that wrote it stored (``EncryptingSaver`` seals no others).
    stores_written_channels_only = True

    def __init__(
        self,
        *,
        serde: Any = None,
        factory: type[defaultdict] = defaultdict,
        keep_checkpoints: int | None = None,
    ) -> None:
        super().__init__(serde=serde, factory=factory)
        self.lock = threading.RLock()
        self.keep_checkpoints = keep_checkpoints
        #: ``(thread_id, checkpoint_ns)`` -> the newest checkpoint id the keep-checkpoints policy deleted.
        self.pruned_through: dict[tuple[str, str], str] = {}
        #: The backend's book of running summaries, once it has one (``MemoryBackend.summaries``): every
        #: namespace this saver removes (``delete_thread``, ``delete_for_runs``, ``prune``, kept counts)
        #: loses its summary steps under the lock, right after.
        self.summary_book: Any = None

    def set_keep_checkpoints(self, keep_checkpoints: int | None) -> None:
        """Keep only the newest ``keep_checkpoints`` checkpoints from the next put on (see Args; ``None``:
        every one). The memory backend's one saver exists before the service's settings reach it."""
        self.keep_checkpoints = keep_checkpoints

    # -- the base methods, under the lock ----------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        with self.lock:
            item = super().get_tuple(config)
            if item is None:
                self._refuse_pruned(config)
            return item

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        # CHECKPOINT_ID_KEY alone: every thread's checkpoints with that id.
        checkpoint_id = ((config or {}).get("configurable") or {}).get(CHECKPOINT_ID_KEY)
        with self.lock:
            items = [*super().list(None if checkpoint_id else config, filter=filter, before=before)]
        if checkpoint_id:
            items = [item for item in items if item.config["configurable"]["checkpoint_id"] == checkpoint_id]
        # InMemorySaver orders by checkpoint id within each thread and namespace only; newest first across
        # them all (as PostgreSQL and SQLite answer) is what lets a client page on with ``before``.
        items.sort(key=lambda item: item.config["configurable"]["checkpoint_id"], reverse=True)
        if not items and config is not None:
            with self.lock:
                self._refuse_pruned(config)
        yield from items if limit is None else items[: max(limit, 0)]

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        keep = keep_checkpoints_of(config, self.keep_checkpoints)
        with self.lock:
            self._refuse_pruned(config, as_parent=True)
            next_config = super().put(config, checkpoint, metadata, new_versions)
            if keep is not None:
                configurable = next_config["configurable"]
                self._keep_last(configurable["thread_id"], configurable["checkpoint_ns"], keep)
            return next_config

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        with self.lock:
            super().put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        with self.lock:
            super().delete_thread(thread_id)
            self._forget_pruned([str(thread_id)])
            if self.summary_book is not None:
                self.summary_book.delete_thread(str(thread_id))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        with self.lock:
            return super().get_delta_channel_history(config=config, channels=channels)

    def placed_delta_history(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, PlacedHistory]:
        """``get_delta_channel_history`` with the place of every value (``lifecycle.PlacedHistory``): what
        ``EncryptingSaver`` needs to open sealed values. The same walk as InMemorySaver's: a channel's seed
        is the first ancestor's non-empty blob at the channel's version there."""
        channels = list(channels)
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns", "")
        chain: dict[str, list[str]] = {channel: [] for channel in channels}
        seeds: dict[str, tuple[Any, Any]] = {}
        writes: list[tuple] = []
        with self.lock:
            checkpoints = self.storage.get(thread_id, {}).get(ns, {})
            target = checkpoints.get(get_checkpoint_id(config) or max(checkpoints, default=""))
            current, walking = (target[2] if target is not None else None), set(channels)
            while current is not None and walking and current in checkpoints:
                stored, _, parent = checkpoints[current]
                versions = self.serde.loads_typed(stored).get("channel_versions") or {}
                for channel in list(walking):
                    chain[channel].append(current)
                    version = versions.get(channel)
                    blob = self.blobs.get((thread_id, ns, channel, version)) if version is not None else None
                    if blob is not None and blob[0] != "empty":
                        seeds[channel] = (version, self.serde.loads_typed(blob))
                        walking.discard(channel)
                current = parent
            for checkpoint_id in {checkpoint_id for ids in chain.values() for checkpoint_id in ids}:
                for (task_id, idx), (_, channel, value, task_path) in self.writes.get(
                    (thread_id, ns, checkpoint_id), {}
                ).items():
                    if checkpoint_id in chain.get(channel, ()):
                        writes.append(
                            (checkpoint_id, channel, task_id, idx, task_path, self.serde.loads_typed(value))
                        )
        return placed_histories(channels, chain, writes, seeds)

    # -- lifecycle -----------------------------------------------------------------------------------

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, blob and pending write of a thread to another thread id, atomically.

        Args:
            source_thread_id: The thread to copy.
            target_thread_id: The thread id to copy to; nothing may be stored under it.

        Raises:
            ValueError: If source and target are the same thread id.
            ThreadNotEmptyError: If the target already has checkpoints, blobs or writes (nothing copied).
        """
        source, target = check_copy_ids(source_thread_id, target_thread_id)
        with self.lock:
            if self._in_use(target):
                raise ThreadNotEmptyError(target)
            changes = _Changes()
            for ns, checkpoints in self.storage.get(source, {}).items():
                if checkpoints:
                    changes.namespaces[(target, ns)] = dict(checkpoints)
            for (thread_id, ns, checkpoint_id), writes in self.writes.items():
                if thread_id == source and writes:
                    changes.writes[(target, ns, checkpoint_id)] = dict(writes)
            for (thread_id, ns, channel, version), blob in self.blobs.items():
                if thread_id == source:
                    changes.blobs[(target, ns, channel, version)] = blob
            self._apply(changes)
            for (thread_id, ns), through in list(self.pruned_through.items()):
                if thread_id == source:
                    self.pruned_through[(target, ns)] = through

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None:
        """Delete the checkpoints of runs, their pending writes, and the blobs only they referenced.

        Same rules as :meth:`PostgresLifecycleSaver.delete_for_runs` (``thread_id_prefix`` included),
        atomically.

        Raises:
            TypeError: If ``run_ids`` is a single string.
        """
        runs = set(check_run_ids(run_ids))
        if not runs:
            return
        with self.lock:
            changes = _Changes()
            for thread_id, namespaces in self.storage.items():
                if thread_id_prefix is not None and not thread_id.startswith(thread_id_prefix):
                    continue
                for ns, checkpoints in namespaces.items():
                    doomed = {
                        checkpoint_id
                        for checkpoint_id, (_, metadata, _) in checkpoints.items()
                        if run_id_of(self.serde.loads_typed(metadata)) in runs
                    }
                    if doomed:
                        self._drop(changes, thread_id, ns, doomed, detach_all=False)
            self._apply(changes)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads, all of them atomically. Same rules as :meth:`SqliteLifecycleSaver.prune`,
        and blobs go as in PostgresSaver: those a deleted checkpoint referenced and a kept one does not.

        Raises:
            TypeError: If ``thread_ids`` is a single string.
            ValueError: If ``strategy`` is unknown.
            NotImplementedError: If ``strategy`` is ``"keep_latest"`` and a thread uses a DeltaChannel
                (metadata counters, or a snapshot blob); nothing is pruned then.
        """
        ids = check_prune_args(thread_ids, strategy)
        if not ids:
            return
        with self.lock:
            changes = _Changes()
            if strategy == "delete":
                for thread_id in ids:
                    for ns in self.storage.get(thread_id, {}):
                        self._wipe(changes, thread_id, ns)
                    self._wipe(changes, thread_id, None)
                self._forget_pruned(ids)
            else:
                refuse_delta_threads(self._delta_threads(ids))
                for thread_id in ids:
                    self._keep_latest(changes, thread_id)
            self._apply(changes)
            if self.summary_book is not None:
                for thread_id in ids if strategy == "delete" else ():
                    self.summary_book.delete_thread(thread_id)
                self.summary_book.forget_gone(ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        return self.copy_thread(source_thread_id, target_thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        return self.delete_for_runs(run_ids)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        return self.prune(thread_ids, strategy=strategy)

    # -- helpers (the lock is held) ------------------------------------------------------------------

    def _refuse_pruned(self, config: RunnableConfig, *, as_parent: bool = False) -> None:
        """Raise ``CheckpointPrunedError`` when ``config`` names a checkpoint the policy deleted."""
        configurable = config.get("configurable") or {}
        checkpoint_id = configurable.get("checkpoint_id")
        if not checkpoint_id or configurable.get("thread_id") is None:
            return
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns") or ""
        through = self.pruned_through.get((thread_id, ns))
        if (
            through is not None
            and was_pruned(checkpoint_id, through)
            and checkpoint_id not in self.storage.get(thread_id, {}).get(ns, {})
        ):
            raise CheckpointPrunedError(checkpoint_id, through, as_parent=as_parent)

    def _record_pruned(self, thread_id: str, ns: str, checkpoint_ids: set[str]) -> None:
        newest = max(checkpoint_ids)
        self.pruned_through[(thread_id, ns)] = max(newest, self.pruned_through.get((thread_id, ns), newest))

    def _forget_pruned(self, thread_ids: Sequence[str]) -> None:
        for key in [key for key in self.pruned_through if key[0] in set(thread_ids)]:
            del self.pruned_through[key]

    def _in_use(self, thread_id: str) -> bool:
        return (
            any(self.storage.get(thread_id, {}).values())
            or any(key[0] == thread_id and writes for key, writes in self.writes.items())
            or any(key[0] == thread_id for key in self.blobs)
        )

    def _delta_threads(self, thread_ids: builtins.list[str]) -> set[str]:
        found: set[str] = set()
        for thread_id in thread_ids:
            for checkpoints in self.storage.get(thread_id, {}).values():
                if any(has_delta_metadata(self.serde.loads_typed(m)) for _, m, _ in checkpoints.values()):
                    found.add(thread_id)
        wanted = set(thread_ids)
        for (thread_id, *_), (type_, data) in self.blobs.items():
            if thread_id in wanted and is_snapshot_blob(type_, data):
                found.add(thread_id)
        return found

    def _keep_latest(self, changes: _Changes, thread_id: str) -> None:
        namespaces = {ns: cps for ns, cps in self.storage.get(thread_id, {}).items() if cps}
        heads = {ns: max(checkpoints) for ns, checkpoints in namespaces.items()}
        root_checkpoints = namespaces.get("", {})
        for ns, checkpoints in namespaces.items():
            head = heads[ns]
            if ":" in ns:
                root = parents_root(self.serde.loads_typed(checkpoints[head][1]))
                if root is not None and root != heads.get("") and root in root_checkpoints:
                    self._wipe(changes, thread_id, ns)
                    continue
            self._drop(changes, thread_id, ns, set(checkpoints) - {head}, detach_all=True)

    def _keep_last(self, thread_id: str, ns: str, keep: int) -> None:
        """Delete what keeping the last ``keep`` checkpoints of one namespace drops (the lock is held)."""
        checkpoints = self.storage[thread_id][ns]
        parents = {cid: parent for cid, (_, _, parent) in checkpoints.items()}
        needs = {
            cid: delta_needs(self.serde.loads_typed(metadata))
            for cid, (_, metadata, _) in checkpoints.items()
        }
        doomed = checkpoints_to_drop(parents, keep, needs)
        if not doomed:
            return
        changes = _Changes()
        self._drop(changes, thread_id, ns, doomed, detach_all=False)
        self._record_pruned(thread_id, ns, doomed)
        if ns == "":
            for call_ns, calls in self.storage[thread_id].items():
                if is_subgraph_call(call_ns) and calls:
                    if parents_root(self.serde.loads_typed(calls[max(calls)][1])) in doomed:
                        self._wipe(changes, thread_id, call_ns)
                        self._record_pruned(thread_id, call_ns, set(calls))
        self._apply(changes)

    def _drop(
        self, changes: _Changes, thread_id: str, ns: str, doomed: set[str], *, detach_all: bool
    ) -> None:
        """Plan deleting checkpoints ``doomed`` of one namespace, their writes and the blobs they free.

        Remaining checkpoints whose parent is deleted lose it; with ``detach_all``, all of them do.
        """
        checkpoints = self.storage[thread_id][ns]
        remaining: dict[str, tuple] = {}
        for checkpoint_id, (checkpoint, metadata, parent) in checkpoints.items():
            if checkpoint_id in doomed:
                continue
            if parent is not None and (detach_all or parent in doomed):
                parent = None
            remaining[checkpoint_id] = (checkpoint, metadata, parent)
        freed = {
            (channel, version)
            for checkpoint_id in doomed
            for channel, version in self.serde.loads_typed(checkpoints[checkpoint_id][0])[
                "channel_versions"
            ].items()
        }
        referenced = {
            (channel, version)
            for checkpoint, _, _ in remaining.values()
            for channel, version in self.serde.loads_typed(checkpoint)["channel_versions"].items()
        }
        changes.namespaces[(thread_id, ns)] = remaining
        for checkpoint_id in doomed:
            changes.writes[(thread_id, ns, checkpoint_id)] = None
        for channel, version in freed - referenced:
            changes.blobs[(thread_id, ns, channel, version)] = None

    def _wipe(self, changes: _Changes, thread_id: str, ns: str | None) -> None:
        """Plan deleting everything of one namespace (``None``: of every namespace) of a thread."""
        if ns is not None:
            changes.namespaces[(thread_id, ns)] = None
        for key in self.writes:
            if key[0] == thread_id and (ns is None or key[1] == ns):
                changes.writes[key] = None
        for blob_key in self.blobs:
            if blob_key[0] == thread_id and (ns is None or blob_key[1] == ns):
                changes.blobs[blob_key] = None

    def _apply(self, changes: _Changes) -> None:
        """Apply planned changes: plain dictionary updates that cannot fail half way."""
        for (thread_id, ns), checkpoints in changes.namespaces.items():
            if checkpoints:
                self.storage[thread_id][ns] = checkpoints
            elif thread_id in self.storage:
                self.storage[thread_id].pop(ns, None)
                if not self.storage[thread_id]:
                    del self.storage[thread_id]
        for key, writes in changes.writes.items():
            if writes:
                self.writes[key] = writes
            else:
                self.writes.pop(key, None)
        for blob_key, blob in changes.blobs.items():
            if blob is not None:
                self.blobs[blob_key] = blob
            else:
                self.blobs.pop(blob_key, None)
        if self.summary_book is not None:
            gone = [
                (thread_id, ns)
                for (thread_id, ns), checkpoints in changes.namespaces.items()
                if not self.storage.get(thread_id, {}).get(ns)
            ]
            if gone:
                self.summary_book.forget_namespaces(gone)
