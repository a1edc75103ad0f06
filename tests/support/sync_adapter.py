"""Run the conformance suite (which only awaits) through a saver's synchronous methods."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from langgraph.checkpoint.base import BaseCheckpointSaver

from reducing_saver.wire.capabilities import saver_capabilities, with_capabilities


class SyncAdapter(BaseCheckpointSaver):
    """Each async method runs the wrapped saver's sync twin in a worker thread."""

    def __new__(cls, saver: BaseCheckpointSaver) -> SyncAdapter:
        return super().__new__(with_capabilities(cls, saver_capabilities(saver), _MIXINS))

    def __init__(self, saver: BaseCheckpointSaver) -> None:
        super().__init__(serde=saver.serde)
        self.saver = saver

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.saver.get_next_version(current, channel)

    async def aget_tuple(self, config):
        return await asyncio.to_thread(self.saver.get_tuple, config)

    async def alist(self, config, *, filter=None, before=None, limit=None) -> AsyncIterator:
        items = await asyncio.to_thread(
            lambda: list(self.saver.list(config, filter=filter, before=before, limit=limit))
        )
        for item in items:
            yield item

    async def aput(self, config, checkpoint, metadata, new_versions):
        return await asyncio.to_thread(self.saver.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config, writes, task_id, task_path=""):
        return await asyncio.to_thread(self.saver.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id):
        return await asyncio.to_thread(self.saver.delete_thread, thread_id)


class _CopyThread:
    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        return await asyncio.to_thread(self.saver.copy_thread, source_thread_id, target_thread_id)


class _DeleteForRuns:
    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        return await asyncio.to_thread(self.saver.delete_for_runs, run_ids)


class _Prune:
    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        return await asyncio.to_thread(lambda: self.saver.prune(thread_ids, strategy=strategy))


class _DeltaHistory:
    async def aget_delta_channel_history(self, *, config, channels):
        return await asyncio.to_thread(
            lambda: self.saver.get_delta_channel_history(config=config, channels=channels)
        )


_MIXINS = {
    "copy_thread": _CopyThread,
    "delete_for_runs": _DeleteForRuns,
    "prune": _Prune,
    "delta_channel_history": _DeltaHistory,
}
