"""The wire's bodies as the service checks them, and the models of the answers only the service writes.

:func:`validated` turns a body of ``wire/bodies.py`` into the type FastAPI and the hot path validate: the
same name and fields, strict leaf types (``1`` is no string, ``false`` no offset), unknown keys refused,
and the service's own checks, caps and defaults (:data:`FIELD_RULES`, :data:`TERM_RULES`) added to the
wire's fields; the docstrings under the wire's fields become their OpenAPI descriptions. Channel and write
values are ``WireValue``s (see ``reducing_saver.wire``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired, Union

import typing_extensions
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from pydantic_core import PydanticCustomError

from reducing_saver.service import security
from reducing_saver.service.operations import store as store_ops
from reducing_saver.service.security.limits import _limits
from reducing_saver.wire import bodies

# -- caps (service/security/limits.py): the numbers are settings, read per request; the OpenAPI document shows them


def _refusing(check: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
    """A validator running ``check(value, *args)``; its ValueError becomes a pydantic error (a 422)."""

    def run(value: Any) -> Any:
        try:
            return check(value, *args)
        except ValueError as exc:
            raise PydanticCustomError("refused", "{reason}", {"reason": str(exc)}) from None

    return run


def _capped(field: str, what: str, setting: str, *, inner: str | None = None) -> tuple[Any, ...]:
    """Annotated metadata: at most ``setting`` items, checked before the items are validated; with
    ``inner`` (the items' field name), each item's own items too (a dict of dicts)."""
    keyword = "maxItems" if what != "channels" else "maxProperties"
    limits = _limits  # the request's caps (``security.current_limits``), read without a call of its own

    def check(value: Any) -> Any:
        # Runs on every per-step request, several times: the common case (within the cap) in one frame.
        cap = getattr(limits.get(), setting)
        if isinstance(value, (list, dict)) and len(value) > cap:
            return _refusing(security.check_count, field, what, setting)(value)  # raises, naming the cap
        if inner is not None and isinstance(value, dict):
            for item in value.values():
                if isinstance(item, (list, dict)) and len(item) > cap:
                    return _refusing(security.check_count, inner, what, setting)(item)
        return value

    document = security.documented(**{keyword: setting})

    def schema_extra(schema: dict[str, Any]) -> None:
        document(schema)
        if inner is not None and isinstance(schema.get("additionalProperties"), dict):
            document(schema["additionalProperties"])

    return BeforeValidator(check), Field(json_schema_extra=schema_extra)


def _default(value: Any) -> Any:
    """The value an absent field takes (and the OpenAPI document shows)."""
    if isinstance(value, (list, dict)):  # a new one each time, shown as the empty one
        return Field(default_factory=type(value), json_schema_extra={"default": value})
    return Field(default=value)


_CHANNELS = ("channels", "max_channels")

#: What the service checks of a term of the protocol (``bodies.Term``), wherever it appears.
TERM_RULES: dict[Any, Any] = {
    bodies.ThreadId: Annotated[
        StrictStr,
        Field(
            min_length=1,
            pattern=security.THREAD_ID_SCHEMA_PATTERN,
            json_schema_extra=security.documented(maxLength="max_thread_id_length"),
            description="A thread id: no control characters, NUL, '/' or '\\', not '.' or '..', at most "
            "max_thread_id_length characters.",
        ),
        AfterValidator(_refusing(security.check_thread_id)),
    ],
}

#: What the service adds to a field of a wire body: checks, caps (read per request) and defaults.
FIELD_RULES: dict[tuple[type, str], tuple[Any, ...]] = {
    (bodies.RunConfigBody, "configurable"): (
        _default({}),
        AfterValidator(_refusing(security.check_configurable)),
    ),
    (bodies.RunConfigBody, "metadata"): (_default({}),),
    (bodies.ListCheckpointsBody, "config"): (_default(None),),
    (bodies.ListCheckpointsBody, "filter"): (
        _default(None),
        AfterValidator(_refusing(security.check_filter_keys, "filter")),
    ),
    (bodies.ListCheckpointsBody, "before"): (_default(None),),
    (bodies.ListCheckpointsBody, "limit"): (
        _default(None),
        Field(ge=0, json_schema_extra=security.documented(maximum="max_list_limit")),
        AfterValidator(_refusing(security.check_limit)),
    ),
    (bodies.CheckpointFieldsBody, "id"): (Field(pattern=security.UUID_SCHEMA_PATTERN),),
    (bodies.CheckpointFieldsBody, "channel_versions"): _capped("checkpoint.channel_versions", *_CHANNELS),
    (bodies.CheckpointFieldsBody, "versions_seen"): _capped(
        "checkpoint.versions_seen", *_CHANNELS, inner="checkpoint.versions_seen[node]"
    ),
    (bodies.CheckpointFieldsBody, "updated_channels"): (_default(None),),
    (bodies.PutCheckpointBody, "values"): _capped("values", *_CHANNELS),
    (bodies.PutCheckpointBody, "metadata"): (_default({}),),
    (bodies.PutCheckpointBody, "new_versions"): _capped("new_versions", *_CHANNELS),
    (bodies.PutWritesBody, "writes"): _capped("writes", "writes", "max_writes_per_call"),
    (bodies.PutWritesBody, "task_path"): (_default(""),),
    (bodies.PruneBody, "thread_ids"): _capped("thread_ids", "thread ids", "max_ids_per_call"),
    (bodies.PruneBody, "strategy"): (_default("keep_latest"),),
    (bodies.DeleteRunsBody, "run_ids"): _capped("run_ids", "run ids", "max_ids_per_call"),
    (bodies.DeltaHistoryBody, "channels"): _capped("channels", "channel names", "max_channels"),
    # The store's bodies: Agent Server's defaults.
    (bodies.PutItemBody, "index"): (_default(None),),
    (bodies.PutItemBody, "ttl"): (_default(None),),
    (bodies.StoreItemBody, "score"): (_default(None),),
    (bodies.GetOpBody, "refresh_ttl"): (_default(None),),
    (bodies.PutOpBody, "index"): (_default(None),),
    (bodies.PutOpBody, "ttl"): (_default(None),),
    (bodies.ListNamespacesOpBody, "match_conditions"): (_default(None),),
    (bodies.ListNamespacesOpBody, "max_depth"): (_default(None),),
    (bodies.ListNamespacesOpBody, "limit"): (_default(store_ops.LIST_NAMESPACES_LIMIT),),
    (bodies.ListNamespacesOpBody, "offset"): (_default(store_ops.DEFAULT_OFFSET),),
    (bodies.ListNamespacesBody, "prefix"): (_default(None),),
    (bodies.ListNamespacesBody, "suffix"): (_default(None),),
    (bodies.ListNamespacesBody, "max_depth"): (_default(None),),
    (bodies.ListNamespacesBody, "limit"): (_default(store_ops.LIST_NAMESPACES_LIMIT),),
    (bodies.ListNamespacesBody, "offset"): (_default(store_ops.DEFAULT_OFFSET),),
    **{
        (search, field): (_default(value),)
        for search in (bodies.SearchItemsBody, bodies.SearchOpBody)
        for field, value in (
            ("namespace_prefix", []),
            ("filter", None),
            ("limit", store_ops.SEARCH_LIMIT),
            ("offset", store_ops.DEFAULT_OFFSET),
            ("query", None),
            ("refresh_ttl", None),
        )
    },
}

#: Bodies that keep keys they do not declare (a checkpoint carries whatever LangGraph adds to it).
OPEN_BODIES = frozenset({bodies.CheckpointFieldsBody})
#: The answers' bodies: the service writes them, and a newer service may add keys (never refused, never
#: kept when FastAPI writes an answer). Every request body refuses keys it does not declare.
ANSWER_BODIES = frozenset(
    {
        bodies.CheckpointConfigBody,
        bodies.CheckpointTupleBody,
        bodies.DeltaChannelHistoryBody,
        bodies.ReducerBody,
        bodies.LimitsBody,
        bodies.ErrorBody,
        bodies.StoreItemBody,
        *(body for body in bodies.BODIES if body.__name__.endswith("Answer")),
    }
)

_STRICT: dict[Any, Any] = {str: StrictStr, int: StrictInt, float: StrictFloat, bool: StrictBool}


@functools.cache
def validated(body: type) -> Any:
    """``body`` (a TypedDict of ``wire/bodies.py``) as the service validates and documents it."""
    hints = typing.get_type_hints(body, include_extras=True)
    descriptions = _field_docstrings(body)
    fields: dict[str, Any] = {}
    for name, hint in hints.items():
        # Read off the hint: with postponed annotations, Python 3.11's __required_keys__ misses NotRequired.
        required: bool = getattr(body, "__total__", True)  # every TypedDict has it; mypy's ``type`` does not
        if typing.get_origin(hint) in (NotRequired, typing.Required):
            required = typing.get_origin(hint) is typing.Required
            hint = typing.get_args(hint)[0]
        metadata = list(FIELD_RULES.get((body, name), ()))
        if name in descriptions:
            metadata.append(Field(description=descriptions[name]))
        checked = _service_type(hint)
        if metadata:
            checked = Annotated[checked, *metadata]
        fields[name] = checked if required else NotRequired[checked]
    result = _typed_dict(body.__name__, fields)
    result.__doc__ = body.__doc__
    extra: Literal["allow", "ignore", "forbid"] = (
        "allow" if body in OPEN_BODIES else "ignore" if body in ANSWER_BODIES else "forbid"
    )
    result.__pydantic_config__ = ConfigDict(extra=extra)
    return result


def _typed_dict(name: str, fields: dict[str, Any]) -> Any:
    """``TypedDict(name, fields)``, a class made at run time."""
    return typing_extensions.TypedDict(name, fields)  # type: ignore[operator]  # typeshed: a special form, not callable


def _service_type(hint: Any) -> Any:
    """A field's type with strict leaves, wire bodies as :func:`validated` and terms with their rules."""
    try:
        if hint in TERM_RULES:
            return TERM_RULES[hint]
    except TypeError:  # unhashable: no term
        pass
    if typing.is_typeddict(hint):
        return validated(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        kept = tuple(item for item in hint.__metadata__ if not isinstance(item, bodies.Term))
        inner = _service_type(args[0])
        return Annotated[inner, *kept] if kept else inner
    if origin in (Union, types.UnionType):
        union: Any = Union[tuple(_service_type(arg) for arg in args)]  # noqa: UP007
        tag = _discriminator(args)
        return Annotated[union, Field(discriminator=tag)] if tag else union
    if origin in (list, dict, tuple):
        return origin[tuple(_service_type(arg) for arg in args)]
    return _STRICT.get(hint, hint)


def _discriminator(members: tuple[Any, ...]) -> str | None:
    """The key whose literal tells the members of a union of bodies apart (``op``), if there is one."""
    if not all(typing.is_typeddict(member) for member in members):
        return None
    hints = [typing.get_type_hints(member) for member in members]
    for key in hints[0]:
        if all(typing.get_origin(h.get(key)) is Literal for h in hints):
            return key
    return None


def _field_docstrings(body: type) -> dict[str, str]:
    """The string literal under each field of ``body``'s class statement, on one line."""
    try:
        source = textwrap.dedent(inspect.getsource(body))
    except (OSError, TypeError):
        return {}
    (statement,) = ast.parse(source).body
    assert isinstance(statement, ast.ClassDef)
    found = {}
    for node, after in itertools.pairwise(statement.body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = " ".join(after.value.value.split())
    return found


# The bodies the routes name, under the wire's names: a type checker sees the wire's TypedDicts, FastAPI and
# the hot path the validated ones (the same fields).
if TYPE_CHECKING:
    from reducing_saver.wire.bodies import (
        CapabilitiesAnswer,
        CopyThreadBody,
        DeleteItemBody,
        DeleteRunsBody,
        DeleteThreadBody,
        DeltaHistoryAnswer,
        DeltaHistoryBody,
        ErrorBody,
        GetCheckpointAnswer,
        GetCheckpointBody,
        ListCheckpointsAnswer,
        ListCheckpointsBody,
        ListNamespacesAnswer,
        ListNamespacesBody,
        PruneBody,
        PutCheckpointAnswer,
        PutCheckpointBody,
        PutItemBody,
        PutWritesBody,
        SearchItemsAnswer,
        SearchItemsBody,
        StoreBatchAnswer,
        StoreBatchBody,
        StoreItemBody,
    )
else:
    CapabilitiesAnswer = validated(bodies.CapabilitiesAnswer)
    CopyThreadBody = validated(bodies.CopyThreadBody)
    DeleteItemBody = validated(bodies.DeleteItemBody)
    DeleteRunsBody = validated(bodies.DeleteRunsBody)
    DeleteThreadBody = validated(bodies.DeleteThreadBody)
    DeltaHistoryAnswer = validated(bodies.DeltaHistoryAnswer)
    DeltaHistoryBody = validated(bodies.DeltaHistoryBody)
    ErrorBody = validated(bodies.ErrorBody)
    GetCheckpointAnswer = validated(bodies.GetCheckpointAnswer)
    GetCheckpointBody = validated(bodies.GetCheckpointBody)
    ListCheckpointsAnswer = validated(bodies.ListCheckpointsAnswer)
    ListCheckpointsBody = validated(bodies.ListCheckpointsBody)
    ListNamespacesAnswer = validated(bodies.ListNamespacesAnswer)
    ListNamespacesBody = validated(bodies.ListNamespacesBody)
    PruneBody = validated(bodies.PruneBody)
    PutCheckpointAnswer = validated(bodies.PutCheckpointAnswer)
    PutCheckpointBody = validated(bodies.PutCheckpointBody)
    PutItemBody = validated(bodies.PutItemBody)
    PutWritesBody = validated(bodies.PutWritesBody)
    SearchItemsAnswer = validated(bodies.SearchItemsAnswer)
    SearchItemsBody = validated(bodies.SearchItemsBody)
    StoreBatchAnswer = validated(bodies.StoreBatchAnswer)
    StoreBatchBody = validated(bodies.StoreBatchBody)
    StoreItemBody = validated(bodies.StoreItemBody)


# -- the answers only the service writes --------------------------------------------------------------


class SummaryStatus(BaseModel):
    pending_steps: int = Field(description="Batches of cut messages awaiting a summary.")
    messages_awaiting_summary: int = Field(description="Messages in those batches (still in their windows).")
    done_steps: int
    dead_steps: int = Field(
        description="Batches whose summary failed every attempt; retry-dead re-runs them."
    )
    oldest_pending_age_seconds: float | None = Field(description="null when nothing is pending.")


class ExtractionStatus(BaseModel):
    pending: int = Field(
        description="Pruned messages waiting for delivery (including those waiting for a retry)."
    )
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
        None,
        description="Running summaries (with --summarizer only): the tenant's own threads in tenant mode.",
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
