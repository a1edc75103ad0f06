"""Messages an agent removes itself: trimmed ones reach memory once, deleted ones are forgotten.

An in-process ``ReducingSaver`` (no window: ``max_messages`` far above the thread) over ``InMemorySaver``,
a graph that trims with ``RemoveMessage`` or summarizes with ``REMOVE_ALL_MESSAGES``, on ``add_messages``
and on a DeltaChannel.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, RemoveMessage, SystemMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES, _messages_delta_reducer, add_messages

from reducing_saver.reducer import MessageReducer, ReducerConfig, ReducingSaver, Removals, split_removed
from reducing_saver.reducer._removals import _passed_over, fold, removal_keys
from reducing_saver.reducer._window import SUMMARY_SOURCE, message_key


class _Added(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class _Delta(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=4)]


def _graph(saver, schema, manage):
    """``chat`` answers; ``manage`` (a function of the state) then trims or summarizes."""

    def chat(state):
        last = state["messages"][-1].id
        turn = last.removeprefix("h-") if last.startswith("h-") else "0"
        return {"messages": [AIMessage(f"answer {turn}", id=f"ai-{turn}")]}

    def tidy(state):
        return {"messages": manage(state["messages"])}

    builder = StateGraph(schema)
    builder.add_node("chat", chat)
    builder.add_node("tidy", tidy)
    builder.add_edge(START, "chat")
    builder.add_edge("chat", "tidy")
    builder.add_edge("tidy", END)
    return builder.compile(checkpointer=saver)


def _trim_to_last(n):
    return lambda messages: [RemoveMessage(id=m.id) for m in messages[:-n]]


def _summarize_keeping(n):
    def summarize(messages):
        if len(messages) <= n + 1:
            return []
        summary = HumanMessage(
            "summary", id=f"summary-{messages[-1].id}", additional_kwargs={"lc_source": "summarization"}
        )
        return [RemoveMessage(id=REMOVE_ALL_MESSAGES), summary, *messages[-n:]]

    return summarize


class _Memory:
    def __init__(self) -> None:
        self.delivered: list[str] = []
        self.forgotten: list[str] = []

    def hook(self, messages, namespace) -> None:
        self.delivered += [m.id for m in messages]

    def forget(self, keys, namespace, config) -> None:
        self.forgotten += keys


def _saver(memory: _Memory, remember: str = "trimmed") -> ReducingSaver:
    reducer = MessageReducer(ReducerConfig(max_messages=1000, on_prune=[memory.hook]))
    return ReducingSaver(InMemorySaver(), reducer, removals=Removals(remember, forget=memory.forget))


def test_split_removed_trims_the_oldest_and_deletes_the_rest() -> None:
    before = [
        ("sys", True),
        ("h1", False),
        ("a1", False),
        ("summary", True),
        ("h2", False),
        ("a2", False),
        ("h3", False),
    ]
    assert split_removed(before, {"h2", "h3", "sys", "summary"}) == (["h1", "a1"], ["a2"])
    assert split_removed(before, {"h1", "a1", "h2", "a2", "h3"}) == ([], [])
    assert split_removed(before, set()) == (["h1", "a1", "h2", "a2", "h3"], [])


def test_removal_keys_read_dicts_as_message_key_and_passing_over_read_any_message() -> None:
    """The keys of a put's decoded messages (dicts) are those ``message_key`` and the passing-over rule
    give, whatever the dict holds; messages as objects too."""
    summary = {"lc_source": SUMMARY_SOURCE}
    dicts = [
        {"type": "human", "id": "h1", "content": "a", "additional_kwargs": {}},
        {"type": "system", "id": "s1", "content": "rules"},
        {"type": "SystemMessageChunk", "id": "s2", "content": "rules"},
        {"type": "ai", "id": "sum", "content": "so far", "additional_kwargs": summary},
        {"type": "ai", "id": "odd", "content": "x", "additional_kwargs": MappingProxyType(summary)},
        {"type": "AIMessageChunk", "id": "a1", "content": "b", "additional_kwargs": None},
        {"type": "human", "id": "", "content": "no id"},
        {"type": "human", "content": "no id at all"},
        {"type": "human", "id": "nul\x00id", "content": "c"},
        {"type": "human", "id": 42, "content": "an int id"},
        {"type": None, "id": "t1", "content": "no type"},
        {"id": "t2", "content": "no type key"},
    ]
    objects = [
        HumanMessage("a", id="h2"),
        SystemMessage("rules", id="s3"),
        AIMessage("so far", id="sum2", additional_kwargs=summary),
        HumanMessage("no id"),
    ]
    namespace = ("memories", "t")
    for message in [*dicts, *objects]:
        expected = (message_key(message, namespace), _passed_over(message))
        assert removal_keys([message], namespace) == (expected,), message
    assert [passed for _, passed in removal_keys(dicts, namespace)] == [
        False,
        True,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
        False,
    ]


def test_fold_is_add_messages() -> None:
    state = [HumanMessage("a", id="1"), AIMessage("b", id="2")]
    writes = [
        [AIMessage("b2", id="2"), HumanMessage("c", id="3")],
        [RemoveMessage(id="1")],
        [RemoveMessage(id=REMOVE_ALL_MESSAGES), HumanMessage("d", id="4")],
    ]
    for end in range(len(writes) + 1):
        expected = state
        for write in writes[:end]:
            expected = add_messages(expected, write)
        assert [m.id for m in fold(state, writes[:end])] == [m.id for m in expected]


@pytest.mark.parametrize("schema", [_Added, _Delta], ids=["add_messages", "delta"])
@pytest.mark.parametrize("manage", [_trim_to_last(4), _summarize_keeping(3)], ids=["trim", "summarize"])
def test_every_message_the_agent_removes_reaches_memory_once(schema, manage) -> None:
    memory = _Memory()
    graph = _graph(_saver(memory), schema, manage)
    config = {"configurable": {"thread_id": "t"}}
    graph.invoke({"messages": [SystemMessage("be brief", id="sys")]}, config)
    for turn in range(1, 13):
        graph.invoke({"messages": [HumanMessage(f"q {turn}", id=f"h-{turn}")]}, config)
    kept = {m.id for m in graph.get_state(config).values["messages"]}
    everything = {"sys"} | {f"h-{t}" for t in range(1, 13)} | {f"ai-{t}" for t in range(13)}
    assert sorted(memory.delivered) == sorted(
        everything - kept - {"sys"}
    )  # each once; the system prompt stays
    assert memory.forgotten == []


@pytest.mark.parametrize("schema", [_Added, _Delta], ids=["add_messages", "delta"])
@pytest.mark.parametrize("remember", ["trimmed", "all", "none"])
def test_a_deliberate_deletion_is_forgotten_unless_every_removal_is_remembered(schema, remember) -> None:
    memory = _Memory()
    graph = _graph(_saver(memory, remember), schema, lambda messages: [])
    config = {"configurable": {"thread_id": "t"}}
    for turn in range(1, 5):
        graph.invoke({"messages": [HumanMessage(f"q {turn}", id=f"h-{turn}")]}, config)
    graph.update_state(config, {"messages": [RemoveMessage(id="h-2")]})  # "forget what I said"
    graph.invoke({"messages": [HumanMessage("q 5", id="h-5")]}, config)
    assert "h-2" not in {m.id for m in graph.get_state(config).values["messages"]}
    assert memory.delivered == (["h-2"] if remember == "all" else [])
    assert memory.forgotten == ([] if remember == "all" else ["h-2"])


def test_a_message_removed_and_added_again_is_delivered_once_per_removal_key() -> None:
    memory = _Memory()
    graph = _graph(_saver(memory), _Added, lambda messages: [])
    config = {"configurable": {"thread_id": "t"}}
    graph.invoke({"messages": [HumanMessage("q 1", id="h-1")]}, config)
    graph.update_state(config, {"messages": [RemoveMessage(id="h-1")]})
    graph.update_state(config, {"messages": [HumanMessage("q 1", id="h-1")]})
    assert memory.delivered == ["h-1"]  # the hooks see each removal; the service's outbox keeps one per key


class _CountingSaver(InMemorySaver):
    """InMemorySaver noting the reads of one named checkpoint (a checkpoint id in the config)."""

    def __init__(self) -> None:
        super().__init__()
        self.named_reads = 0

    def get_tuple(self, config):
        if config["configurable"].get("checkpoint_id"):
            self.named_reads += 1
        return super().get_tuple(config)


def test_the_turns_of_a_thread_this_process_stored_read_no_parent_checkpoint() -> None:
    # A turn's first put (the input) does not write the messages channel; the note of the list before it
    # carries over, so the step's puts find the state before them without reading a parent checkpoint.
    memory = _Memory()
    inner = _CountingSaver()
    reducer = MessageReducer(ReducerConfig(max_messages=1000, on_prune=[memory.hook]))
    graph = _graph(
        ReducingSaver(inner, reducer, removals=Removals(forget=memory.forget)), _Added, lambda m: []
    )
    config = {"configurable": {"thread_id": "t"}}
    for turn in range(1, 7):
        graph.invoke({"messages": [HumanMessage(f"q {turn}", id=f"h-{turn}")]}, config)
    assert inner.named_reads == 0
    # Another process (no note) reads the parent once, then carries its note; a removal still reaches memory.
    again = _Memory()
    reducer = MessageReducer(ReducerConfig(max_messages=1000, on_prune=[again.hook]))
    fresh = _graph(
        ReducingSaver(inner, reducer, removals=Removals(forget=again.forget)), _Added, _trim_to_last(4)
    )
    fresh.invoke({"messages": [HumanMessage("q 7", id="h-7")]}, config)
    assert inner.named_reads == 2  # the step's first put, and the trim's content (the note holds keys only)
    assert again.delivered == ["h-1", "ai-1", "h-2", "ai-2", "h-3", "ai-3", "h-4", "ai-4", "h-5", "ai-5"]
