"""What a chat-model API accepts as a message window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _get(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def assert_valid_window(messages: Sequence[Any], *, start_on_human: bool = True) -> None:
    """No tool result without its call, no call (but the newest) without its results, human first."""
    body = list(messages)
    if body and _get(body[0], "type") == "system":
        body = body[1:]
    if start_on_human and body:
        assert _get(body[0], "type") == "human", f"window starts with {_get(body[0], 'type')}"
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for index, message in enumerate(body):
        for call in _get(message, "tool_calls") or ():
            calls[call["id"]] = index
        if _get(message, "type") == "tool":
            call_id = _get(message, "tool_call_id")
            assert call_id in calls, f"tool result {call_id} without its call"
            answered.add(call_id)
    last_ai = max((i for i, m in enumerate(body) if _get(m, "tool_calls")), default=None)
    for call_id, index in calls.items():
        if call_id not in answered:
            assert index == last_ai and all(_get(m, "type") == "tool" for m in body[index + 1 :]), (
                f"tool call {call_id} lost its results"
            )


# -- a chat-API validity check shared by the reducer, saver and storage tests -----------------------

_CHUNK_KINDS = {
    "AIMessageChunk": "ai",
    "HumanMessageChunk": "human",
    "SystemMessageChunk": "system",
    "ToolMessageChunk": "tool",
}


def msg_kind(message) -> str:
    """``"system"``, ``"human"``, ``"ai"``, ``"tool"``, ... for message objects and ``model_dump()`` dicts."""
    kind = _get(message, "type") or ""
    return _CHUNK_KINDS.get(kind, kind)


def api_window_problems(window, *, start_on="human") -> list[str]:
    """Why ``window`` is not a message list a chat-model API accepts; empty when it is one.

    Written independently of the reducer, from the rules an API enforces:

    * with ``start_on="human"`` the first message after an optional leading system message is human;
    * every tool message answers a tool call of an earlier AI message in the window;
    * every tool call of an AI message is answered by a later tool message, except the calls of the
      newest message when it is an AI message whose tools have not run yet.
    """
    problems: list[str] = []
    head = 1 if window and msg_kind(window[0]) == "system" else 0
    if start_on == "human" and len(window) > head and msg_kind(window[head]) != "human":
        problems.append(
            f"window starts on {msg_kind(window[head])!r} at index {head}, not on a human message"
        )
    open_calls: dict[str, int] = {}
    answered: set[str] = set()
    for index, message in enumerate(window):
        kind = msg_kind(message)
        if kind == "ai":
            for call in _get(message, "tool_calls") or ():
                open_calls[call["id"]] = index
        elif kind == "tool":
            call_id = _get(message, "tool_call_id")
            if call_id not in open_calls:
                problems.append(
                    f"tool message at index {index} answers {call_id!r}, a call not in the window"
                )
            answered.add(call_id)
    last = len(window) - 1
    for call_id, index in open_calls.items():
        if call_id not in answered and index != last:
            problems.append(f"tool call {call_id!r} of the AI message at index {index} has no result")
    return problems
