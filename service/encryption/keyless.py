"""``KeylessSaver``: the savers of a process running ``--encryption off``.

During a rollout between modes such a process shares its database with processes that seal. Values pass
through as they are, but a sealed one met on the way up (a channel value, a pending write, a metadata
value, a DeltaChannel history entry) is refused with :class:`EncryptedValueRefused`, never handed on as if
it were the value; a copy of a thread holding any is refused before anything is written, since the
backends copy rows as they are and a ciphertext bound to the source thread never opens under the target.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)

from reducing_saver.service.encryption.saver import WrappedSaver, _DeleteForRuns, is_sealed
from reducing_saver.service.storage import EncryptedValueRefused
from reducing_saver.service.storage.outbox import CheckpointRecords
from reducing_saver.wire.capabilities import saver_capabilities, with_capabilities


def refuse_sealed(item: CheckpointTuple) -> CheckpointTuple:
    """``item`` as it is, unless it holds a sealed value: then :class:`EncryptedValueRefused` naming where."""
    configurable = item.config["configurable"]
    where = f"thread {configurable['thread_id']!r} checkpoint {item.checkpoint['id']!r}"
    for channel, value in (item.checkpoint.get("channel_values") or {}).items():
        if is_sealed(value):
            raise EncryptedValueRefused(f"{where} channel {channel!r}")
    for key, value in (item.metadata or {}).items():
        if is_sealed(value):
            raise EncryptedValueRefused(f"{where} metadata {key!r}")
    for task_id, channel, value in item.pending_writes or ():
        if is_sealed(value):
            raise EncryptedValueRefused(f"{where} write of task {task_id!r} to channel {channel!r}")
    return item


class KeylessSaver(WrappedSaver):
    """A backend saver behind a process without a key ring (see the module docstring).

    Build one with :func:`keyless`, which gives it exactly the inner saver's optional capabilities.
    """

    capabilities: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"KeylessSaver({self.inner!r})"

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        item = self.inner.get_tuple(config)
        return refuse_sealed(item) if item is not None else None

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        listed = self.inner.list(config, filter=filter, before=before, limit=limit)
        with closing(listed) as found:  # type: ignore[type-var]  # the backends' list is a generator
            for item in found:
                yield refuse_sealed(item)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        *,
        records: CheckpointRecords | None = None,
    ) -> RunnableConfig:
        return self.inner_put(config, checkpoint, metadata, new_versions, records)

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        return self.inner.put_writes(config, writes, task_id, task_path)


class _Prune:
    inner: BaseCheckpointSaver

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        return self.inner.prune(thread_ids, strategy=strategy)


class _CopyThread:
    inner: BaseCheckpointSaver

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """The backend's copy, once every checkpoint of the source is known to hold nothing sealed."""
        listed = self.inner.list({"configurable": {"thread_id": source_thread_id}})
        with closing(listed) as found:  # type: ignore[type-var]  # the backends' list is a generator
            for item in found:
                refuse_sealed(item)
        return self.inner.copy_thread(source_thread_id, target_thread_id)


class _DeltaChannelHistory:
    inner: BaseCheckpointSaver

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, Any]:
        history = self.inner.get_delta_channel_history(config=config, channels=channels)
        thread_id = config["configurable"]["thread_id"]
        for channel, entry in history.items():
            values: Iterable[Any] = (value for _, _, value in entry.get("writes") or ())
            if any(is_sealed(value) for value in values) or is_sealed(entry.get("seed")):
                raise EncryptedValueRefused(f"thread {thread_id!r} history of channel {channel!r}")
        return history

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, Any]:
        return self.get_delta_channel_history(config=config, channels=channels)


_MIXINS: dict[str, type] = {
    "copy_thread": _CopyThread,
    "delete_for_runs": _DeleteForRuns,
    "prune": _Prune,
    "delta_channel_history": _DeltaChannelHistory,
}


def keyless(inner: BaseCheckpointSaver) -> KeylessSaver:
    """``inner`` wrapped in a :class:`KeylessSaver` with the inner saver's optional capabilities."""
    kept = frozenset(saver_capabilities(inner) & _MIXINS.keys())
    return with_capabilities(KeylessSaver, kept, _MIXINS)(inner)
