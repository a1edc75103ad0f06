"""Request and response bodies of the HTTP API (they document the wire format in OpenAPI).

Channel and write values are ``WireValue``s: an inline JSON primitive, or ``{"type", "data"}`` with
``data`` the client serde's bytes (base64 in JSON; a bin in the msgpack bodies the per-step routes also
take). The service stores them verbatim; an integer beyond 64 bits travels as the typed value
``reducing-saver/int`` (see ``reducing_saver.wire``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictBytes,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)
from pydantic_core import PydanticCustomError

from reducing_saver.service import security
from reducing_saver.service.security.limits import _limits
from reducing_saver.wire import bodies

Primitive = StrictStr | StrictInt | StrictFloat | StrictBool | None
Version = StrictStr | StrictInt | StrictFloat


class TypedValue(BaseModel):
    """A value in its serde's form."""

    model_config = ConfigDict(extra="forbid")
    type: StrictStr = Field(
        description="The serde type, e.g. 'msgpack'. 'reducing-saver/int' carries an integer beyond 64 bits "
        "(its data: the decimal digits, ASCII, with an optional '-'); other types starting with "
        "'reducing-saver/' are the service's own and refused."
    )
    data: StrictStr | StrictBytes = Field(
        description="The serde bytes: base64 text in a JSON body, a bin in an application/msgpack body."
    )


WireValue = Primitive | TypedValue


# -- caps (service/security/limits.py): the numbers are settings, read per request; the OpenAPI document shows them


def _refusing(check: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
    """A validator running ``check(value, *args)``; its ValueError becomes a pydantic error (a 422)."""

    def run(value: Any) -> Any:
        try:
            return check(value, *args)
        except ValueError as exc:
            raise PydanticCustomError("refused", "{reason}", {"reason": str(exc)}) from None

    return run


def _capped(field: str, what: str, setting: str) -> Any:
    """Annotated metadata: at most ``setting`` items, checked before the items are validated."""
    keyword = "maxItems" if what != "channels" else "maxProperties"
    limits = _limits  # the request's caps (``security.current_limits``), read without a call of its own

    def check(value: Any) -> Any:
        # Runs on every per-step request, several times: the common case (within the cap) in one frame.
        if isinstance(value, (list, dict)) and len(value) > getattr(limits.get(), setting):
            return _refusing(security.check_count, field, what, setting)(value)  # raises, naming the cap
        return value

    return (
        BeforeValidator(check),
        Field(json_schema_extra=security.documented(**{keyword: setting})),
    )


ThreadId = Annotated[
    StrictStr,
    Field(
        min_length=1,
        pattern=security.THREAD_ID_SCHEMA_PATTERN,
        json_schema_extra=security.documented(maxLength="max_thread_id_length"),
        description="A thread id: no control characters, NUL, '/' or '\\', not '.' or '..', at most "
        "max_thread_id_length characters.",
    ),
    AfterValidator(_refusing(security.check_thread_id)),
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunConfig(Strict):
    """The part of a LangGraph run config the service uses."""

    configurable: dict[str, Primitive | list[StrictStr] | TypedValue] = Field(
        default_factory=dict,
        description="thread_id, checkpoint_ns, checkpoint_id, the memory namespace (a list of strings) and "
        "primitive values that are merged into checkpoint metadata; an integer beyond 64 bits as a typed "
        "value of type 'reducing-saver/int'.",
    )
    metadata: dict[str, Primitive | TypedValue] = Field(
        default_factory=dict,
        description="Run metadata merged into checkpoint metadata; an integer beyond 64 bits as a typed value "
        "of type 'reducing-saver/int'.",
    )

    @field_validator("configurable")
    @classmethod
    def _check_ids(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _refusing(security.check_configurable)(value)


class CheckpointFields(BaseModel):
    """A LangGraph checkpoint without its channel values."""

    model_config = ConfigDict(extra="allow")
    v: StrictInt
    id: StrictStr = Field(pattern=security.UUID_SCHEMA_PATTERN, description="A UUID (LangGraph's uuid6).")
    ts: StrictStr
    channel_versions: Annotated[dict[str, Version], *_capped("checkpoint.channel_versions", "channels", "max_channels")]
    versions_seen: Annotated[
        dict[str, Annotated[dict[str, Version], *_capped("checkpoint.versions_seen[node]", "channels", "max_channels")]],
        *_capped("checkpoint.versions_seen", "channels", "max_channels"),
    ]
    updated_channels: list[StrictStr] | None = None


class GetCheckpointRequest(Strict):
    config: RunConfig


class ListCheckpointsRequest(Strict):
    config: RunConfig | None = Field(
        None,
        description="Thread to list; with checkpoint_ns only that namespace, without it every namespace "
        "(subgraphs included, as the stock savers do); null lists all threads.",
    )
    filter: Annotated[
        dict[str, Any] | None, AfterValidator(_refusing(security.check_filter_keys, "filter"))
    ] = Field(
        None,
        description="Metadata containment filter (types kept). Keys: 1 to 256 ASCII letters, digits, "
        "'_', '.' and '-', on every backend.",
    )
    before: RunConfig | None = Field(
        None,
        description="Only checkpoints older than this checkpoint_id. Across threads (config null), a before "
        "naming a thread too (the last checkpoint of the previous page) is a cursor: the list goes on right "
        "after it, newest id first, then thread id and namespace descending, so copies sharing an id are "
        "never skipped.",
    )
    limit: (
        Annotated[
            StrictInt,
            Field(ge=0, json_schema_extra=security.documented(maximum="max_list_limit")),
            AfterValidator(_refusing(security.check_limit)),
        ]
        | None
    ) = Field(
        None,
        description="At most this many checkpoints (at most max_list_limit); null means max_list_limit. "
        "More pages: the next request's before is the last checkpoint's config.",
    )


class PutCheckpointRequest(Strict):
    config: RunConfig
    checkpoint: CheckpointFields
    values: Annotated[dict[str, WireValue], *_capped("values", "channels", "max_channels")] = Field(
        description="Channel values, by channel name."
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    new_versions: Annotated[dict[str, Version], *_capped("new_versions", "channels", "max_channels")] = Field(
        description="Channels written by this checkpoint."
    )


class PutWritesRequest(Strict):
    config: RunConfig
    writes: Annotated[
        list[tuple[StrictStr, WireValue]], *_capped("writes", "writes", "max_writes_per_call")
    ] = Field(description="(channel, value) pairs.")
    task_id: StrictStr
    task_path: StrictStr = ""


class DeleteThreadRequest(Strict):
    thread_id: ThreadId


class CopyThreadRequest(Strict):
    source_thread_id: ThreadId
    target_thread_id: ThreadId


class PruneRequest(Strict):
    thread_ids: Annotated[list[ThreadId], *_capped("thread_ids", "thread ids", "max_ids_per_call")]
    strategy: Literal["keep_latest", "delete"] = "keep_latest"


class DeleteRunsRequest(Strict):
    run_ids: Annotated[list[StrictStr], *_capped("run_ids", "run ids", "max_ids_per_call")]


class DeltaHistoryRequest(Strict):
    config: RunConfig
    channels: Annotated[list[StrictStr], *_capped("channels", "channel names", "max_channels")]


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


class LimitsOut(BaseModel):
    max_list_limit: int = Field(
        description="The most checkpoints one checkpoints/list answer holds (its limit's maximum and "
        "default)."
    )


class CapabilitiesResponse(BaseModel):
    capabilities: list[str] = Field(description="Optional saver capabilities the backend has.")
    backend: Literal["postgres", "sqlite", "memory"]
    messages_key: str
    reducer: ReducerOut
    version: str
    body_formats: list[str] = Field(
        description="Content types of the per-step routes' bodies (checkpoints/get, checkpoints/put, "
        "writes/put); their answers come in the request's type."
    )
    limits: LimitsOut
    stored_values: Literal["all", "changed", "changed_and_inline"] = Field(
        description="Which channel values the backend stores, so which ones a put must carry: all (every "
        "channel's value in every checkpoint: sqlite), changed (only the channels in new_versions: memory), "
        "changed_and_inline (those, plus primitive values, kept inline in every checkpoint row: postgres)."
    )


class ErrorResponse(BaseModel):
    detail: str | list[dict[str, Any]]
    code: str | None = Field(
        None,
        description="Present where a client acts on the kind of error: database_timeout on a 504 (the database "
        "cancelled a statement that ran past its statement_timeout or lock_timeout; not retried blindly).",
    )


class SummaryStatus(BaseModel):
    pending_steps: int = Field(description="Batches of cut messages awaiting a summary.")
    messages_awaiting_summary: int = Field(description="Messages in those batches (still in their windows).")
    done_steps: int
    dead_steps: int = Field(description="Batches whose summary failed every attempt; retry-dead re-runs them.")
    oldest_pending_age_seconds: float | None = Field(description="null when nothing is pending.")


class ExtractionStatus(BaseModel):
    pending: int = Field(description="Pruned messages waiting for delivery (including those waiting for a retry).")
    in_flight: int = Field(description="Claimed by a deliverer right now.")
    delivered: int
    dead: int = Field(description="Dead letters: failed max_attempts times; kept until re-driven.")
    oldest_pending_age_seconds: float | None = Field(description="null when nothing is pending.")
    retention_seconds: float = Field(
        description="How long delivered rows are kept before a TTL sweep deletes them (outbox_retention)."
    )
    purging: bool = Field(description="This process's background sweeper runs, and purges them each sweep.")
    purged_by_this_process: int = Field(
        description="Delivered rows this process's sweeps deleted since it started."
    )
    summaries: SummaryStatus | None = Field(
        None, description="Running summaries (with --summarizer only): the tenant's own threads in tenant mode."
    )


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
    summary_steps_requeued: int | None = Field(
        None, description="Summary batches sent back to the summarizer (with --summarizer only)."
    )


class DeadSummaryStep(BaseModel):
    thread_id: str
    checkpoint_ns: str
    step_id: str = Field(description="The batch's step (``additional_kwargs.reducing_saver_summary.step``).")
    messages: int = Field(description="Messages in the batch.")
    attempts: int
    last_error: str | None = Field(description="What the summarizer's last attempt raised.")


class DeadSummaryStepsResponse(BaseModel):
    dead_steps: list[DeadSummaryStep] = Field(description="Oldest first.")


class SummaryRetryDeadResponse(BaseModel):
    requeued: int = Field(description="Summary batches sent back to the summarizer.")


# -- storage you can see (service/storage/usage.py; docs/storage.md) -------------------------------

#: The most threads a storage summary lists.
MAX_STORAGE_TOP = 100


class ChannelUse(BaseModel):
    """What the service does with one channel of a thread."""

    kind: Literal["windowed", "whole", "delta"] = Field(
        description="windowed: the messages channel, each stored checkpoint keeping a window of it; whole: "
        "the messages channel, stored whole (no window is configured); delta: a DeltaChannel, rebuilt "
        "from its writes, stored as written."
    )
    service: str = Field(description="What the service does for it, in a sentence.")


class ThreadStorageResponse(BaseModel):
    """What one thread holds now, and what a plain ``add_messages`` saver would hold."""

    thread_id: str = Field(description="The thread id, as the agent names it.")
    tenant: str = Field(description="The thread's tenant ('' without API keys).")
    checkpoints: int = Field(description="Checkpoints kept, every namespace.")
    checkpoint_bytes: int = Field(description="Checkpoint rows (SQLite: the whole state, messages included).")
    blob_bytes: int = Field(description="Channel value rows (PostgreSQL, memory; 0 on SQLite).")
    write_bytes: int = Field(description="Pending write rows.")
    outbox_bytes: int = Field(description="Outbox rows of the messages cut from the thread.")
    store_bytes: int = Field(description="Store items made of those messages (their value names the thread).")
    messages_bytes: int = Field(
        description="The part of checkpoint and blob bytes that is the messages channel."
    )
    cut_messages: int = Field(description="Messages cut from the thread (its outbox rows or store items).")
    plain_estimate: int = Field(
        description="Bytes a plain add_messages saver would hold in the checkpoint tables."
    )
    saver_bytes: int = Field(description="checkpoint_bytes + blob_bytes + write_bytes.")
    total_bytes: int = Field(description="saver_bytes + outbox_bytes + store_bytes.")
    saved_ratio: float | None = Field(description="plain_estimate / total_bytes; null for an empty thread.")
    delta_channels: list[str] = Field(
        description="The thread's DeltaChannels (deepagents' messages and files are): the channels its "
        "checkpoints count steps for since their last snapshot."
    )
    channels: dict[str, ChannelUse] = Field(
        description="The messages channel and every DeltaChannel, with what the service does for each."
    )


class StorageSummaryResponse(BaseModel):
    """The caller's threads added up (with API keys: the tenant's; without: every thread), and the largest."""

    threads: int = Field(description="Threads with checkpoints.")
    checkpoints: int
    checkpoint_bytes: int
    blob_bytes: int
    write_bytes: int
    outbox_bytes: int
    store_bytes: int
    saver_bytes: int
    total_bytes: int
    plain_estimate: int
    saved_ratio: float | None = Field(description="plain_estimate / total_bytes; null without threads.")
    largest: list[ThreadStorageResponse] = Field(
        description="The largest threads by total_bytes, at most `top`."
    )


# -- the store's routes (routes/store.py): LangGraph Agent Server's bodies, and the batch route's ---------

Labels = list[str]


class _StoreBody(BaseModel):
    # Strict: `false` is no offset and `0` no boolean (as the OpenAPI document says).
    model_config = ConfigDict(extra="forbid", strict=True)


class PutItemRequest(_StoreBody):
    namespace: Labels
    key: str
    value: dict[str, Any]
    index: Literal[False] | list[str] | None = None
    ttl: float | None = Field(None, description="Minutes; null: the store's default TTL (if any).")


class DeleteItemRequest(_StoreBody):
    namespace: Labels
    key: str


class SearchItemsRequest(_StoreBody):
    namespace_prefix: Labels = []
    filter: dict[str, Any] | None = None
    limit: int = 10
    offset: int = 0
    query: str | None = None
    refresh_ttl: bool | None = None


class ListNamespacesRequest(_StoreBody):
    prefix: Labels | None = None
    suffix: Labels | None = None
    max_depth: int | None = None
    limit: int = 100
    offset: int = 0


class StoreItem(BaseModel):
    namespace: Labels
    key: str
    value: dict[str, Any]
    created_at: str
    updated_at: str
    score: float | None = None


class SearchItemsResponse(BaseModel):
    items: list[StoreItem]


class ListNamespacesResponse(BaseModel):
    namespaces: list[Labels]


class GetOpBody(_StoreBody):
    op: Literal["get"]
    namespace: Labels
    key: str
    refresh_ttl: bool | None = Field(None, description="null: the store's refresh_on_read.")


class PutOpBody(_StoreBody):
    op: Literal["put"]
    namespace: Labels
    key: str
    value: dict[str, Any] | None = Field(..., description="null deletes the item.")
    index: Literal[False] | list[str] | None = None
    ttl: float | None = None


class SearchOpBody(_StoreBody):
    op: Literal["search"]
    namespace_prefix: Labels = []
    filter: dict[str, Any] | None = None
    limit: int = 10
    offset: int = 0
    query: str | None = None
    refresh_ttl: bool | None = Field(None, description="null: the store's refresh_on_read.")


class MatchConditionBody(_StoreBody):
    match_type: Literal["prefix", "suffix"]
    path: Labels


class ListNamespacesOpBody(_StoreBody):
    op: Literal["list_namespaces"]
    match_conditions: list[MatchConditionBody] | None = None
    max_depth: int | None = None
    limit: int = 100
    offset: int = 0


class BatchRequest(_StoreBody):
    ops: list[
        Annotated[GetOpBody | PutOpBody | SearchOpBody | ListNamespacesOpBody, Field(discriminator="op")]
    ]


class BatchResponse(BaseModel):
    results: list[Any] = Field(
        description="Per operation: an item or null (get), null (put), items (search), namespaces."
    )


#: The wire's body each store model validates or writes: the same fields (``tests/test_layout.py`` checks).
STORE_WIRE_BODIES: dict[type[BaseModel], type] = {
    PutItemRequest: bodies.PutItemBody,
    DeleteItemRequest: bodies.DeleteItemBody,
    SearchItemsRequest: bodies.SearchItemsBody,
    ListNamespacesRequest: bodies.ListNamespacesBody,
    StoreItem: bodies.StoreItemBody,
    SearchItemsResponse: bodies.SearchItemsAnswer,
    ListNamespacesResponse: bodies.ListNamespacesAnswer,
    GetOpBody: bodies.GetOpBody,
    PutOpBody: bodies.PutOpBody,
    SearchOpBody: bodies.SearchOpBody,
    MatchConditionBody: bodies.MatchConditionBody,
    ListNamespacesOpBody: bodies.ListNamespacesOpBody,
    BatchRequest: bodies.StoreBatchBody,
    BatchResponse: bodies.StoreBatchAnswer,
}

#: The wire's body each model validates or writes: the same fields (``tests/test_layout.py`` checks).
WIRE_BODIES: dict[type[BaseModel], type] = {
    RunConfig: bodies.RunConfigBody,
    GetCheckpointRequest: bodies.GetCheckpointBody,
    ListCheckpointsRequest: bodies.ListCheckpointsBody,
    PutCheckpointRequest: bodies.PutCheckpointBody,
    PutWritesRequest: bodies.PutWritesBody,
    DeleteThreadRequest: bodies.DeleteThreadBody,
    CopyThreadRequest: bodies.CopyThreadBody,
    PruneRequest: bodies.PruneBody,
    DeleteRunsRequest: bodies.DeleteRunsBody,
    DeltaHistoryRequest: bodies.DeltaHistoryBody,
    CheckpointConfig: bodies.CheckpointConfigBody,
    CheckpointTupleOut: bodies.CheckpointTupleBody,
    GetCheckpointResponse: bodies.GetCheckpointAnswer,
    ListCheckpointsResponse: bodies.ListCheckpointsAnswer,
    PutCheckpointResponse: bodies.PutCheckpointAnswer,
    DeltaChannelHistoryOut: bodies.DeltaChannelHistoryBody,
    DeltaHistoryResponse: bodies.DeltaHistoryAnswer,
    ReducerOut: bodies.ReducerBody,
    LimitsOut: bodies.LimitsBody,
    CapabilitiesResponse: bodies.CapabilitiesAnswer,
    ErrorResponse: bodies.ErrorBody,
    **STORE_WIRE_BODIES,
}
