"""ReducingSaver: a LangGraph checkpointer wrapper that stores a bounded window of messages.

LangGraph writes its whole ``messages`` channel into every checkpoint, so a thread's storage grows with
the square of its length. ``ReducingSaver`` reduces that channel on each put that writes it and
delegates everything else to the wrapped saver.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, Self

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.reducer._namespace import namespace_for
from reducing_saver.reducer._removals import Removals, fold, is_removal, removal_keys, split_removed
from reducing_saver.reducer._summary import Summaries
from reducing_saver.reducer._window import MessageReducer
from reducing_saver.wire.capabilities import saver_capabilities, with_capabilities

logger = logging.getLogger(__name__)


def memory_namespace(reducer: MessageReducer, config: RunnableConfig) -> tuple[str, ...]:
    """The memory namespace of a run, for ``reducer``'s ``namespace_key`` (see :func:`namespace_for`).

    ``config["configurable"][reducer.config.namespace_key]`` (a list or tuple of strings, or one string)
    when present, else ``("memories", thread_id)`` with the thread id escaped as stores need it.
    """
    return namespace_for(config, reducer.config.namespace_key)


_warned_delta_channels: set[str] = set()


def is_delta_channel_value(checkpoint: Checkpoint, messages_key: str) -> bool:
    """True when the messages channel is backed by a DeltaChannel (absent value, or a delta snapshot).

    Such a value is rebuilt from stored writes; replacing it would break the reconstruction.
    """
    values = checkpoint["channel_values"]
    return messages_key not in values or isinstance(values[messages_key], _DeltaSnapshot)


def _warn_delta_channel(messages_key: str) -> None:
    if messages_key not in _warned_delta_channels:
        _warned_delta_channels.add(messages_key)
        logger.warning(
            "channel %r is backed by a DeltaChannel; it is stored as written, not reduced", messages_key
        )


#: ``apply_reducer(decoded=UNREADABLE)``: the caller decoded the channel's value, and it holds no messages list.
UNREADABLE: Any = object()

#: ``record_pruned(pruned, namespace, config, checkpoint)``: durably records messages leaving the window.
RecordPruned = Callable[[list[Any], tuple[str, ...], RunnableConfig, Checkpoint], None]


class MessagesCodec(Protocol):
    """Turns a stored messages value into a list the reducer can cut, and the kept part back.

    The in-process default works on lists of message objects; the service plugs in one that reads the
    client's serialized bytes without importing anything.
    """

    def decode(self, value: Any) -> list[Any] | None:
        """The messages in ``value``, or ``None`` to store ``value`` as it is."""

    def encode(self, kept: list[Any], original: Any) -> Any:
        """The stored form of ``kept``: elements of ``decode(original)`` in order, and messages made by
        :meth:`wrap`."""

    def wrap(self, message: Any) -> Any:
        """A LangChain message the saver writes itself (a running summary), as an element of the list."""

    def decode_write(self, value: Any) -> list[Any] | None:
        """The messages of a pending write (a list, or one message) or of a stored list, not measured as a
        put's; ``None`` when it holds none."""

    def decode_seed(self, value: Any) -> list[Any] | None:
        """The messages of a DeltaChannel's seed (a snapshot, or a plain list)."""

    def is_snapshot(self, value: Any) -> bool:
        """Whether a stored value is a DeltaChannel snapshot."""


class ListCodec:
    """Messages channel values that are plain lists of messages (in-process savers)."""

    def decode(self, value: Any) -> list[Any] | None:
        return value if isinstance(value, list) else None

    def decode_write(self, value: Any) -> list[Any] | None:
        if isinstance(value, list):
            return value
        return [value] if hasattr(value, "type") and hasattr(value, "id") else None

    def decode_seed(self, value: Any) -> list[Any] | None:
        return self.decode(value.value if isinstance(value, _DeltaSnapshot) else value)

    def is_snapshot(self, value: Any) -> bool:
        return isinstance(value, _DeltaSnapshot)

    def encode(self, kept: list[Any], original: Any) -> Any:
        return kept

    def wrap(self, message: Any) -> Any:
        return message


LIST_CODEC = ListCodec()


def apply_reducer(
    reducer: MessageReducer,
    checkpoint: Checkpoint,
    config: RunnableConfig,
    messages_key: str = "messages",
    *,
    codec: MessagesCodec = LIST_CODEC,
    record_pruned: RecordPruned | None = None,
    summaries: Summaries | None = None,
    decoded: Any = None,
) -> Checkpoint:
    """Return ``checkpoint`` with its messages channel cut to the reducer's window.

    With ``summaries``, cut messages stay in the window until a running summary covers them
    (:meth:`Summaries.plan`); they are recorded and handed to the hooks when the cut is chosen.

    The input is not modified; when nothing is pruned (or the channel holds no readable messages list,
    or is backed by a DeltaChannel) the same checkpoint object comes back. A DeltaChannel-backed channel
    is logged as a warning once per channel name and process.

    ``decoded``: ``codec.decode`` of the channel's value, when the caller has it already (a list, or
    :data:`UNREADABLE` for ``None``).

    ``record_pruned(pruned, namespace, config, checkpoint)``, when given, runs before the ``on_prune``
    hooks with every pruned message (no dedupe); an exception from it propagates, so a caller that stores
    the result only afterwards never stores a checkpoint whose pruned messages were not recorded.
    """
    if is_delta_channel_value(checkpoint, messages_key):
        if messages_key in checkpoint.get("channel_versions", {}):
            _warn_delta_channel(messages_key)
        return checkpoint
    value = checkpoint["channel_values"][messages_key]
    messages = codec.decode(value) if decoded is None else decoded
    if messages is None or messages is UNREADABLE:
        return checkpoint
    plan = None
    if summaries is not None:
        configurable = config["configurable"]
        plan = summaries.plan(
            reducer,
            messages,
            thread_id=str(configurable["thread_id"]),
            checkpoint_ns=str(configurable.get("checkpoint_ns") or ""),
        )
    kept: list[Any] | None
    if plan is None:
        kept, pruned = reducer.split(messages)
    else:
        kept, pruned = plan.messages, _unique(plan.requested + plan.removed)
    if pruned:
        namespace = memory_namespace(reducer, config)
        if record_pruned is not None:
            record_pruned(pruned, namespace, config, checkpoint)
        reducer.deliver(pruned, namespace)
    if kept is None or (
        plan is None and not pruned
    ):  # a batch awaits its summary: the window is stored whole meanwhile
        return checkpoint
    reduced = checkpoint.copy()
    reduced["channel_values"] = {**checkpoint["channel_values"], messages_key: codec.encode(kept, value)}
    return reduced


def _unique(messages: list[Any]) -> list[Any]:
    seen: set[int] = set()
    unique = []
    for message in messages:
        if id(message) not in seen:
            seen.add(id(message))
            unique.append(message)
    return unique


class ReducingSaver(BaseCheckpointSaver):
    """Wraps a LangGraph checkpointer so every stored checkpoint keeps a bounded window of messages.

    Which of three cases holds is decided once, here:

    * ``inner`` has no ``reducer`` attribute: this wrapper reduces (``passthrough`` is False);
    * ``inner.reducer is None``: ``reducer`` is assigned to it and every call passes through;
    * ``inner.reducer is reducer`` (another ``ReducingSaver`` with the same reducer, say): pass through.

    A different reducer raises ``ValueError``: two dedupe memories would deliver pruned messages twice.

    The optional capabilities (``copy_thread``, ``delete_for_runs``, ``prune``,
    ``get_delta_channel_history`` and their async twins) exist on the wrapper exactly when ``inner``
    implements them, so capability probes see the inner saver's truth.

    Args:
        inner: The saver that stores the checkpoints.
        reducer: The reducer applied to the messages channel.
        messages_key: The channel holding the messages list.
        codec: Reads and writes the stored form of the messages channel (default: plain lists).
        record_pruned: Called with every pruned message before the put is stored (see
            ``apply_reducer``), unless the put brings its own recorder (``put(records=...)``); the
            service records them in its extraction outbox here.
        summaries: Keep a running summary in every window: cut messages leave it only once the
            summary covers them (:class:`Summaries`).
        removals: What to do with the messages the agent removes itself (``RemoveMessage``): trimmed ones
            are recorded and delivered like the window's cut, deleted ones forgotten (:class:`Removals`).
            ``None``: nothing.

    Raises:
        ValueError: If ``inner`` already carries a different reducer.
    """

    capabilities: frozenset[str] = frozenset()

    def __new__(cls, inner: BaseCheckpointSaver | None = None, *args: Any, **kwargs: Any) -> Self:
        if inner is None:
            # copy.copy, deepcopy and pickle call __new__ with the class alone; it is already the variant.
            return super().__new__(cls)
        # type(saver)(other_inner, ...) must mirror other_inner, not add its mixins to saver's.
        base, mixins = cls, tuple(_MIXINS.values())
        while any(parent in mixins for parent in base.__bases__):
            base = base.__bases__[-1]
        return super().__new__(with_capabilities(base, saver_capabilities(inner), _MIXINS))

    def __init__(
        self,
        inner: BaseCheckpointSaver,
        reducer: MessageReducer,
        *,
        messages_key: str = "messages",
        codec: MessagesCodec = LIST_CODEC,
        record_pruned: RecordPruned | None = None,
        summaries: Summaries | None = None,
        removals: Removals | None = None,
    ) -> None:
        super().__init__(serde=inner.serde)
        if not hasattr(inner, "reducer"):
            self.passthrough = False
        elif inner.reducer is None:
            inner.reducer = reducer
            self.passthrough = True
        elif inner.reducer is reducer:
            self.passthrough = True
        else:
            raise ValueError(
                f"{type(inner).__name__} already reduces with {inner.reducer!r}; wrapping it with a "
                "different reducer would prune (and deliver) the same messages twice"
            )
        self.inner = inner
        self.reducer = reducer
        self.messages_key = messages_key
        self.codec = codec
        self.record_pruned = record_pruned
        self.summaries = summaries
        self.removals = removals

    def __repr__(self) -> str:
        return f"ReducingSaver({self.inner!r}, {self.reducer!r})"

    @property
    def config_specs(self) -> list:
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> BaseCheckpointSaver:
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.inner, clone.serde = inner, inner.serde
        return clone

    def _reduce(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        new_versions: ChannelVersions,
        decoded: Any = None,
        records: RecordPruned | None = None,
        parent_messages_kept: bool = False,
    ) -> Checkpoint:
        if self.passthrough:
            return checkpoint
        if self.messages_key not in new_versions:
            if self.removals is not None:  # the list is the parent's: its note carries over
                configurable = config["configurable"]
                self.removals.carry(
                    str(configurable["thread_id"]),
                    str(configurable.get("checkpoint_ns") or ""),
                    configurable.get("checkpoint_id"),
                    checkpoint["id"],
                )
            return checkpoint
        record_pruned = self.record_pruned if records is None else records
        decoded = self._removed(
            config, checkpoint, new_versions, decoded, record_pruned, parent_messages_kept
        )
        return apply_reducer(
            self.reducer,
            checkpoint,
            config,
            self.messages_key,
            codec=self.codec,
            record_pruned=record_pruned,
            summaries=self.summaries,
            decoded=decoded,
        )

    def _removed(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        new_versions: ChannelVersions,
        decoded: Any = None,
        record_pruned: RecordPruned | None = None,
        parent_messages_kept: bool = False,
    ) -> Any:
        """Record (with ``record_pruned``, the put's) and hand to the hooks the messages the agent trimmed
        from its state in the step this put ends, and forget the ones it deleted
        (:mod:`reducing_saver.reducer._removals`).

        The state before the step: for a messages list stored whole, this process's note of the parent's
        list, else nothing when the caller says the agent removed none (``parent_messages_kept``), else the
        parent's stored window (messages older than it left through the window's cut, and are in memory
        already); for a DeltaChannel, the parent's pending writes are read (one read), and
        the state rebuilt from the channel's history only when they hold a removal.

        ``decoded``: the put's messages as the caller decoded them (see ``put``). Returns the put's decoded
        messages when they are known (the caller's, or decoded here), for the reducer.
        """
        removals, key = self.removals, self.messages_key
        if removals is None:
            return decoded
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), str(configurable.get("checkpoint_ns") or "")
        parent = configurable.get("checkpoint_id")
        parent_config: RunnableConfig = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": parent}
        }
        namespace = memory_namespace(self.reducer, config)
        content: dict[str, Any] | None = None
        after_keys = None
        values = checkpoint["channel_values"]
        after: list[Any] | None
        if key not in values or self.codec.is_snapshot(values[key]):  # a DeltaChannel
            step = self._delta_step(parent_config) if parent else None
            if step is None:
                return decoded
            before_messages, after = step
            before = removal_keys(before_messages, namespace)
            content = dict(zip((k for k, _ in before), before_messages, strict=True))
        else:
            if decoded is None:
                decoded = self.codec.decode(values[key])
            after = None if decoded is UNREADABLE else decoded
            if after is None:
                return UNREADABLE
            held = removals.last(thread_id, ns, parent) if parent else None
            if held is None and parent and not parent_messages_kept:
                stored = self._stored_messages(parent_config)
                if stored is not None:
                    held = removal_keys(stored, namespace)
                    content = dict(zip((k for k, _ in held), stored, strict=True))
            after_keys = removal_keys(after, namespace)
            removals.note(thread_id, ns, checkpoint["id"], after_keys)
            if not held:
                return decoded
            before = held
        if after_keys is None:
            after_keys = removal_keys(after, namespace)
        trimmed, deleted = split_removed(before, {k for k, _ in after_keys})
        remembered, forgotten = removals.decide(trimmed, deleted)
        if remembered:
            if content is None:
                stored = self._stored_messages(parent_config) or []
                content = dict(zip((k for k, _ in removal_keys(stored, namespace)), stored, strict=True))
            # A message missing from the stored window left it through the window's cut: in memory already.
            found = [content[k] for k in remembered if k in content]
            if found:
                if record_pruned is not None:
                    record_pruned(found, namespace, config, checkpoint)
                self.reducer.deliver(found, namespace)
        if forgotten and removals.forget is not None:
            removals.forget(forgotten, namespace, config)
        return decoded

    def _stored_messages(self, config: RunnableConfig) -> list[Any] | None:
        item = self.inner.get_tuple(config)
        if item is None:
            return None
        return self.codec.decode_write(item.checkpoint["channel_values"].get(self.messages_key))

    def _delta_step(self, parent_config: RunnableConfig) -> tuple[list[Any], list[Any]] | None:
        """The messages before and after the step from ``parent_config`` of a DeltaChannel, when the step's
        writes remove any (``None`` otherwise)."""
        key = self.messages_key
        item = self.inner.get_tuple(parent_config)
        if item is None:
            return None
        writes = [
            self.codec.decode_write(value) or []
            for _, channel, value in item.pending_writes or ()
            if channel == key
        ]
        if not any(is_removal(m) for write in writes for m in write):
            return None
        history: Mapping[str, Any] = (
            self.inner.get_delta_channel_history(config=parent_config, channels=[key]).get(key) or {}
        )
        state = (self.codec.decode_seed(history["seed"]) or []) if "seed" in history else []
        before = fold(
            state, (self.codec.decode_write(value) or [] for _, _, value in history.get("writes", ()))
        )
        return before, fold(before, writes)

    # -- the required saver API ---------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self.inner.get_tuple(config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        *,
        decoded: Any = None,
        records: RecordPruned | None = None,
        parent_messages_kept: bool = False,
    ) -> RunnableConfig:
        """Store ``checkpoint`` with its messages channel reduced (when ``new_versions`` writes it).

        ``decoded``: ``codec.decode`` of the messages channel's value, when the caller has decoded it
        already (a list, or :data:`UNREADABLE` for ``None``): the value is then not decoded again.

        ``parent_messages_kept``: the caller knows that every message of the parent's list is in this
        put's list (the agent removed none in the step), so the parent is not read to find removals when
        this process holds no note of its list (a remote client's hint, ``wire.PARENT_MESSAGES_HEADER``).

        ``records``: this put's own recorder, called in place of ``record_pruned`` (the same way) with the
        messages the put prunes, and handed to the inner saver's ``put`` as ``records=``: for an inner
        saver that stores what was recorded with the checkpoint, in its transaction (the service's
        PostgreSQL saver, given them by ``Memory.with_checkpoint``), which must take that keyword.
        ``None`` (the default): ``record_pruned``, and the inner ``put`` called as LangGraph calls it.
        """
        reduced = self._reduce(config, checkpoint, new_versions, decoded, records, parent_messages_kept)
        if records is None:
            return self.inner.put(config, reduced, metadata, new_versions)
        return self.inner.put(config, reduced, metadata, new_versions, records=records)  # type: ignore[call-arg]

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        return self.inner.put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self.inner.delete_thread(thread_id)
        self._summary_book_call("delete_thread", thread_id)
        if self.removals is not None:
            self.removals.forget_thread(str(thread_id))

    def _summary_book_call(self, name: str, *args: Any) -> None:
        """A thread's summary steps go where its checkpoints go (a book that keeps them per thread)."""
        if self.summaries is not None and (method := getattr(self.summaries.book, name, None)) is not None:
            method(*args)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self.inner.aget_tuple(config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        async for item in self.inner.alist(config, filter=filter, before=before, limit=limit):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        reduced = self._reduce(config, checkpoint, new_versions)
        return await self.inner.aput(config, reduced, metadata, new_versions)

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        return await self.inner.aput_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self.inner.adelete_thread(thread_id)
        self._summary_book_call("delete_thread", thread_id)


# -- optional capabilities: mixed in only when the inner saver has them ---------------------------


class _CopyThread:
    inner: BaseCheckpointSaver
    _summary_book_call: Callable[..., None]  # ReducingSaver's

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.inner.copy_thread(source_thread_id, target_thread_id)
        self._summary_book_call("copy_thread", source_thread_id, target_thread_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self.inner.acopy_thread(source_thread_id, target_thread_id)
        self._summary_book_call("copy_thread", source_thread_id, target_thread_id)


class _DeleteForRuns:
    inner: BaseCheckpointSaver

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        return self.inner.delete_for_runs(run_ids)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        return await self.inner.adelete_for_runs(run_ids)


class _Prune:
    """``prune``; ``strategy="delete"`` deletes the threads' summary steps too, as ``delete_thread`` does
    (``keep_latest`` keeps them: the latest checkpoint's summary names them)."""

    inner: BaseCheckpointSaver
    _summary_book_call: Callable[..., None]

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.inner.prune(thread_ids, strategy=strategy)
        self._forget_pruned(thread_ids, strategy)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self.inner.aprune(thread_ids, strategy=strategy)
        self._forget_pruned(thread_ids, strategy)

    def _forget_pruned(self, thread_ids: Sequence[str], strategy: str) -> None:
        if strategy == "delete":
            for thread_id in thread_ids:
                self._summary_book_call("delete_thread", thread_id)


class _DeltaChannelHistory:
    inner: BaseCheckpointSaver

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return self.inner.get_delta_channel_history(config=config, channels=channels)

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return await self.inner.aget_delta_channel_history(config=config, channels=channels)


_MIXINS: dict[str, type] = {
    "copy_thread": _CopyThread,
    "delete_for_runs": _DeleteForRuns,
    "prune": _Prune,
    "delta_channel_history": _DeltaChannelHistory,
}
