"""Request bodies of the service's per-step routes, as a client would send them."""

from __future__ import annotations

from typing import Any

from langgraph.checkpoint.base import empty_checkpoint


def messages_put_body(
    messages_value: dict[str, Any], thread_id: str = "t1", **configurable: Any
) -> dict[str, Any]:
    """A ``/v1/checkpoints/put`` body (JSON form) writing only the messages channel, version ``"1"``.

    ``messages_value`` is the channel's wire value (``wire.blob_to_wire(*serde.dumps_typed(messages))``).
    """
    checkpoint = empty_checkpoint()
    checkpoint.pop("channel_values")
    checkpoint["channel_versions"] = {"messages": "1"}
    return {
        "config": {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", **configurable}},
        "checkpoint": checkpoint,
        "values": {"messages": messages_value},
        "metadata": {"source": "loop", "step": 1},
        "new_versions": {"messages": "1"},
    }
