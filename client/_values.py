"""Checkpoint values on the wire: which channel values a put sends (those the service's backend stores),
how a channel value or a pending write travels (inline, a big int's own form, or the serde's bytes as a
``Blob``) and how it reads back.

The serde is an argument, not a field: ``BaseCheckpointSaver.with_allowlist`` gives a copy of the saver a
serde of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langgraph.checkpoint.base import ChannelVersions, CheckpointTuple
from langgraph.checkpoint.serde.base import SerializerProtocol

from reducing_saver.wire import Blob, channel_value_from_wire, int_to_wire, ints_from_wire, is_inline
from reducing_saver.wire.bodies import StoredValues


def encode_write(serde: SerializerProtocol, value: Any) -> Any:
    """A pending write's value: the serde's bytes; an int beyond 64 bits has a wire form of its own (the
    serde's msgpack cannot write one)."""
    return int_to_wire(value) or Blob(*serde.dumps_typed(value))


def encode_value(serde: SerializerProtocol, value: Any) -> Any:
    """A channel value: a primitive (``is_inline``) as it is, anything else as a pending write's value."""
    return value if is_inline(value) else encode_write(serde, value)


def decode_value(serde: SerializerProtocol, value: Any, field: str) -> Any:
    # channel_value_from_wire turns the wire form of a big int into the int, without the serde.
    decoded = channel_value_from_wire(value, field)
    return serde.loads_typed((decoded.type, decoded.data)) if isinstance(decoded, Blob) else decoded


def decode_writes(
    serde: SerializerProtocol, writes: Sequence[Sequence[Any]], field: str
) -> list[tuple[str, str, Any]]:
    return [
        (task_id, channel, decode_value(serde, value, f"{field}[{i}]"))
        for i, (task_id, channel, value) in enumerate(writes)
    ]


def decode_tuple(serde: SerializerProtocol, wire: Mapping[str, Any]) -> CheckpointTuple:
    checkpoint = {
        **wire["checkpoint"],
        "channel_values": {
            channel: decode_value(serde, value, f"values.{channel}")
            for channel, value in wire["values"].items()
        },
    }
    return CheckpointTuple(
        config=wire["config"],
        checkpoint=checkpoint,  # type: ignore[arg-type]
        metadata=ints_from_wire(wire["metadata"], "metadata"),
        parent_config=wire.get("parent_config"),
        pending_writes=decode_writes(serde, wire.get("pending_writes") or [], "pending_writes"),
    )


def values_to_send(
    values: dict[str, Any], new_versions: ChannelVersions, stored_values: StoredValues
) -> dict[str, Any]:
    """The channel values of a put the service's backend will store (``stored_values``): only those travel."""
    if stored_values == "all":
        return values
    inline_too = stored_values == "changed_and_inline"
    return {
        channel: value
        for channel, value in values.items()
        if channel in new_versions or (inline_too and _stored_inline(value))
    }


def _stored_inline(value: Any) -> bool:
    """What PostgresSaver keeps inline in every checkpoint row: None, str, int (of any size), float, bool."""
    return is_inline(value) or type(value) is int
