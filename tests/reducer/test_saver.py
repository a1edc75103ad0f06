"""ReducingSaver: passthrough rules, on_prune delivery on a real graph, DeltaChannel, sync/async parity."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
from collections import Counter
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import BaseCheckpointSaver, empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot
from langgraph.graph.message import _messages_delta_reducer

from reducing_saver.reducer import MessageReducer, ReducingSaver, apply_reducer, memory_namespace
from reducing_saver.reducer import _saver as saver_module
from tests.support.chat import build_chat_graph, human


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def stored_messages(saver, thread_id: str) -> list:
    return saver.get_tuple({"configurable": {"thread_id": thread_id}}).checkpoint["channel_values"][
        "messages"
    ]


class Recorder:
    """An ``on_prune`` hook that remembers every delivery."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, tuple[str, ...]]] = []

    def __call__(self, messages, namespace) -> None:
        self.calls.append((list(messages), namespace))

    @property
    def ids(self) -> list[str]:
        return [m.id for messages, _ in self.calls for m in messages]

    @property
    def namespaces(self) -> set[tuple[str, ...]]:
        return {namespace for _, namespace in self.calls}


def count_reduce_calls(reducer: MessageReducer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on ``reducer.split`` (where savers cut a list); returns a list that grows by one entry per call."""
    calls: list[int] = []
    original = reducer.split

    def spy(messages):
        calls.append(len(messages))
        return original(messages)

    monkeypatch.setattr(reducer, "split", spy)
    return calls


# -- which saver reduces ------------------------------------------------------------------------------


class ReducerAwareSaver(InMemorySaver):
    """Stands for a saver that reduces by itself (a remote client, say) once it is handed a reducer."""

    reducer: MessageReducer | None = None

    def put(self, config, checkpoint, metadata, new_versions):
        if self.reducer is not None and "messages" in new_versions:
            checkpoint = apply_reducer(self.reducer, checkpoint, config)
        return super().put(config, checkpoint, metadata, new_versions)


def run_turns(saver, turns: int, thread_id: str = "t1", prefix: str = "g") -> None:
    graph = build_chat_graph(saver, prefix=prefix, length=40)
    for turn in range(turns):
        graph.invoke({"messages": [human(turn, prefix, 40)]}, {"configurable": {"thread_id": thread_id}})


def test_inner_without_reducer_attribute_is_reduced_by_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = InMemorySaver()
    recorder = Recorder()
    reducer = MessageReducer(max_messages=4, min_messages=2, dedupe_on_prune=False, on_prune=[recorder])
    reduce_calls = count_reduce_calls(reducer, monkeypatch)
    saver = ReducingSaver(inner, reducer)
    assert (saver.passthrough, saver.inner, saver.reducer) == (False, inner, reducer)
    assert not hasattr(inner, "reducer")
    run_turns(saver, 5)
    assert len(stored_messages(inner, "t1")) <= 4
    assert reduce_calls and recorder.calls


def test_inner_with_empty_reducer_slot_gets_ours_and_does_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = ReducerAwareSaver()
    recorder = Recorder()
    reducer = MessageReducer(max_messages=4, min_messages=2, dedupe_on_prune=False, on_prune=[recorder])
    reduce_calls = count_reduce_calls(reducer, monkeypatch)
    saver = ReducingSaver(inner, reducer)
    assert saver.passthrough is True
    assert inner.reducer is reducer and saver.reducer is reducer and saver.inner is inner
    run_turns(saver, 5)
    assert len(stored_messages(inner, "t1")) <= 4
    # 5 turns, 2 puts with messages each: the inner saver reduced each once, the wrapper never.
    assert len(reduce_calls) == 10


def test_nested_wrappers_with_the_same_reducer_reduce_once(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    reducer = MessageReducer(max_messages=4, min_messages=2, dedupe_on_prune=False, on_prune=[recorder])
    reduce_calls = count_reduce_calls(reducer, monkeypatch)
    base = InMemorySaver()
    inner = ReducingSaver(base, reducer)
    outer = ReducingSaver(inner, reducer)
    assert (inner.passthrough, outer.passthrough) == (False, True)
    assert outer.inner is inner and outer.reducer is reducer
    run_turns(outer, 6)

    single_recorder = Recorder()
    single = ReducingSaver(
        InMemorySaver(),
        MessageReducer(max_messages=4, min_messages=2, dedupe_on_prune=False, on_prune=[single_recorder]),
    )
    run_turns(single, 6)
    # Once per put that writes messages, and the hooks saw exactly what a single wrapper delivers.
    assert len(reduce_calls) == 12
    assert recorder.ids == single_recorder.ids and recorder.ids
    assert ids(stored_messages(base, "t1")) == ids(stored_messages(single.inner, "t1"))


def test_a_different_reducer_is_refused() -> None:
    inner = ReducingSaver(InMemorySaver(), MessageReducer(max_messages=4))
    with pytest.raises(ValueError, match="already reduces with"):
        ReducingSaver(inner, MessageReducer(max_messages=4))
    aware = ReducerAwareSaver()
    aware.reducer = MessageReducer(max_messages=4)
    with pytest.raises(ValueError, match="different reducer"):
        ReducingSaver(aware, MessageReducer(max_messages=4))


def test_wrapper_mirrors_the_inner_savers_optional_capabilities() -> None:
    saver = ReducingSaver(InMemorySaver(), MessageReducer())
    assert saver.capabilities == frozenset({"delta_channel_history"})
    assert type(saver).acopy_thread is BaseCheckpointSaver.acopy_thread
    assert type(saver).aprune is BaseCheckpointSaver.aprune
    assert type(saver).aget_delta_channel_history is not BaseCheckpointSaver.aget_delta_channel_history
    assert isinstance(saver, ReducingSaver) and type(saver).__name__ == "ReducingSaver"


def _long_checkpoint():
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"]["messages"] = [HumanMessage(f"m{i}", id=f"m{i}") for i in range(5)]
    checkpoint["channel_versions"]["messages"] = 1
    return checkpoint


def test_copies_of_the_wrapper_keep_reducing() -> None:
    reducer = MessageReducer(max_messages=2)
    saver = ReducingSaver(InMemorySaver(), reducer)
    shallow = copy.copy(saver)
    deep = copy.deepcopy(saver)
    assert type(shallow) is type(deep) is type(saver)
    assert shallow.inner is saver.inner and shallow.reducer is reducer
    assert deep.inner is not saver.inner and deep.passthrough is False
    config = {"configurable": {"thread_id": "c", "checkpoint_ns": ""}}
    for clone in (shallow, deep):
        stored = clone.get_tuple(clone.put(config, _long_checkpoint(), {}, {"messages": 1}))
        assert ids(stored.checkpoint["channel_values"]["messages"]) == ["m3", "m4"]


def test_with_allowlist_returns_a_reducing_clone_over_the_inner_clone() -> None:
    inner = InMemorySaver(serde=JsonPlusSerializer(allowed_msgpack_modules=[("my.module", "Thing")]))
    reducer = MessageReducer(max_messages=2)
    saver = ReducingSaver(inner, reducer)
    clone = saver.with_allowlist({("other.module", "Other")})
    assert clone is not saver and type(clone) is type(saver)
    assert clone.inner is not inner and clone.serde is clone.inner.serde and clone.reducer is reducer
    config = {"configurable": {"thread_id": "a", "checkpoint_ns": ""}}
    stored = clone.get_tuple(clone.put(config, _long_checkpoint(), {}, {"messages": 1}))
    assert ids(stored.checkpoint["channel_values"]["messages"]) == ["m3", "m4"]


def test_constructing_from_a_variant_type_mirrors_the_new_inner() -> None:
    with_prune = ReducingSaver(ReducerAwareSaverWithPrune(), MessageReducer())
    assert "prune" in with_prune.capabilities
    plain = type(with_prune)(InMemorySaver(), MessageReducer())
    assert plain.capabilities == frozenset({"delta_channel_history"})
    assert type(plain).aprune is BaseCheckpointSaver.aprune


class ReducerAwareSaverWithPrune(InMemorySaver):
    async def aprune(self, thread_ids, *, strategy="keep_latest"):
        return None


# -- on_prune on a real graph ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configurable", "namespace"),
    [
        ({"memory_namespace": ["tenant-a", "user-7"]}, ("tenant-a", "user-7")),
        ({"memory_namespace": ("tenant-a", "user-7")}, ("tenant-a", "user-7")),
        ({}, ("memories", "thread-42")),
    ],
    ids=["list", "tuple", "fallback"],
)
def test_on_prune_gets_every_pruned_message_once(configurable: dict, namespace: tuple[str, ...]) -> None:
    recorder = Recorder()
    puts_with_pruning: list[int] = []

    reducer = MessageReducer(max_messages=6, min_messages=4, on_prune=[recorder])
    original_select = reducer.select

    def select(messages):
        pruned = original_select(messages)
        if pruned:
            puts_with_pruning.append(pruned)
        return pruned

    reducer.select = select
    saver = ReducingSaver(InMemorySaver(), reducer)
    graph = build_chat_graph(saver, length=40, with_tools=True)
    config = {"configurable": {"thread_id": "thread-42", **configurable}}
    seen: dict[str, None] = {}
    system = SystemMessage("be brief", id="sys")
    for turn in range(12):
        new = [system, human(turn, "g", 40)] if turn == 0 else [human(turn, "g", 40)]
        result = graph.invoke({"messages": new}, config)
        seen.update(dict.fromkeys(ids(result["messages"])))

    stored = ids(stored_messages(saver, "thread-42"))
    pruned_once_each = [i for i in seen if i not in stored]
    assert stored[0] == "sys"
    assert recorder.ids == pruned_once_each  # every pruned message, once, oldest first
    assert recorder.namespaces == {namespace}
    # The dedupe did real work: most turns pruned on more than one put.
    assert len(puts_with_pruning) > len(recorder.calls)


def test_on_prune_without_dedupe_delivers_repeats() -> None:
    recorder = Recorder()
    saver = ReducingSaver(
        InMemorySaver(),
        MessageReducer(max_messages=6, min_messages=4, dedupe_on_prune=False, on_prune=[recorder]),
    )
    run_turns(saver, 8)
    repeats = {i: n for i, n in Counter(recorder.ids).items() if n > 1}
    assert repeats
    stored = ids(stored_messages(saver, "t1"))
    assert set(recorder.ids).isdisjoint(stored)


class RecordsTakingSaver(InMemorySaver):
    """Stands for a saver that stores what a put recorded with its checkpoint (the service's PostgreSQL
    saver): its ``put`` takes the put's recorder as ``records=``."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list = []

    def put(self, config, checkpoint, metadata, new_versions, *, records=None):
        self.given.append(records)
        return super().put(config, checkpoint, metadata, new_versions)


def _window_put(saver: ReducingSaver, thread_id: str, **kwargs) -> None:
    """One put of 8 messages on a fresh thread: a window of 4 cut to 2 prunes the first 6."""
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"messages": [HumanMessage(f"q{i}", id=f"m{i}") for i in range(8)]}
    checkpoint["channel_versions"] = {"messages": 1}
    config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    saver.put(config, checkpoint, {"source": "input", "step": -1}, {"messages": 1}, **kwargs)


def test_a_puts_own_recorder_takes_its_pruned_messages_and_reaches_the_inner_put() -> None:
    by_saver: list[list[str]] = []
    by_put: list[list[str]] = []

    def record_pruned(pruned, namespace, config, checkpoint) -> None:
        by_saver.append(ids(pruned))

    def records(pruned, namespace, config, checkpoint) -> None:
        by_put.append(ids(pruned))

    reducer = MessageReducer(max_messages=4, min_messages=2)
    inner = RecordsTakingSaver()
    saver = ReducingSaver(inner, reducer, record_pruned=record_pruned)
    _window_put(saver, "own", records=records)
    assert by_put == [["m0", "m1", "m2", "m3", "m4", "m5"]] and by_saver == []
    assert inner.given == [records]
    # Without one, the saver's record_pruned records, and a stock inner put is called as LangGraph calls it.
    plain = ReducingSaver(InMemorySaver(), reducer, record_pruned=record_pruned)
    _window_put(plain, "plain")
    assert by_saver == [["m0", "m1", "m2", "m3", "m4", "m5"]] and by_put == [
        ["m0", "m1", "m2", "m3", "m4", "m5"]
    ]
    assert ids(stored_messages(plain, "plain")) == ["m6", "m7"]


def test_a_raising_hook_is_logged_and_the_put_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def broken(messages, namespace):
        raise RuntimeError("memory store unavailable")

    saver = ReducingSaver(InMemorySaver(), MessageReducer(max_messages=6, min_messages=4, on_prune=[broken]))
    with caplog.at_level(logging.ERROR, logger="reducing_saver.reducer"):
        run_turns(saver, 6)
    assert len(stored_messages(saver, "t1")) <= 6
    failures = [r for r in caplog.records if r.levelno == logging.ERROR and "on_prune hook" in r.getMessage()]
    assert failures and all("memory store unavailable" in (r.exc_text or "") for r in failures)


def test_memory_namespace() -> None:
    reducer = MessageReducer(max_messages=4)
    assert memory_namespace(reducer, {"configurable": {"thread_id": "t"}}) == ("memories", "t")
    assert memory_namespace(
        reducer, {"configurable": {"thread_id": "t", "memory_namespace": ["a", "b"]}}
    ) == (
        "a",
        "b",
    )
    assert memory_namespace(reducer, {"configurable": {"memory_namespace": ("a",)}}) == ("a",)
    assert memory_namespace(reducer, {"configurable": {"memory_namespace": "solo"}}) == ("solo",)
    custom = MessageReducer(max_messages=4, namespace_key="ns")
    assert memory_namespace(custom, {"configurable": {"thread_id": "t", "ns": ["x"]}}) == ("x",)


# -- DeltaChannel-backed messages ---------------------------------------------------------------------


class DeltaState(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=2)]


def test_delta_channel_messages_are_left_alone_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(saver_module, "_warned_delta_channels", set())
    received: list[object] = []

    class Spy(InMemorySaver):
        def put(self, config, checkpoint, metadata, new_versions):
            if "messages" in new_versions:
                received.append(checkpoint["channel_values"].get("messages", "absent"))
            return super().put(config, checkpoint, metadata, new_versions)

    recorder = Recorder()
    saver = ReducingSaver(Spy(), MessageReducer(max_messages=2, on_prune=[recorder]))
    graph = build_chat_graph(saver, length=40, state_schema=DeltaState)
    config = {"configurable": {"thread_id": "delta"}}
    with caplog.at_level(logging.WARNING, logger="reducing_saver.reducer"):
        for turn in range(4):
            graph.invoke({"messages": [human(turn, "g", 40)]}, config)

    # Both forms went through the wrapper: absent values and snapshots.
    assert "absent" in received and any(isinstance(v, _DeltaSnapshot) for v in received)
    # Nothing was cut: the state still holds all 8 messages, snapshots hold the full list, no hook fired.
    assert len(graph.get_state(config).values["messages"]) == 8
    snapshots = [v for v in received if isinstance(v, _DeltaSnapshot)]
    assert [len(s.value) for s in snapshots] == sorted(len(s.value) for s in snapshots)
    assert max(len(s.value) for s in snapshots) > 2
    assert recorder.calls == []
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "DeltaChannel" in r.getMessage()
    ]
    assert len(warnings) == 1


class GreedyCodec:
    """A codec that would read a delta snapshot as a messages list: only the DeltaChannel check stops it."""

    def decode(self, value):
        return list(value.value) if isinstance(value, _DeltaSnapshot) else value

    def encode(self, kept, original):
        return kept


@pytest.mark.parametrize(
    "value", ["absent", _DeltaSnapshot([HumanMessage("x", id=str(i)) for i in range(9)])]
)
def test_apply_reducer_returns_delta_checkpoints_untouched(
    value, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(saver_module, "_warned_delta_channels", set())
    checkpoint = empty_checkpoint()
    checkpoint["channel_versions"]["messages"] = 3
    if value != "absent":
        checkpoint["channel_values"]["messages"] = value
    before = dict(checkpoint["channel_values"])
    reducer = MessageReducer(max_messages=2)
    with caplog.at_level(logging.WARNING, logger="reducing_saver.reducer"):
        for _ in range(3):
            result = apply_reducer(
                reducer, checkpoint, {"configurable": {"thread_id": "t"}}, codec=GreedyCodec()
            )
            assert result is checkpoint and checkpoint["channel_values"] == before
    assert len([r for r in caplog.records if "DeltaChannel" in r.getMessage()]) == 1
    # The same codec does reduce an ordinary list: the check above is what protected the snapshot.
    plain = empty_checkpoint()
    plain["channel_values"]["messages"] = [HumanMessage("x", id=str(i)) for i in range(9)]
    reduced = apply_reducer(reducer, plain, {"configurable": {"thread_id": "t"}}, codec=GreedyCodec())
    assert len(reduced["channel_values"]["messages"]) == 2


# -- sync and async put paths --------------------------------------------------------------------------


def _checkpoints_for_parity() -> list[tuple[dict, dict]]:
    """A growing conversation with tool calls, as successive (checkpoint, new_versions) puts."""
    messages = [SystemMessage("sys", id="sys")]
    puts = []
    for turn in range(8):
        messages = messages + [HumanMessage(f"q{turn}", id=f"h{turn}")]
        if turn % 2:
            messages = messages + [
                AIMessage("", id=f"c{turn}", tool_calls=[{"id": f"call{turn}", "name": "f", "args": {}}]),
                ToolMessage(f"r{turn}", tool_call_id=f"call{turn}", id=f"t{turn}"),
            ]
        messages = messages + [AIMessage(f"a{turn}", id=f"a{turn}")]
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"messages": messages, "other": turn}
        checkpoint["channel_versions"] = {"messages": turn + 1, "other": turn + 1}
        puts.append((checkpoint, {"messages": turn + 1, "other": turn + 1}))
    return puts


async def test_sync_and_async_puts_reduce_identically() -> None:
    def make():
        recorder = Recorder()
        return ReducingSaver(
            InMemorySaver(), MessageReducer(max_messages=5, min_messages=3, on_prune=[recorder])
        ), recorder

    sync_saver, sync_recorder = make()
    async_saver, async_recorder = make()
    config = {"configurable": {"thread_id": "p", "checkpoint_ns": ""}}
    sync_windows, async_windows = [], []
    puts = _checkpoints_for_parity()
    for checkpoint, versions in puts:
        sync_config = sync_saver.put(config, checkpoint, {}, versions)
        async_config = await async_saver.aput(config, checkpoint, {}, versions)
        sync_windows.append(ids(sync_saver.get_tuple(sync_config).checkpoint["channel_values"]["messages"]))
        async_windows.append(
            ids((await async_saver.aget_tuple(async_config)).checkpoint["channel_values"]["messages"])
        )
    assert sync_windows == async_windows
    input_lengths = [len(checkpoint["channel_values"]["messages"]) for checkpoint, _ in puts]
    assert sum(len(w) < n for w, n in zip(sync_windows, input_lengths, strict=True)) >= 5
    assert sync_recorder.ids == async_recorder.ids and sync_recorder.ids
    assert sync_recorder.namespaces == async_recorder.namespaces == {("memories", "p")}


async def test_sync_and_async_graph_runs_store_the_same_windows() -> None:
    sync_saver = ReducingSaver(InMemorySaver(), MessageReducer(max_messages=6, min_messages=4))
    async_saver = ReducingSaver(InMemorySaver(), MessageReducer(max_messages=6, min_messages=4))
    sync_graph = build_chat_graph(sync_saver, length=40)
    async_graph = build_chat_graph(async_saver, length=40)
    config = {"configurable": {"thread_id": "same"}}
    for turn in range(9):
        sync_graph.invoke({"messages": [human(turn, "g", 40)]}, config)
        await async_graph.ainvoke({"messages": [human(turn, "g", 40)]}, config)
        assert ids(stored_messages(sync_saver, "same")) == ids(
            (await async_saver.aget_tuple(config)).checkpoint["channel_values"]["messages"]
        )
    sync_history = [ids(t.checkpoint["channel_values"].get("messages", [])) for t in sync_saver.list(config)]
    async_history = [
        ids(t.checkpoint["channel_values"].get("messages", [])) async for t in async_saver.alist(config)
    ]
    assert sync_history == async_history


# -- import hygiene ---------------------------------------------------------------------------------


def test_reducer_core_imports_no_web_framework() -> None:
    code = (
        "import sys\n"
        "from reducing_saver.reducer import MessageReducer, ReducerConfig, ReducingSaver, memory_namespace, apply_reducer\n"
        "assert 'fastapi' not in sys.modules, 'fastapi was imported'\n"
        "assert 'starlette' not in sys.modules, 'starlette was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
