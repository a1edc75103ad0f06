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
            assert index == last_ai and all(
                _get(m, "type") == "tool" for m in body[index + 1 :]
            ), f"tool call {call_id} lost its results"
