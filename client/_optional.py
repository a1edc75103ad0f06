"""The optional capabilities of ``RemoteReducingSaver``, one mixin each, mixed in only when the service's
backend has them (``wire.capabilities.with_capabilities``): LangGraph detects a capability by override.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import DeltaChannelHistory
from langgraph.checkpoint.serde.base import SerializerProtocol

from reducing_saver.client._calls import Call, no_content, post
from reducing_saver.client._http import Http
from reducing_saver.client._values import decode_value, decode_writes
from reducing_saver.wire import (
    DELTA_HISTORY_PATH,
    RUNS_DELETE_PATH,
    THREAD_COPY_PATH,
    THREAD_PRUNE_PATH,
    bodies,
)


class _CopyThread:
    _http: Http

    @staticmethod
    def _copy_thread_call(source_thread_id: str, target_thread_id: str) -> Call[None]:
        body = bodies.CopyThreadBody(
            source_thread_id=str(source_thread_id), target_thread_id=str(target_thread_id)
        )
        # Not idempotent: a retry after a lost answer could copy twice.
        return post(THREAD_COPY_PATH, body, no_content, idempotent=False)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of one thread to another (never retried).

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        self._http.send(self._copy_thread_call(source_thread_id, target_thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async ``copy_thread``."""
        await self._http.asend(self._copy_thread_call(source_thread_id, target_thread_id))


class _DeleteForRuns:
    _http: Http

    @staticmethod
    def _delete_for_runs_call(run_ids: Sequence[str]) -> Call[None]:
        body = bodies.DeleteRunsBody(run_ids=[str(run_id) for run_id in run_ids])
        return post(RUNS_DELETE_PATH, body, no_content)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints and writes of the given runs.

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        self._http.send(self._delete_for_runs_call(run_ids))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async ``delete_for_runs``."""
        await self._http.asend(self._delete_for_runs_call(run_ids))


class _Prune:
    _http: Http

    @staticmethod
    def _prune_call(thread_ids: Sequence[str], strategy: str) -> Call[None]:
        # Sent as given: the service names any other strategy in its 422.
        body = bodies.PruneBody(
            thread_ids=[str(thread_id) for thread_id in thread_ids],
            strategy=cast(bodies.PruneStrategy, strategy),
        )
        return post(THREAD_PRUNE_PATH, body, no_content)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads: ``"keep_latest"`` keeps each namespace's newest checkpoint, ``"delete"`` all.

        Raises:
            BadRequestError: If the service refuses the strategy or a thread (e.g. one using a DeltaChannel).
            ReducingSaverError: A subclass naming what else failed.
        """
        self._http.send(self._prune_call(thread_ids, strategy))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async ``prune``."""
        await self._http.asend(self._prune_call(thread_ids, strategy))


class _DeltaChannelHistory:
    _http: Http
    serde: SerializerProtocol
    _config: Callable[[RunnableConfig], bodies.RunConfigBody]

    def _delta_history_call(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> Call[Mapping[str, DeltaChannelHistory]]:
        body = bodies.DeltaHistoryBody(config=self._config(config), channels=list(channels))
        return post(DELTA_HISTORY_PATH, body, self._parse_delta_history)

    def _parse_delta_history(self, body: Any) -> dict[str, DeltaChannelHistory]:
        result: dict[str, DeltaChannelHistory] = {}
        for channel, entry in body["channels"].items():
            history = DeltaChannelHistory(
                writes=decode_writes(self.serde, entry["writes"], f"{channel}.writes")
            )
            if "seed" in entry:
                history["seed"] = decode_value(self.serde, entry["seed"], f"{channel}.seed")
            result[channel] = history
        return result

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Per channel, the writes along ``config``'s ancestor chain and the nearest stored value (beta).

        Raises:
            ReducingSaverError: A subclass naming what failed.
        """
        if not channels:
            return {}
        return self._http.send(self._delta_history_call(config, channels))

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """Async ``get_delta_channel_history``."""
        if not channels:
            return {}
        return await self._http.asend(self._delta_history_call(config, channels))


MIXINS: dict[str, type] = {
    "copy_thread": _CopyThread,
    "delete_for_runs": _DeleteForRuns,
    "prune": _Prune,
    "delta_channel_history": _DeltaChannelHistory,
}
