"""The request and answer bodies of the protocol, as TypedDicts both sides import (standard library only).

The client builds its requests with them; the service validates requests against them and documents them
in OpenAPI (``service/http/schemas.py`` adds its checks, caps and defaults to these fields, and reads the
docstrings under the fields as their descriptions). A field the service may be sent without is
``NotRequired``; the client sends every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired, TypedDict


@dataclass(frozen=True)
class Term:
    """``Annotated`` metadata naming a term of the protocol with rules of its own (``ThreadId``): type
    checkers and the client see the plain type, the service attaches its checks to the name."""

    name: str


#: A thread id: no control characters, NUL, '/' or '\\', not '.' or '..', at most max_thread_id_length
#: characters (the service's check).
ThreadId = Annotated[str, Term("thread_id")]
#: A JSON primitive: a value that travels inline.
Primitive = str | int | float | bool | None
#: A channel version: LangGraph's savers write strings, other savers ints or floats.
Version = str | int | float


class TypedValueBody(TypedDict):
    """A value in its serde's form."""

    type: str
    """The serde type, e.g. 'msgpack'. 'reducing-saver/int' carries an integer beyond 64 bits (its data: the
    decimal digits, ASCII, with an optional '-'); other types starting with 'reducing-saver/' are the
    service's own and refused."""
    data: str | bytes
    """The serde bytes: base64 text in a JSON body, a bin in an application/msgpack body."""


#: A channel or write value as it travels (``wire/__init__.py``): inline, or in its serde's form.
WireValue = Primitive | TypedValueBody


#: What ``config_to_wire`` makes of a run config.
class RunConfigBody(TypedDict, total=False):
    """The part of a LangGraph run config the service uses."""

    configurable: dict[str, Primitive | list[str] | TypedValueBody]
    """thread_id, checkpoint_ns, checkpoint_id, the memory namespace (a list of strings) and primitive
    values that are merged into checkpoint metadata; an integer beyond 64 bits as a typed value of type
    'reducing-saver/int'."""
    metadata: dict[str, Primitive | TypedValueBody]
    """Run metadata merged into checkpoint metadata; an integer beyond 64 bits as a typed value of type
    'reducing-saver/int'."""


# -- the saver's routes -----------------------------------------------------------------------------


class GetCheckpointBody(TypedDict):
    config: RunConfigBody


class ListCheckpointsBody(TypedDict):
    config: NotRequired[RunConfigBody | None]
    """Thread to list; with checkpoint_ns only that namespace, without it every namespace (subgraphs
    included, as the stock savers do); null lists all threads."""
    filter: NotRequired[dict[str, Any] | None]
    """Metadata containment filter (types kept). Keys: 1 to 256 ASCII letters, digits, '_', '.' and '-', on
    every backend."""
    before: NotRequired[RunConfigBody | None]
    """Only checkpoints older than this checkpoint_id. Across threads (config null), a before naming a
    thread too (the last checkpoint of the previous page) is a cursor: the list goes on right after it,
    newest id first, then thread id and namespace descending, so copies sharing an id are never skipped."""
    limit: NotRequired[int | None]
    """At most this many checkpoints (at most max_list_limit); null means max_list_limit. More pages: the
    next request's before is the last checkpoint's config."""


#: What ``checkpoint_fields`` makes of a checkpoint; any other key travels as it is.
class CheckpointFieldsBody(TypedDict):
    """A LangGraph checkpoint without its channel values."""

    v: int
    id: str
    """A UUID (LangGraph's uuid6)."""
    ts: str
    channel_versions: dict[str, Version]
    versions_seen: dict[str, dict[str, Version]]
    updated_channels: NotRequired[list[str] | None]


class PutCheckpointBody(TypedDict):
    config: RunConfigBody
    checkpoint: CheckpointFieldsBody
    values: dict[str, WireValue]
    """Channel values, by channel name."""
    metadata: NotRequired[dict[str, Any]]
    new_versions: dict[str, Version]
    """Channels written by this checkpoint."""


class PutWritesBody(TypedDict):
    config: RunConfigBody
    writes: list[tuple[str, WireValue]]
    """(channel, value) pairs."""
    task_id: str
    task_path: NotRequired[str]


class DeleteThreadBody(TypedDict):
    thread_id: ThreadId


class CopyThreadBody(TypedDict):
    source_thread_id: ThreadId
    target_thread_id: ThreadId


PruneStrategy = Literal["keep_latest", "delete"]


class PruneBody(TypedDict):
    thread_ids: list[ThreadId]
    strategy: NotRequired[PruneStrategy]


class DeleteRunsBody(TypedDict):
    run_ids: list[str]


class DeltaHistoryBody(TypedDict):
    config: RunConfigBody
    channels: list[str]


class CheckpointConfigBody(TypedDict):
    configurable: dict[str, Any]


class CheckpointTupleBody(TypedDict):
    config: CheckpointConfigBody
    checkpoint: dict[str, Any]
    """The checkpoint without channel_values."""
    values: dict[str, WireValue]
    metadata: dict[str, Any]
    parent_config: CheckpointConfigBody | None
    pending_writes: list[tuple[str, str, WireValue]]
    """(task_id, channel, value) triples."""


class GetCheckpointAnswer(TypedDict):
    checkpoint: CheckpointTupleBody | None
    """null when there is no such checkpoint."""


class ListCheckpointsAnswer(TypedDict):
    checkpoints: list[CheckpointTupleBody]


class PutCheckpointAnswer(TypedDict):
    config: CheckpointConfigBody


class DeltaChannelHistoryBody(TypedDict):
    writes: list[tuple[str, str, WireValue]]
    seed: NotRequired[WireValue]
    """Absent when the walk found no stored value."""


class DeltaHistoryAnswer(TypedDict):
    channels: dict[str, DeltaChannelHistoryBody]


class ReducerBody(TypedDict):
    """The settings of the reducer the service applies."""

    max_messages: int | None
    min_messages: int | None
    max_tokens: int | None
    target_tokens: int | None
    preserve_first: bool
    cascade_tool_messages: bool
    start_on: Literal["human"] | None
    namespace_key: str


class LimitsBody(TypedDict):
    max_list_limit: int
    """The most checkpoints one checkpoints/list answer holds (its limit's maximum and default)."""


#: Which channel values a backend's ``put`` stores, so which ones a client must send: ``"all"`` (every
#: channel's value, in every checkpoint: SQLite), ``"changed"`` (only the channels in ``new_versions``:
#: memory), ``"changed_and_inline"`` (those, and primitive values, kept inline in every checkpoint row:
#: PostgreSQL).
StoredValues = Literal["all", "changed", "changed_and_inline"]


class CapabilitiesAnswer(TypedDict):
    #: Names among ``capabilities.OPTIONAL_CAPABILITIES``.
    capabilities: list[str]
    """Optional saver capabilities the backend has."""
    backend: Literal["postgres", "sqlite", "memory"]
    messages_key: str
    reducer: ReducerBody
    version: str
    body_formats: list[str]
    """Content types of the per-step routes' bodies (checkpoints/get, checkpoints/put, writes/put); their
    answers come in the request's type."""
    limits: LimitsBody
    stored_values: NotRequired[StoredValues]
    """Which channel values the backend stores, so which ones a put must carry: all (every channel's value
    in every checkpoint: sqlite), changed (only the channels in new_versions: memory), changed_and_inline
    (those, plus primitive values, kept inline in every checkpoint row: postgres). Absent from a service
    older than it: the client then goes by backend."""


class ErrorBody(TypedDict):
    """Every error answer."""

    #: ``wire.ERROR_CODES`` names the codes a client acts on.
    detail: str | list[dict[str, Any]]
    """A sentence naming what was wrong, or FastAPI's list of validation errors (each naming its field)."""
    code: NotRequired[str]
    """Present where a client acts on the kind of error: database_timeout on a 504 (the database cancelled
    a statement that ran past its statement_timeout or lock_timeout; not retried blindly)."""


# -- the store's batch route ------------------------------------------------------------------------


class GetOpBody(TypedDict):
    op: Literal["get"]
    namespace: list[str]
    key: str
    refresh_ttl: NotRequired[bool | None]
    """null: the store's refresh_on_read."""


class PutOpBody(TypedDict):
    op: Literal["put"]
    namespace: list[str]
    key: str
    value: dict[str, Any] | None
    """null deletes the item."""
    index: NotRequired[Literal[False] | list[str] | None]
    ttl: NotRequired[float | None]


class SearchOpBody(TypedDict):
    op: Literal["search"]
    namespace_prefix: NotRequired[list[str]]
    filter: NotRequired[dict[str, Any] | None]
    limit: NotRequired[int]
    offset: NotRequired[int]
    query: NotRequired[str | None]
    refresh_ttl: NotRequired[bool | None]
    """null: the store's refresh_on_read."""


class MatchConditionBody(TypedDict):
    match_type: Literal["prefix", "suffix"]
    path: list[str]


class ListNamespacesOpBody(TypedDict):
    op: Literal["list_namespaces"]
    match_conditions: NotRequired[list[MatchConditionBody] | None]
    max_depth: NotRequired[int | None]
    limit: NotRequired[int]
    offset: NotRequired[int]


class StoreBatchBody(TypedDict):
    ops: list[GetOpBody | PutOpBody | SearchOpBody | ListNamespacesOpBody]


class StoreBatchAnswer(TypedDict):
    results: list[Any]
    """Per operation, in order: an item or null (get), null (put), items (search), namespaces."""


# -- LangGraph Agent Server's store routes (what langgraph_sdk's store client sends) ------------------


class PutItemBody(TypedDict):
    namespace: list[str]
    key: str
    value: dict[str, Any]
    index: NotRequired[Literal[False] | list[str] | None]
    ttl: NotRequired[float | None]
    """Minutes; null: the store's default TTL (if any)."""


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


#: Every body above (the layout test reads them).
BODIES: tuple[type, ...] = (
    TypedValueBody,
    RunConfigBody,
    GetCheckpointBody,
    ListCheckpointsBody,
    CheckpointFieldsBody,
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
