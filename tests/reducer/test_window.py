"""MessageReducer: window selection (table-driven and property-based), tokens, hooks, dedupe, config."""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    HumanMessageChunk,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.utils import count_tokens_approximately

from reducing_saver.reducer import MessageReducer, ReducerConfig
from tests.support.windows import msg_kind

# -- compact message builders -------------------------------------------------------------------------


def S(text: str = "You are helpful.") -> SystemMessage:
    return SystemMessage(text, id="sys")


def H(name: str, text: str | None = None) -> HumanMessage:
    return HumanMessage(text if text is not None else f"question {name}", id=name)


def A(name: str, *calls: str, text: str | None = None) -> AIMessage:
    return AIMessage(
        text if text is not None else f"answer {name}",
        id=name,
        tool_calls=[{"id": call, "name": "lookup", "args": {"q": call}} for call in calls],
    )


def T(call: str, text: str | None = None) -> ToolMessage:
    return ToolMessage(text if text is not None else f"result {call}", tool_call_id=call, id=f"t-{call}")


def ids(messages) -> list[str]:
    return [m["id"] if isinstance(m, dict) else m.id for m in messages]


def content_length_counter(messages) -> int:
    """A custom token counter: one token per content character."""
    return sum(len(m["content"] if isinstance(m, dict) else m.content) for m in messages)


# -- table-driven window selection --------------------------------------------------------------------


@dataclass
class Case:
    name: str
    messages: list
    options: dict
    kept: list[str]


CASES = [
    Case(
        "under the trigger: kept whole",
        [S(), H("h1"), A("a1"), H("h2"), A("a2")],
        {"max_messages": 6, "min_messages": 4},
        ["sys", "h1", "a1", "h2", "a2"],
    ),
    Case(
        "exactly at the trigger: kept whole",
        [H("h1"), A("a1"), H("h2"), A("a2"), H("h3"), A("a3")],
        {"max_messages": 6, "min_messages": 4},
        ["h1", "a1", "h2", "a2", "h3", "a3"],
    ),
    Case(
        "over the trigger: cut down to min_messages, system kept",
        [S(), H("h1"), A("a1"), H("h2"), A("a2"), H("h3"), A("a3"), H("h4")],
        {"max_messages": 6, "min_messages": 4},
        ["sys", "h3", "a3", "h4"],
    ),
    Case(
        "no system message: the window itself is min_messages long",
        [H("h1"), A("a1"), H("h2"), A("a2"), H("h3"), A("a3"), H("h4"), A("a4")],
        {"max_messages": 6, "min_messages": 4},
        ["h3", "a3", "h4", "a4"],
    ),
    Case(
        "min_messages defaults to max_messages",
        [H("h1"), A("a1"), H("h2"), A("a2"), H("h3"), A("a3"), H("h4")],
        {"max_messages": 6},
        ["h2", "a2", "h3", "a3", "h4"],
    ),
    Case(
        "the window starts on a human message: longest window that meets the target",
        [H("h1"), A("a1"), A("a1b"), H("h2"), A("a2"), A("a2b"), A("a2c"), H("h3"), A("a3")],
        {"max_messages": 6, "min_messages": 5},
        ["h3", "a3"],
    ),
    Case(
        "no cut meets the target: the shortest valid window",
        [H("h1"), A("a1"), H("h2"), A("a2"), A("a2b"), A("a2c"), A("a2d")],
        {"max_messages": 4, "min_messages": 3},
        ["h2", "a2", "a2b", "a2c", "a2d"],
    ),
    Case(
        "no valid cut at all: kept whole",
        [H("h1"), A("a1"), A("a1b"), A("a1c"), A("a1d"), A("a1e")],
        {"max_messages": 3},
        ["h1", "a1", "a1b", "a1c", "a1d", "a1e"],
    ),
    Case(
        "the newest message always stays",
        [H("h1"), A("a1"), H("h2")],
        {"max_messages": 1},
        ["h2"],
    ),
    Case(
        "a tool-call group is kept whole",
        [H("h1"), A("a1", "c1", "c2"), T("c1"), T("c2"), A("a1b"), H("h2"), A("a2", "c3"), T("c3"), A("a2b")],
        {"max_messages": 6, "min_messages": 5},
        ["h2", "a2", "t-c3", "a2b"],
    ),
    Case(
        "start_on=None may start on an AI message, never inside a tool-call group",
        [H("h1"), A("a1", "c1", "c2"), T("c1"), T("c2"), A("a1b"), H("h2")],
        {"max_messages": 3, "start_on": None},
        ["a1b", "h2"],
    ),
    Case(
        "start_on=None may start on an AI message that calls tools, results and all",
        [H("h1"), A("a0"), A("a1", "c1"), T("c1"), A("a1b")],
        {"max_messages": 4, "min_messages": 3, "start_on": None},
        ["a1", "t-c1", "a1b"],
    ),
    Case(
        "cascade_tool_messages=False with start_on=None may orphan tool results",
        [H("h1"), A("a1", "c1", "c2"), T("c1"), T("c2"), A("a1b"), H("h2")],
        {"max_messages": 3, "start_on": None, "cascade_tool_messages": False},
        ["t-c2", "a1b", "h2"],
    ),
    Case(
        "cascade_tool_messages=False with start_on=human still starts on a human message",
        [H("h1"), A("a1", "c1"), H("h-interjected"), T("c1"), A("a1b"), H("h2"), A("a2")],
        {"max_messages": 5, "min_messages": 5, "cascade_tool_messages": False},
        ["h-interjected", "t-c1", "a1b", "h2", "a2"],
    ),
    Case(
        "cascade_tool_messages=True never cuts between a call and its late result",
        [H("h1"), A("a1", "c1"), H("h-interjected"), T("c1"), A("a1b"), H("h2"), A("a2")],
        {"max_messages": 5, "min_messages": 5},
        ["h2", "a2"],
    ),
    Case(
        "the newest AI call whose tools have not run yet stays at the tail",
        [S(), H("h1"), A("a1"), H("h2"), A("a2", "c9")],
        {"max_messages": 3},
        ["sys", "h2", "a2"],
    ),
    Case(
        "preserve_first=False prunes the system message like any other",
        [S(), H("h1"), A("a1"), H("h2"), A("a2")],
        {"max_messages": 4, "min_messages": 2, "preserve_first": False},
        ["h2", "a2"],
    ),
    Case(
        "preserve_first only protects a system message",
        [H("h1"), A("a1"), H("h2"), A("a2"), H("h3")],
        {"max_messages": 4, "min_messages": 3},
        ["h2", "a2", "h3"],
    ),
    Case(
        "the preserved system message counts towards the window",
        [S(), H("h1"), A("a1"), H("h2"), A("a2"), H("h3")],
        {"max_messages": 5, "min_messages": 3},
        ["sys", "h3"],
    ),
    Case(
        "token mode with a custom counter: whole messages, newest first",
        [
            H("h1", "x" * 10),
            A("a1", text="x" * 10),
            H("h2", "x" * 10),
            A("a2", text="x" * 10),
            H("h3", "x" * 5),
        ],
        {
            "max_messages": None,
            "max_tokens": 40,
            "target_tokens": 25,
            "token_counter": content_length_counter,
        },
        ["h2", "a2", "h3"],
    ),
    Case(
        "token mode: under max_tokens nothing happens",
        [H("h1", "x" * 10), A("a1", text="x" * 10), H("h2", "x" * 10), A("a2", text="x" * 10)],
        {"max_messages": None, "max_tokens": 40, "target_tokens": 5, "token_counter": content_length_counter},
        ["h1", "a1", "h2", "a2"],
    ),
    Case(
        "token mode: one oversized message is kept whole, never truncated",
        [H("h1", "x" * 10), A("a1", text="x" * 10), H("h2", "x" * 100)],
        {"max_messages": None, "max_tokens": 50, "token_counter": content_length_counter},
        ["h2"],
    ),
    Case(
        "count and token triggers combined: the token trigger fires, both targets are met",
        [
            H("h1", "x" * 30),
            A("a1", text="x"),
            H("h2", "x"),
            A("a2", text="x"),
            H("h3", "x"),
            A("a3", text="x"),
        ],
        {"max_messages": 10, "min_messages": 3, "max_tokens": 30, "token_counter": content_length_counter},
        ["h3", "a3"],
    ),
]


@pytest.mark.parametrize("as_dicts", [False, True], ids=["objects", "dicts"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_window_selection(case: Case, as_dicts: bool) -> None:
    messages = [m.model_dump() for m in case.messages] if as_dicts else list(case.messages)
    kept, pruned = MessageReducer(**case.options).reduce(messages, ("memories", "t"))
    assert ids(kept) == case.kept
    # The same objects, never copies.
    assert all(any(k is m for m in messages) for k in kept)
    assert all(any(p is m for m in messages) for p in pruned)
    assert sorted(map(id, kept + pruned)) == sorted(map(id, messages))


def test_default_token_counter() -> None:
    messages = [S(), H("h1", "a" * 200), A("a1", text="b" * 200), H("h2", "c" * 200), A("a2", text="d" * 200)]
    per_message = [count_tokens_approximately([m]) for m in messages]
    # Room for the system message and the newest turn, not for two turns.
    limit = per_message[0] + per_message[3] + per_message[4]
    reducer = MessageReducer(max_messages=None, max_tokens=limit)
    assert sum(per_message) > limit
    assert ids(reducer.reduce(messages).kept) == ["sys", "h2", "a2"]
    assert ids(reducer.reduce([m.model_dump() for m in messages]).kept) == ["sys", "h2", "a2"]
    # One token less and the newest turn no longer fits beside the system prompt: the shortest window.
    tight = MessageReducer(max_messages=None, max_tokens=limit - 1)
    assert ids(tight.reduce(messages).kept) == ["sys", "h2", "a2"]
    roomy = MessageReducer(max_messages=None, max_tokens=sum(per_message))
    assert ids(roomy.reduce(messages).kept) == ids(messages)


def test_default_token_counter_counts_dicts_like_objects() -> None:
    """Chunks, tool messages and tool calls: the default counter must not depend on the form."""
    messages = [
        H("h1", "hello " * 40),
        AIMessageChunk(content="streamed " * 40, id="chunk"),
        HumanMessageChunk(content="more " * 40, id="hchunk"),
        A("a1", "c1", text="calling " * 10),
        T("c1", "result " * 40),
        A("a2", text="done " * 40),
        H("h2", "bye " * 10),
    ]
    dicts = [m.model_dump() for m in messages]
    for target in range(1, 400, 7):
        reducer = MessageReducer(max_messages=None, max_tokens=target, start_on=None)
        assert reducer.select(messages) == reducer.select(dicts), target


def test_default_token_counter_survives_dicts_of_unknown_types() -> None:
    dicts = [{"type": "human", "content": "x" * 400, "id": "h1"}, {"type": "custom", "content": 7, "id": "c"}]
    dicts.append({"type": "human", "content": "hi", "id": "h2"})
    kept, pruned = MessageReducer(max_messages=None, max_tokens=20).reduce(dicts)
    assert ids(kept) == ["h2"] and ids(pruned) == ["h1", "c"]


def test_token_counter_is_applied_one_message_at_a_time() -> None:
    calls: list[int] = []

    def counter(batch) -> int:
        calls.append(len(batch))
        return content_length_counter(batch)

    messages = [H("h1", "x" * 10), A("a1", text="x" * 10), H("h2", "x" * 10)]
    kept, pruned = MessageReducer(max_messages=None, max_tokens=15, token_counter=counter).reduce(messages)
    assert calls and set(calls) == {1}
    # 10 tokens a message: only the last human turn fits in 15.
    assert ([m.id for m in kept], [m.id for m in pruned]) == (["h2"], ["h1", "a1"])


def test_kept_and_pruned_split_the_input_in_order() -> None:
    messages = [S(), H("h1"), A("a1"), H("h2"), A("a2"), H("h3")]
    kept, pruned = MessageReducer(max_messages=4, min_messages=2).reduce(messages)
    assert kept[:1] + pruned + kept[1:] == messages
    assert all(a is b for a, b in zip(kept[:1] + pruned + kept[1:], messages, strict=True))


def test_select_is_pure() -> None:
    seen = []
    reducer = MessageReducer(max_messages=2, on_prune=[lambda m, ns: seen.append(m)])
    assert reducer.select([H("h1"), A("a1"), H("h2")]) == 2
    assert seen == []


# -- property test over random conversations ----------------------------------------------------------

TEXT = st.integers(min_value=0, max_value=160)


@st.composite
def conversations(draw) -> list:
    """Valid conversations: optional system prompt, turns of human, AI (with or without tool calls), tool.

    Sometimes a human message lands between a tool call and its results; the last AI message may call
    tools that have not run yet.
    """
    counter = itertools.count()
    messages: list = []

    def text(prefix: str) -> str:
        return prefix + "x" * draw(TEXT)

    if draw(st.booleans()):
        messages.append(SystemMessage(text("system "), id=f"m{next(counter)}"))
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        for _ in range(draw(st.integers(min_value=1, max_value=2))):
            cls = draw(st.sampled_from([HumanMessage, HumanMessage, HumanMessageChunk]))
            messages.append(cls(content=text("human "), id=f"m{next(counter)}"))
        for _ in range(draw(st.integers(min_value=0, max_value=3))):
            calls = [f"call{next(counter)}" for _ in range(draw(st.integers(min_value=0, max_value=3)))]
            if calls:
                messages.append(
                    AIMessage(
                        content=text("ai "),
                        id=f"m{next(counter)}",
                        tool_calls=[{"id": c, "name": "lookup", "args": {"q": c}} for c in calls],
                    )
                )
                results = [
                    ToolMessage(content=text("tool "), tool_call_id=call, id=f"m{next(counter)}")
                    for call in draw(st.permutations(calls))
                ]
                if draw(st.integers(min_value=0, max_value=3)) == 0:
                    # The user speaks while tools run: a result arrives after a later message.
                    at = draw(st.integers(min_value=0, max_value=len(results) - 1))
                    results.insert(at, HumanMessage(content=text("interjection "), id=f"m{next(counter)}"))
                messages.extend(results)
            else:
                cls = draw(st.sampled_from([AIMessage, AIMessage, AIMessageChunk]))
                messages.append(cls(content=text("ai "), id=f"m{next(counter)}"))
    if draw(st.booleans()):
        calls = [f"call{next(counter)}" for _ in range(draw(st.integers(min_value=1, max_value=2)))]
        messages.append(
            AIMessage(
                content="",
                id=f"m{next(counter)}",
                tool_calls=[{"id": c, "name": "lookup", "args": {}} for c in calls],
            )
        )
    return messages


@st.composite
def reducer_options(draw) -> dict:
    mode = draw(st.sampled_from(["count", "tokens", "both"]))
    options: dict = {
        "preserve_first": draw(st.booleans()),
        "cascade_tool_messages": draw(st.booleans()),
        "start_on": draw(st.sampled_from(["human", None])),
        "max_messages": None,
    }
    if mode in ("count", "both"):
        options["max_messages"] = draw(st.integers(min_value=1, max_value=14))
        options["min_messages"] = draw(st.integers(min_value=1, max_value=options["max_messages"]))
    if mode in ("tokens", "both"):
        options["max_tokens"] = draw(st.integers(min_value=5, max_value=500))
        options["target_tokens"] = draw(st.integers(min_value=1, max_value=options["max_tokens"]))
    return options


def expected_cut(messages: list, options: dict, window_problems) -> tuple[int, int | None, list[int]]:
    """An oracle built from the API rules, not from the reducer's code.

    Returns ``(head, cut, valid_cuts)``: the window is ``messages[:head] + messages[cut:]`` (``cut is None``:
    kept whole). A *valid cut* is an index ``head < c < len(messages)`` (the newest message always stays)
    whose window obeys ``start_on`` and, with ``cascade_tool_messages``, passes the API check. The targets
    *can be met* when some valid cut's window holds at most ``min_messages`` messages and at most
    ``target_tokens`` tokens; then the reducer must keep the longest such window, else the shortest valid
    window (the one nearest to the bounds), else everything.
    """
    n = len(messages)
    head = 1 if options["preserve_first"] and n and msg_kind(messages[0]) == "system" else 0
    tokens = [count_tokens_approximately([m]) for m in messages]
    max_messages = options.get("max_messages")
    max_tokens = options.get("max_tokens")
    count_target = options.get("min_messages") or max_messages
    token_target = options.get("target_tokens") or max_tokens

    if not (
        (max_messages is not None and n > max_messages)
        or (max_tokens is not None and sum(tokens) > max_tokens)
    ):
        return head, None, []

    def valid(cut: int) -> bool:
        window = messages[:head] + messages[cut:]
        if options["start_on"] == "human" and msg_kind(messages[cut]) != "human":
            return False
        if options["cascade_tool_messages"]:
            return not window_problems(window, start_on=None)
        return True

    def meets(cut: int, count: int | None, token_bound: int | None) -> bool:
        if count is not None and head + n - cut > count:
            return False
        return token_bound is None or sum(tokens[:head]) + sum(tokens[cut:]) <= token_bound

    cuts = [c for c in range(head + 1, n) if valid(c)]
    meeting = [c for c in cuts if meets(c, count_target, token_target)]
    if meeting:
        return head, min(meeting), cuts
    return head, (max(cuts) if cuts else None), cuts


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(), options=reducer_options())
def test_window_properties(messages, options, window_problems) -> None:
    reducer = MessageReducer(**options)
    kept, pruned = reducer.reduce(messages, ("memories", "t"))
    head, cut, cuts = expected_cut(messages, options, window_problems)
    event("kept whole" if cut is None else "pruned")

    # kept and pruned split the input: the same objects, in order, pruned right after a kept system prompt.
    assert len(kept) + len(pruned) == len(messages)
    assert all(a is b for a, b in zip(kept[:head] + pruned + kept[head:], messages, strict=True))

    # The cut is the oracle's.
    assert len(pruned) == (0 if cut is None else cut - head)

    # The window is API-valid.
    if options["cascade_tool_messages"]:
        assert window_problems(kept, start_on=options["start_on"]) == []
    elif pruned and options["start_on"] == "human":
        assert msg_kind(kept[head]) == "human"

    # A leading system message is never pruned with preserve_first.
    if options["preserve_first"] and msg_kind(messages[0]) == "system":
        assert kept[0] is messages[0]

    # The bounds hold whenever some valid window (or the whole list) meets them.
    tokens = {id(m): count_tokens_approximately([m]) for m in messages}

    def within(window, count, token_bound) -> bool:
        return (count is None or len(window) <= count) and (
            token_bound is None or sum(tokens[id(m)] for m in window) <= token_bound
        )

    max_bounds = (options.get("max_messages"), options.get("max_tokens"))
    targets = (
        options.get("min_messages") or options.get("max_messages"),
        options.get("target_tokens") or options.get("max_tokens"),
    )
    candidates = [messages] + [messages[:head] + messages[c:] for c in cuts]
    if any(within(w, *max_bounds) for w in candidates):
        assert within(kept, *max_bounds)
    if pruned and any(within(messages[:head] + messages[c:], *targets) for c in cuts):
        event("targets met")
        assert within(kept, *targets)
    elif pruned:
        event("targets out of reach: shortest valid window")

    # model_dump() dicts get the same cut.
    dicts = [m.model_dump() for m in messages]
    kept_dicts, pruned_dicts = MessageReducer(**options).reduce(dicts, ("memories", "t"))
    assert ids(kept_dicts) == ids(kept) and ids(pruned_dicts) == ids(pruned)
    assert all(any(k is d for d in dicts) for k in kept_dicts)


# -- hooks and dedupe --------------------------------------------------------------------------------


def test_hooks_get_pruned_messages_and_namespace() -> None:
    calls = []
    reducer = MessageReducer(
        max_messages=4, min_messages=2, on_prune=[lambda m, ns: calls.append((ids(m), ns))]
    )
    reducer.reduce([H("h1"), A("a1"), H("h2"), A("a2"), H("h3")], ("memories", "user-1"))
    assert calls == [(["h1", "a1", "h2", "a2"], ("memories", "user-1"))]


def test_dedupe_delivers_each_message_once_per_namespace() -> None:
    calls = []
    reducer = MessageReducer(max_messages=2, on_prune=[lambda m, ns: calls.append((ids(m), ns))])
    first = [H("h1"), A("a1"), H("h2")]
    reducer.reduce(first, ("ns", "a"))
    reducer.reduce(first + [A("a2")], ("ns", "a"))  # h1, a1 again: nothing new
    reducer.reduce(first, ("ns", "b"))  # another namespace: delivered again
    assert calls == [(["h1", "a1"], ("ns", "a")), (["h1", "a1"], ("ns", "b"))]


def test_dedupe_off_delivers_repeats() -> None:
    calls = []
    reducer = MessageReducer(
        max_messages=2, dedupe_on_prune=False, on_prune=[lambda m, ns: calls.append(ids(m))]
    )
    first = [H("h1"), A("a1"), H("h2")]
    reducer.reduce(first, ("ns",))
    reducer.reduce(first, ("ns",))
    assert calls == [["h1", "a1"], ["h1", "a1"]]


def test_dedupe_keys_messages_without_ids_by_content() -> None:
    calls = []
    reducer = MessageReducer(max_messages=1, on_prune=[lambda m, ns: calls.extend(m)])
    messages = [HumanMessage("hi"), AIMessage("hello"), HumanMessage("again")]
    reducer.reduce(messages, ("ns",))
    reducer.reduce([HumanMessage("hi"), AIMessage("hello"), HumanMessage("again")], ("ns",))
    assert [m.content for m in calls] == ["hi", "hello"]


def test_dedupe_capacity_forgets_the_oldest_keys() -> None:
    calls = []
    reducer = MessageReducer(max_messages=1, dedupe_capacity=2, on_prune=[lambda m, ns: calls.extend(ids(m))])
    reducer.reduce([H("h1"), H("h2"), H("h3"), H("h4")], ("ns",))  # remembers h2, h3 only
    reducer.reduce([H("h1"), H("h2"), H("h3"), H("h4")], ("ns",))
    assert calls == ["h1", "h2", "h3", "h1"]


def test_a_failing_hook_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def broken(messages, namespace):
        raise RuntimeError("memory store down")

    reducer = MessageReducer(max_messages=1, on_prune=[broken, lambda m, ns: calls.append(ids(m))])
    with caplog.at_level(logging.ERROR, logger="reducing_saver.reducer"):
        kept, pruned = reducer.reduce([H("h1"), H("h2")], ("ns",))
    assert ids(kept) == ["h2"] and ids(pruned) == ["h1"]
    assert calls == [["h1"]]
    assert any("memory store down" in (r.exc_text or "") for r in caplog.records)


def test_a_single_hook_callable_is_accepted() -> None:
    calls = []
    reducer = MessageReducer(max_messages=1, on_prune=lambda m, ns: calls.append(ids(m)))
    reducer.reduce([H("h1"), H("h2")], ("ns",))
    assert calls == [["h1"]]


class YieldingLabel(str):
    """A namespace label whose hash gives up the GIL, so threads interleave inside the dedupe bookkeeping.

    Under CPython's GIL a thread is never preempted between a dict lookup and the store after it; a
    free-threaded build has no such luck. Hashing the key yields, which exposes the same races here.
    """

    def __hash__(self) -> int:
        time.sleep(0)
        return str.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)


def test_concurrent_delivery_delivers_each_key_once() -> None:
    """The service calls ``deliver`` from many threads; the dedupe memory must not let a key through twice."""
    delivered: Counter[str] = Counter()
    lock = threading.Lock()

    def hook(messages, namespace):
        with lock:
            delivered.update(ids(messages))

    reducer = MessageReducer(max_messages=1, on_prune=[hook])
    keys = [f"k{i}" for i in range(200)]
    messages = [H(k) for k in keys]
    namespace = (YieldingLabel("ns"),)
    workers = 8
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        barrier.wait()
        try:
            # All threads race over the same messages at once, then again from different places.
            for start in (0, offset * 25):
                order = messages[start:] + messages[:start]
                for i in range(0, len(order), 2):
                    reducer.deliver(order[i : i + 2], namespace)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    assert set(delivered) == set(keys)
    assert {k: n for k, n in delivered.items() if n != 1} == {}


def test_concurrent_delivery_with_eviction_does_not_crash() -> None:
    """Eviction in one thread while another refreshes the same key must not raise."""
    reducer = MessageReducer(max_messages=1, dedupe_capacity=5, on_prune=[lambda m, ns: None])
    messages = [H(f"k{i}") for i in range(12)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)
    namespace = (YieldingLabel("ns"),)

    def work(offset: int) -> None:
        barrier.wait()
        try:
            for round_ in range(300):
                start = (offset + round_) % len(messages)
                reducer.deliver(messages[start : start + 4], namespace)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    assert len(reducer._delivered) <= 5


def test_reducer_copies_and_pickles_with_its_dedupe_memory() -> None:
    reducer = MessageReducer(max_messages=1)
    reducer.reduce([H("h1"), H("h2")], ("ns",))
    for clone in (copy.deepcopy(reducer), pickle.loads(pickle.dumps(reducer))):
        assert clone.config == reducer.config
        assert list(clone._delivered) == list(reducer._delivered) == [(("ns",), "h1")]
        assert clone._delivered_lock is not reducer._delivered_lock
        assert clone.deliver([H("h1"), H("h9")], ("ns",))[0].id == "h9"


# -- config validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"max_messages": None}, ValueError, "max_messages or max_tokens"),
        ({"max_messages": 0}, ValueError, "max_messages must be at least 1"),
        (
            {"max_messages": 4, "min_messages": 5},
            ValueError,
            "min_messages must be between 1 and max_messages",
        ),
        ({"max_messages": 4, "min_messages": 0}, ValueError, "min_messages must be between"),
        (
            {"max_messages": None, "max_tokens": 10, "min_messages": 2},
            ValueError,
            "min_messages needs max_messages",
        ),
        ({"max_tokens": 0}, ValueError, "max_tokens must be at least 1"),
        (
            {"max_tokens": 10, "target_tokens": 11},
            ValueError,
            "target_tokens must be between 1 and max_tokens",
        ),
        ({"target_tokens": 5}, ValueError, "target_tokens needs max_tokens"),
        ({"start_on": "ai"}, ValueError, "start_on must be 'human' or None"),
        ({"dedupe_capacity": 0}, ValueError, "dedupe_capacity must be at least 1"),
        ({"max_messages": True}, TypeError, "max_messages must be an int"),
        ({"max_messages": 6, "min_messages": 2.5}, TypeError, "min_messages must be an int"),
        ({"max_tokens": "100"}, TypeError, "max_tokens must be an int"),
        ({"token_counter": 42}, TypeError, "token_counter must be callable"),
        ({"on_prune": [print, "not a hook"]}, TypeError, "on_prune hooks must be callable"),
    ],
)
def test_config_validation(options: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ReducerConfig(**options)
    with pytest.raises(error, match=match):
        MessageReducer(**options)


def test_config_or_options_not_both() -> None:
    with pytest.raises(TypeError, match="not both"):
        MessageReducer(ReducerConfig(), max_messages=3)


def test_config_defaults() -> None:
    config = ReducerConfig()
    assert (config.max_messages, config.count_target, config.max_tokens, config.token_target) == (
        20,
        20,
        None,
        None,
    )
    assert ReducerConfig(max_tokens=100).token_target == 100
    assert MessageReducer(ReducerConfig(max_messages=6, min_messages=4)).config.count_target == 4


def test_a_message_id_holding_nul_is_keyed_by_its_digest():
    """PostgreSQL's text (the outbox's and the store's keys) cannot hold U+0000; the message keeps its id."""
    from langchain_core.messages import HumanMessage as Human

    from reducing_saver.reducer import message_key

    odd, plain = Human("x", id="a\x00b"), Human("x", id="a\\0b")
    assert "\x00" not in message_key(odd, ("ns",)) and message_key(odd, ("ns",)).startswith("id-sha256:")
    assert message_key(odd, ("ns",)) == message_key(odd.model_dump(), ("other",))  # the id's, namespace aside
    assert message_key(plain, ("ns",)) == "a\\0b" and odd.id == "a\x00b"
