"""Request and response bodies of the HTTP API (they document the wire format in OpenAPI).

Channel and write values are ``WireValue``s: an inline JSON primitive, or ``{"type", "data"}`` with
``data`` the base64 of the client serde's bytes. The service stores them verbatim.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Primitive = StrictStr | StrictInt | StrictFloat | StrictBool | None
Version = StrictStr | StrictInt | StrictFloat


class TypedValue(BaseModel):
    """A value in its serde's form."""

    model_config = ConfigDict(extra="forbid")
    type: StrictStr = Field(description="The serde type, e.g. 'msgpack'.")
    data: StrictStr = Field(description="Base64 of the serde bytes.")


WireValue = Primitive | TypedValue


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunConfig(Strict):
    """The part of a LangGraph run config the service uses."""

    configurable: dict[str, Primitive | list[StrictStr]] = Field(
        default_factory=dict,
        description="thread_id, checkpoint_ns, checkpoint_id, the memory namespace (a list of strings) and "
        "primitive values that are merged into checkpoint metadata.",
    )
    metadata: dict[str, Primitive] = Field(
        default_factory=dict, description="Run metadata merged into checkpoint metadata."
    )


class CheckpointFields(BaseModel):
    """A LangGraph checkpoint without its channel values."""

    model_config = ConfigDict(extra="allow")
    v: StrictInt
    id: StrictStr
    ts: StrictStr
    channel_versions: dict[str, Version]
    versions_seen: dict[str, dict[str, Version]]
    updated_channels: list[StrictStr] | None = None


class GetCheckpointRequest(Strict):
    config: RunConfig


class ListCheckpointsRequest(Strict):
    config: RunConfig | None = Field(None, description="Thread (and namespace) to list; null lists all threads.")
    filter: dict[str, Any] | None = Field(None, description="Metadata containment filter (types kept).")
    before: RunConfig | None = Field(None, description="Only checkpoints older than this checkpoint_id.")
    limit: StrictInt | None = Field(None, ge=0, description="At most this many checkpoints.")


class PutCheckpointRequest(Strict):
    config: RunConfig
    checkpoint: CheckpointFields
    values: dict[str, WireValue] = Field(description="Channel values, by channel name.")
    metadata: dict[str, Any] = Field(default_factory=dict)
    new_versions: dict[str, Version] = Field(description="Channels written by this checkpoint.")


class PutWritesRequest(Strict):
    config: RunConfig
    writes: list[tuple[StrictStr, WireValue]] = Field(description="(channel, value) pairs.")
    task_id: StrictStr
    task_path: StrictStr = ""


class DeleteThreadRequest(Strict):
    thread_id: StrictStr


class CopyThreadRequest(Strict):
    source_thread_id: StrictStr
    target_thread_id: StrictStr


class PruneRequest(Strict):
    thread_ids: list[StrictStr]
    strategy: Literal["keep_latest", "delete"] = "keep_latest"


class DeleteRunsRequest(Strict):
    run_ids: list[StrictStr]


class DeltaHistoryRequest(Strict):
    config: RunConfig
    channels: list[StrictStr]


class CheckpointConfig(BaseModel):
    configurable: dict[str, Any]


class CheckpointTupleOut(BaseModel):
    config: CheckpointConfig
    checkpoint: dict[str, Any] = Field(description="The checkpoint without channel_values.")
    values: dict[str, WireValue]
    metadata: dict[str, Any]
    parent_config: CheckpointConfig | None
    pending_writes: list[tuple[str, str, WireValue]] = Field(description="(task_id, channel, value) triples.")


class GetCheckpointResponse(BaseModel):
    checkpoint: CheckpointTupleOut | None = Field(description="null when there is no such checkpoint.")


class ListCheckpointsResponse(BaseModel):
    checkpoints: list[CheckpointTupleOut]


class PutCheckpointResponse(BaseModel):
    config: CheckpointConfig


class DeltaChannelHistoryOut(BaseModel):
    writes: list[tuple[str, str, WireValue]]
    seed: WireValue = Field(None, description="Absent when the walk found no stored value.")


class DeltaHistoryResponse(BaseModel):
    channels: dict[str, DeltaChannelHistoryOut]


class ReducerOut(BaseModel):
    max_messages: int | None
    min_messages: int | None
    max_tokens: int | None
    target_tokens: int | None
    preserve_first: bool
    cascade_tool_messages: bool
    start_on: Literal["human"] | None
    namespace_key: str


class CapabilitiesResponse(BaseModel):
    capabilities: list[str] = Field(description="Optional saver capabilities the backend has.")
    backend: Literal["postgres", "sqlite", "memory"]
    messages_key: str
    reducer: ReducerOut
    version: str


class ErrorResponse(BaseModel):
    detail: str | list[dict[str, Any]]


class ExtractionStatus(BaseModel):
    pending: int = Field(description="Pruned messages waiting for delivery (including those waiting for a retry).")
    in_flight: int = Field(description="Claimed by a deliverer right now.")
    delivered: int
    dead: int = Field(description="Dead letters: failed max_attempts times; kept until re-driven.")
    oldest_pending_age_seconds: float | None = Field(description="null when nothing is pending.")


class DeadLetter(BaseModel):
    namespace: list[str]
    key: str
    thread_id: str
    attempts: int
    last_error: str | None
    pruned_at: str


class DeadLettersResponse(BaseModel):
    dead_letters: list[DeadLetter]


class RetryDeadResponse(BaseModel):
    requeued: int
