"""The request and answer bodies of the protocol, as TypedDicts both sides import (no dependency beyond typing).

The client builds its requests with them; the service's request and answer models (``service/http/schemas.py``,
which also carry the checks and the OpenAPI document) have exactly these fields, and ``tests/test_layout.py``
checks both. A value typed ``Any`` below travels in the wire's value forms (``wire/__init__.py``).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict


class RunConfigBody(TypedDict, total=False):
    """The part of a run config the service uses (``config_to_wire``)."""

    configurable: dict[str, Any]
    metadata: dict[str, Any]


# -- the saver's routes -----------------------------------------------------------------------------


class GetCheckpointBody(TypedDict):
    config: RunConfigBody | None


class ListCheckpointsBody(TypedDict):
    config: RunConfigBody | None
    filter: dict[str, Any] | None
    before: RunConfigBody | None
    limit: int | None


class PutCheckpointBody(TypedDict):
    config: RunConfigBody | None
    #: The checkpoint without ``channel_values`` (``checkpoint_fields``).
    checkpoint: dict[str, Any]
    #: The channel values, each in its wire form.
    values: dict[str, Any]
    metadata: Any
    new_versions: dict[str, Any]


class PutWritesBody(TypedDict):
    config: RunConfigBody | None
    #: ``[channel, value]`` pairs, values in their wire form.
    writes: list[list[Any]]
    task_id: str
    task_path: str


class DeleteThreadBody(TypedDict):
    thread_id: str


class CopyThreadBody(TypedDict):
    source_thread_id: str
    target_thread_id: str


class PruneBody(TypedDict):
    thread_ids: list[str]
    strategy: str


class DeleteRunsBody(TypedDict):
    run_ids: list[str]


class DeltaHistoryBody(TypedDict):
    config: RunConfigBody | None
    channels: list[str]


class CheckpointConfigBody(TypedDict):
    configurable: dict[str, Any]


class CheckpointTupleBody(TypedDict):
    config: CheckpointConfigBody
    checkpoint: dict[str, Any]
    values: dict[str, Any]
    metadata: dict[str, Any]
    parent_config: CheckpointConfigBody | None
    #: ``(task_id, channel, value)`` triples.
    pending_writes: list[Any]


class GetCheckpointAnswer(TypedDict):
    checkpoint: CheckpointTupleBody | None


class ListCheckpointsAnswer(TypedDict):
    checkpoints: list[CheckpointTupleBody]


class PutCheckpointAnswer(TypedDict):
    config: CheckpointConfigBody


class DeltaChannelHistoryBody(TypedDict):
    writes: list[Any]
    seed: NotRequired[Any]


class DeltaHistoryAnswer(TypedDict):
    channels: dict[str, DeltaChannelHistoryBody]


class ReducerBody(TypedDict):
    max_messages: int | None
    min_messages: int | None
    max_tokens: int | None
    target_tokens: int | None
    preserve_first: bool
    cascade_tool_messages: bool
    start_on: str | None
    namespace_key: str


class LimitsBody(TypedDict):
    max_list_limit: int


#: Which channel values a backend's ``put`` stores, so which ones a client must send: ``"all"`` (every channel's
#: value, in every checkpoint: SQLite), ``"changed"`` (only the channels in ``new_versions``: memory),
#: ``"changed_and_inline"`` (those, and primitive values, kept inline in every checkpoint row: PostgreSQL).
StoredValues = Literal["all", "changed", "changed_and_inline"]


class CapabilitiesAnswer(TypedDict):
    #: Names among ``capabilities.OPTIONAL_CAPABILITIES``.
    capabilities: list[str]
    backend: Literal["postgres", "sqlite", "memory"]
    messages_key: str
    reducer: ReducerBody
    version: str
    body_formats: list[str]
    limits: LimitsBody
    #: Absent from a service older than it: the client then goes by ``backend``.
    stored_values: NotRequired[StoredValues]


class ErrorBody(TypedDict):
    """Every error answer: FastAPI's ``detail``, a sentence or a list of pydantic errors; ``code`` where a
    client acts on the kind of error rather than its status (``wire.ERROR_CODES``)."""

    detail: str | list[dict[str, Any]]
    code: NotRequired[str]


# -- the store's batch route ------------------------------------------------------------------------


class GetOpBody(TypedDict):
    op: Literal["get"]
    namespace: list[str]
    key: str
    refresh_ttl: bool | None


class PutOpBody(TypedDict):
    op: Literal["put"]
    namespace: list[str]
    key: str
    value: dict[str, Any] | None
    index: NotRequired[Literal[False] | list[str]]
    ttl: NotRequired[float]


class SearchOpBody(TypedDict):
    op: Literal["search"]
    namespace_prefix: list[str]
    filter: dict[str, Any] | None
    limit: int
    offset: int
    query: str | None
    refresh_ttl: bool | None


class MatchConditionBody(TypedDict):
    match_type: str
    path: list[str]


class ListNamespacesOpBody(TypedDict):
    op: Literal["list_namespaces"]
    match_conditions: list[MatchConditionBody]
    max_depth: int | None
    limit: int
    offset: int


class StoreBatchBody(TypedDict):
    ops: list[GetOpBody | PutOpBody | SearchOpBody | ListNamespacesOpBody]


class StoreBatchAnswer(TypedDict):
    #: One result an operation, in order.
    results: list[Any]


# -- LangGraph Agent Server's store routes (what langgraph_sdk's store client sends) ------------------


class PutItemBody(TypedDict):
    namespace: list[str]
    key: str
    value: dict[str, Any]
    index: NotRequired[Literal[False] | list[str] | None]
    ttl: NotRequired[float | None]


class DeleteItemBody(TypedDict):
    namespace: list[str]
    key: str


class SearchItemsBody(TypedDict, total=False):
    namespace_prefix: list[str]
    filter: dict[str, Any] | None
    limit: int
    offset: int
    query: str | None
    refresh_ttl: bool | None


class ListNamespacesBody(TypedDict, total=False):
    prefix: list[str] | None
    suffix: list[str] | None
    max_depth: int | None
    limit: int
    offset: int


class StoreItemBody(TypedDict):
    namespace: list[str]
    key: str
    value: dict[str, Any]
    created_at: str
    updated_at: str
    score: NotRequired[float | None]


class SearchItemsAnswer(TypedDict):
    items: list[StoreItemBody]


class ListNamespacesAnswer(TypedDict):
    namespaces: list[list[str]]


#: Every body above, by name (the layout test reads them).
BODIES: tuple[type, ...] = (
    RunConfigBody,
    GetCheckpointBody,
    ListCheckpointsBody,
    PutCheckpointBody,
    PutWritesBody,
    DeleteThreadBody,
    CopyThreadBody,
    PruneBody,
    DeleteRunsBody,
    DeltaHistoryBody,
    CheckpointConfigBody,
    CheckpointTupleBody,
    GetCheckpointAnswer,
    ListCheckpointsAnswer,
    PutCheckpointAnswer,
    DeltaChannelHistoryBody,
    DeltaHistoryAnswer,
    ReducerBody,
    LimitsBody,
    CapabilitiesAnswer,
    ErrorBody,
    GetOpBody,
    PutOpBody,
    SearchOpBody,
    MatchConditionBody,
    ListNamespacesOpBody,
    StoreBatchBody,
    StoreBatchAnswer,
    PutItemBody,
    DeleteItemBody,
    SearchItemsBody,
    ListNamespacesBody,
    StoreItemBody,
    SearchItemsAnswer,
    ListNamespacesAnswer,
)
