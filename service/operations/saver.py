"""The operations behind the HTTP API, one function each, free of HTTP.

Saver operations are called as ``op(service, saver, body)`` in a worker thread with a saver of their
own (``Service.call``); the others as ``op(service, body)`` (``Service.blocking`` when they touch the
database). Each maps the request's ids into the tenant's (``security.TenantScope``), calls the saver,
and returns the answer's payload, or raises a domain error of ``service/errors.py``. The per-step hot
path and the FastAPI routes call the same functions, so no route carries logic of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import closing
from typing import TYPE_CHECKING, Any

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple, get_checkpoint_metadata

from reducing_saver.reducer import (
    UNREADABLE,
    ReducingSaver,
    Summaries,
    SummaryForgeryError,
    namespace_for,
    validate_namespace,
)
from reducing_saver.service import security
from reducing_saver.service.errors import BadRequest, Conflict, NotFound, Unavailable, Untransportable
from reducing_saver.service.security.extensions import UnsafeValueError, check_value
from reducing_saver.service.storage.ledger import InvalidTTLError
from reducing_saver.service.storage.lifecycle import (
    ScopedRunDeletion,
    ThreadNotEmptyError,
    is_snapshot_value,
    keep_checkpoints_of,
    with_snapshots_due,
)
from reducing_saver.service.storage.usage import Selection, ThreadStorage, summarize
from reducing_saver.service.version import __version__
from reducing_saver.wire import (
    BODY_FORMATS,
    INT_TYPE,
    RESERVED_TYPE_PREFIX,
    STOCK_TYPES,
    Blob,
    WireError,
    base64_from_wire,
    blob_from_wire,
    bodies,
    int_from_wire,
    int_to_wire,
    ints_from_wire,
    ints_to_wire,
    is_inline,
    is_reserved_type,
    is_stock_type,
    json_default,
)

if TYPE_CHECKING:
    from reducing_saver.service.state import Service
    from reducing_saver.service.summaries.setup import RunningSummaries

# -- wire conversion ------------------------------------------------------------------------------


def _wire_value(value: Any, field: str) -> Any:
    """A stored value as it travels: a primitive inline, a :class:`Blob` left for the body's encoder, an
    int beyond 64 bits (PostgreSQL's JSONB reads a state float such as 1e20 back as one) in its typed form.

    Raises:
        Untransportable: Naming ``field``, for a value no client could decode (nothing the service
            stores today; rows written to the database by other means).
    """
    if isinstance(value, Blob) or is_inline(value):
        return value
    try:
        wire = int_to_wire(value)
    except WireError as exc:
        raise Untransportable(f"{field}: {exc.message}") from None
    if wire is None:
        raise Untransportable(
            f"{field}: the stored value is a {type(value).__name__}, which has no wire form (was the row "
            "written by something other than the service or a stock saver?)"
        )
    return wire


def _from_wire(value: Any, field: str, *, inline_ints: bool = False) -> Any:
    """A request's value for the saver: a :class:`Blob`, or a primitive.

    ``inline_ints``: an int in its typed wire form becomes the int itself (PostgresSaver's channel values,
    which it keeps inline like a stock PostgresSaver); otherwise it stays a blob, stored verbatim.

    Raises:
        BadRequest: Naming ``field``, for bad base64, a malformed int, or a serde type reserved for the
            service's own storage (a client value under that type would be decoded as the service's
            structure when read back), or a serde type no stock reader reads (stored, it would break
            every read of the thread, and every list).
    """
    if not isinstance(value, dict):  # validated: a primitive, or a bodies.TypedValueBody
        return value
    type_, data = value["type"], value["data"]
    if is_reserved_type(type_):
        raise BadRequest(
            f"{field}.type: {type_!r} is reserved for the service's own storage; "
            f"serde types starting with {RESERVED_TYPE_PREFIX!r} other than {INT_TYPE!r} are refused"
        )
    if type_ != INT_TYPE and not is_stock_type(type_):
        raise BadRequest(
            f"{field}.type: {type_!r} is not a serde type a stock reader reads, so every reader of "
            f"the thread would fail on it; use one of {sorted(STOCK_TYPES)} (or <type>+<cipher>, as "
            "LangGraph's EncryptedSerializer writes)"
        )
    try:
        if isinstance(data, bytes):  # a msgpack body's bin
            blob = Blob(type_, data)
        else:
            blob = Blob(type_, base64_from_wire(data, f"{field}.data"))
        if blob.type == INT_TYPE:
            number = int_from_wire(blob, field)
            return number if inline_ints else blob
    except WireError as exc:
        raise BadRequest(str(exc)) from None
    return blob


def _stores_wire_metadata(saver: ReducingSaver) -> bool:
    """The backend keeps metadata in its wire form (SQLite's JSON and the memory backend's msgpack cannot
    hold ints beyond 64 bits); PostgreSQL keeps it as it is."""
    return not getattr(saver.inner, "keeps_big_ints_inline", False)


def _wire_metadata(metadata: Any, stored_as_wire: bool) -> Any:
    """Stored metadata as it travels: JSONB reads a float such as 1e20 back as an int beyond 64 bits, and
    a user's object may look like a typed value (``wire.ints_to_wire``). Metadata stored in its wire form
    travels as it is."""
    if stored_as_wire:
        return metadata
    try:
        return ints_to_wire(metadata)
    except WireError as exc:
        raise Untransportable(f"metadata: {exc.message}") from None


def _tuple_out(item: CheckpointTuple, stored_as_wire: bool = False) -> bodies.CheckpointTupleBody:
    checkpoint: dict[str, Any] = dict(item.checkpoint)
    values = checkpoint.pop("channel_values", None) or {}
    return bodies.CheckpointTupleBody(
        config=item.config,  # type: ignore[typeddict-item]
        checkpoint=checkpoint,
        values={channel: _wire_value(value, f"values.{channel}") for channel, value in values.items()},
        metadata=_wire_metadata(item.metadata, stored_as_wire),
        parent_config=item.parent_config,  # type: ignore[typeddict-item]
        pending_writes=[
            (task_id, channel, _wire_value(value, f"pending_writes[{index}]"))
            for index, (task_id, channel, value) in enumerate(item.pending_writes or ())
        ],
    )


def _run_config(
    config: bodies.RunConfigBody, *, need_thread: bool = True, default_ns: str | None = ""
) -> RunnableConfig:
    """A request's run config for the saver.

    ``default_ns`` fills a missing ``checkpoint_ns``: ``""`` (the root graph) for calls naming one
    checkpoint; ``None`` for lists, where a config without a namespace means every namespace of the
    thread, as it does to the stock savers.
    """
    configurable = _typed_ints(config["configurable"], "config.configurable")
    thread_id = configurable.get("thread_id")
    if need_thread and (thread_id is None or thread_id == ""):
        raise BadRequest("config.configurable.thread_id is required")
    if thread_id is not None:
        configurable["thread_id"] = str(thread_id)
    checkpoint_ns = configurable.get("checkpoint_ns")
    if checkpoint_ns is None:
        if default_ns is not None:
            configurable["checkpoint_ns"] = default_ns
    elif not isinstance(checkpoint_ns, str):
        raise BadRequest("config.configurable.checkpoint_ns must be a string")
    run_config = RunnableConfig(configurable=configurable)
    if config["metadata"]:
        run_config["metadata"] = _typed_ints(config["metadata"], "config.metadata")
    return run_config


def _typed_ints(values: Mapping[str, Any], field: str) -> dict[str, Any]:
    """A run config's values with each typed value (only ``INT_TYPE`` is allowed there) turned into its int."""
    result = dict(values)
    for key, value in values.items():
        if isinstance(value, dict):  # validated: a bodies.TypedValueBody
            where = f"{field}.{key}"
            try:
                blob = blob_from_wire(value, where)
                if blob.type != INT_TYPE:
                    raise WireError(f"{where}.type", f"a run config value may be typed only as {INT_TYPE!r}")
                result[key] = int_from_wire(blob, where)
            except WireError as exc:
                raise BadRequest(str(exc)) from None
    return result


def _check_extensions(service: Service, values: Any, messages: Any = None, decode: Any = None) -> Any:
    """Refuse values naming code before anything is stored: every reader's deserializer would run it.

    ``messages`` is the messages channel's field and value when the reducer will decode it: its codec is
    stricter there (message classes only) and its refusal says where and how to allow a class, so a
    refused messages value gets the codec's answer when the codec refuses it too. With ``decode`` (the
    reducer's codec's ``decode``), that value is checked by decoding it: a value the codec reads as a list
    of messages had every extension in it vetted by the codec, which accepts nothing the extension policy
    refuses (one pass instead of a scan and a decode). Anything the codec does not read (a DeltaChannel
    snapshot, another shape) is scanned as before.

    Returns:
        What ``decode`` answered for the messages value, for ``ReducingSaver.put(decoded=...)``: the
        messages, :data:`UNREADABLE` for ``None``, or ``None`` when it was not decoded here.
    """
    decoded: Any = None
    try:
        for field, value in values:
            if not isinstance(value, Blob) or value.type != "msgpack":
                continue
            if decode is not None and messages is not None and field == messages[0]:
                decoded = decode(value)  # raises UnsafeMessagesError, a 422 of its own
                if decoded is not None:
                    continue
                decoded = UNREADABLE
            check_value(value.data, field, service.extension_policy)
    except UnsafeValueError as exc:
        if messages is not None and exc.field == messages[0] and decoded is None:
            service.codec.decode(messages[1])  # raises UnsafeMessagesError, a 422 of its own
        raise BadRequest(str(exc)) from None
    return decoded


def _scope(service: Service) -> security.TenantScope:
    """The request's tenant scope (identity without API keys)."""
    return security.TenantScope.for_request(service.tenant_mode)


# -- the per-step operations ----------------------------------------------------------------------


def get_checkpoint(
    service: Service, saver: ReducingSaver, body: bodies.GetCheckpointBody
) -> bodies.GetCheckpointAnswer:
    scope = _scope(service)
    config = scope.config_in(_run_config(body["config"]), service.settings.namespace_key)
    item = saver.get_tuple(config)
    if item is not None and not config["configurable"].get("checkpoint_id"):
        # A run starts from the latest checkpoint: DeltaChannels whose snapshot would leave the kept
        # checkpoints are answered as due, so LangGraph stores one (lifecycle.with_snapshots_due).
        try:
            keep = keep_checkpoints_of(config, service.settings.keep_checkpoints)
        except ValueError:  # refused when the thread puts; a read goes on as without a count
            keep = None
        if keep is not None and "counters_since_delta_snapshot" in item.metadata:
            values = item.checkpoint.get("channel_values") or {}
            snapshotted = [channel for channel, value in values.items() if is_snapshot_value(value)]
            item = item._replace(metadata=with_snapshots_due(item.metadata, keep, snapshotted))
    return bodies.GetCheckpointAnswer(
        checkpoint=scope.tuple_out(_tuple_out(item, _stores_wire_metadata(saver))) if item else None
    )


def put_checkpoint(
    service: Service,
    saver: ReducingSaver,
    body: bodies.PutCheckpointBody,
    *,
    parent_messages_kept: bool = False,
) -> bodies.PutCheckpointAnswer:
    """``parent_messages_kept``: the request's ``wire.PARENT_MESSAGES_HEADER`` said ``kept``
    (``ReducingSaver.put``)."""
    scope = _scope(service)
    config = run_config = _run_config(body["config"])
    settings = service.settings
    try:
        keep_checkpoints_of(config, None)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    messages_key = settings.messages_key
    inline_ints = not _stores_wire_metadata(saver)
    values = {
        channel: _from_wire(value, f"values.{channel}", inline_ints=inline_ints)
        for channel, value in body["values"].items()
    }
    writes_messages = messages_key in body["new_versions"]
    if writes_messages:
        # Decided now, not when the extractor meets it: a namespace the store refuses would never deliver.
        try:
            validate_namespace(namespace_for(config, settings.namespace_key))
        except ValueError as exc:
            raise BadRequest(f"config.configurable.{settings.namespace_key}: {exc}") from None
        value = values.get(messages_key)
        if isinstance(value, Blob):
            try:
                security.check_messages_value(value.type, value.data, f"values.{messages_key}")
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
    messages = (f"values.{messages_key}", values.get(messages_key)) if writes_messages else None
    decoded = _check_extensions(
        service,
        ((f"values.{channel}", value) for channel, value in values.items()),
        messages,
        saver.codec.decode if writes_messages and not saver.passthrough else None,
    )
    config = scope.config_in(config, settings.namespace_key, namespace=writes_messages)
    if service.sweeper is not None:  # before the write, so a TTL sweep of this thread skips it
        try:
            service.sweeper.touch(config)
        except InvalidTTLError as exc:
            raise BadRequest(str(exc)) from None
    checkpoint: Any = dict(body["checkpoint"])
    checkpoint["channel_values"] = values
    try:
        metadata = ints_from_wire(body["metadata"], "metadata")
    except WireError as exc:
        raise BadRequest(str(exc)) from None
    # The run config's values, merged as the saver would merge them, so its big ints take the path below.
    metadata = get_checkpoint_metadata(run_config, metadata)
    if not inline_ints and metadata is not body["metadata"]:
        # PostgresSaver's JSONB holds any int; SqliteSaver's JSON and the msgpack of the memory backend
        # cannot, so they store the wire form (typed ints, escaped look-alikes) as JSON objects, which
        # travel back as they are and the client decodes.
        metadata = orjson.loads(orjson.dumps(ints_to_wire(metadata), default=json_default))
    try:
        with service.recording_with_checkpoint() as records:
            next_config = saver.put(
                config,
                checkpoint,
                metadata,
                body["new_versions"],
                decoded=decoded,
                records=records,
                parent_messages_kept=parent_messages_kept,
            )
    except SummaryForgeryError as exc:
        raise BadRequest(f"values.{messages_key}: {scope.text(str(exc))}") from None
    return bodies.PutCheckpointAnswer(config=scope.config_out(next_config))


def put_writes(service: Service, saver: ReducingSaver, body: bodies.PutWritesBody) -> None:
    config = _scope(service).config_in(_run_config(body["config"]), service.settings.namespace_key)
    if not config["configurable"].get("checkpoint_id"):
        raise BadRequest("config.configurable.checkpoint_id is required for writes")
    writes = [
        (channel, _from_wire(value, f"writes[{index}]"))
        for index, (channel, value) in enumerate(body["writes"])
    ]
    _check_extensions(
        service,
        ((f"writes[{index}] (channel {channel!r})", value) for index, (channel, value) in enumerate(writes)),
    )
    running = service.running_summaries
    if running is not None:
        _check_summary_writes(service, running.summaries, config, writes)
    saver.put_writes(config, writes, body["task_id"], body["task_path"])


def _check_summary_writes(
    service: Service, summaries: Summaries, config: RunnableConfig, writes: list[tuple[str, Any]]
) -> None:
    """Refuse a write to the messages channel carrying a summary message the service did not write."""
    configurable = config["configurable"]
    for index, (channel, value) in enumerate(writes):
        if channel != service.settings.messages_key or not isinstance(value, Blob) or value.type != "msgpack":
            continue
        messages = service.codec.decode(value)
        if messages is None:  # one message rather than a list: read it as a list of one
            messages = service.codec.decode(Blob(value.type, b"\x91" + value.data)) or []
        try:
            summaries.check_written(
                messages,
                thread_id=str(configurable["thread_id"]),
                checkpoint_ns=str(configurable.get("checkpoint_ns") or ""),
            )
        except SummaryForgeryError as exc:
            raise BadRequest(f"writes[{index}]: {_scope(service).text(str(exc))}") from None


# -- the other saver operations -------------------------------------------------------------------


def list_checkpoints(
    service: Service, saver: ReducingSaver, body: bodies.ListCheckpointsBody
) -> bodies.ListCheckpointsAnswer:
    scope = _scope(service)
    # A config without a thread id used to reach the saver and fail there (500): a config names a thread.
    config = _run_config(body["config"], default_ns=None) if body["config"] else None
    before = _run_config(body["before"], need_thread=False, default_ns=None) if body["before"] else None
    if config is not None:
        config = scope.config_in(config, service.settings.namespace_key)
    # No limit means one page of max_list_limit, never everything: a client wanting more pages on with
    # ``before`` (RemoteReducingSaver does; /v1/capabilities tells it the page size).
    limit = service.settings.max_list_limit if body["limit"] is None else body["limit"]
    found = security.list_checkpoints(saver, scope, config, filter=body["filter"], before=before, limit=limit)
    # Closed whatever happens: PostgresSaver.list holds the saver's lock until its generator ends.
    with closing(found):
        stored_as_wire = _stores_wire_metadata(saver)
        items = [scope.tuple_out(_tuple_out(item, stored_as_wire)) for item in found]
    return bodies.ListCheckpointsAnswer(checkpoints=items)


def delete_thread(service: Service, saver: ReducingSaver, body: bodies.DeleteThreadBody) -> None:
    thread_id = _scope(service).thread(body["thread_id"])
    if service.settings.extract_on_delete and service.sweeper is not None:
        service.sweeper.delete_extracting(thread_id)  # its window goes to long-term memory first
        return
    saver.delete_thread(thread_id)


def copy_thread(service: Service, saver: ReducingSaver, body: bodies.CopyThreadBody) -> None:
    source_id, target_id = body["source_thread_id"], body["target_thread_id"]
    if source_id == target_id:  # was a ValueError from the saver: a 500
        raise BadRequest(f"target_thread_id: the same thread as source_thread_id ({source_id!r})")
    scope = _scope(service)
    source, target = scope.thread(source_id), scope.thread(target_id)
    if service.sweeper is not None:  # the copy is the target's write: its TTL age starts now
        service.sweeper.copied(source, target)
    try:
        saver.copy_thread(source, target)
    except ThreadNotEmptyError:
        raise Conflict(str(ThreadNotEmptyError(target_id))) from None


def prune(service: Service, saver: ReducingSaver, body: bodies.PruneBody) -> None:
    scope = _scope(service)
    try:
        saver.prune(scope.threads(body["thread_ids"]), strategy=body["strategy"])
    except NotImplementedError as exc:
        raise Conflict(scope.text(str(exc)) or "not supported by this backend") from None


def delete_for_runs(service: Service, saver: ReducingSaver, body: bodies.DeleteRunsBody) -> None:
    scope = _scope(service)
    if scope.tenant is None:
        saver.delete_for_runs(body["run_ids"])
    else:  # only this tenant's threads (the service's savers take a thread-id prefix)
        inner = saver.inner
        assert isinstance(inner, ScopedRunDeletion)  # every backend's saver, and the wrappers over them
        inner.delete_for_runs(body["run_ids"], thread_id_prefix=scope.prefix)


def delta_history(
    service: Service, saver: ReducingSaver, body: bodies.DeltaHistoryBody
) -> bodies.DeltaHistoryAnswer:
    config = _scope(service).config_in(_run_config(body["config"]), service.settings.namespace_key)
    history = saver.get_delta_channel_history(config=config, channels=body["channels"])
    channels = {}
    for channel, entry in history.items():
        out = bodies.DeltaChannelHistoryBody(
            writes=[
                (task_id, ch, _wire_value(value, f"channels.{channel}.writes[{index}]"))
                for index, (task_id, ch, value) in enumerate(entry["writes"])
            ]
        )
        if "seed" in entry:
            out["seed"] = _wire_value(entry["seed"], f"channels.{channel}.seed")
        channels[channel] = out
    return bodies.DeltaHistoryAnswer(channels=channels)


# -- capabilities, memory and sweeps --------------------------------------------------------------


def capabilities(service: Service) -> bodies.CapabilitiesAnswer:
    """The backend's optional capabilities and the reducer's configuration."""
    config = service.reducer.config
    savers = service.open_savers()
    return bodies.CapabilitiesAnswer(
        capabilities=sorted(savers.capabilities),
        backend=service.backend_kind,  # type: ignore[typeddict-item]
        messages_key=service.settings.messages_key,
        reducer=bodies.ReducerBody(
            max_messages=config.max_messages,
            min_messages=config.count_target,
            max_tokens=config.max_tokens,
            target_tokens=config.token_target,
            preserve_first=config.preserve_first,
            cascade_tool_messages=config.cascade_tool_messages,
            start_on=config.start_on,
            namespace_key=config.namespace_key,
        ),
        version=__version__,
        body_formats=list(BODY_FORMATS),
        limits=bodies.LimitsBody(max_list_limit=service.settings.max_list_limit),
        stored_values=savers.stored_values,
    )


def extraction_status(service: Service) -> dict[str, Any]:
    status = service.open_memory().outbox.status(namespace_prefix=_scope(service).namespace_prefix)
    sweeper = service.sweeper
    purged = sweeper.status_figure("outbox_rows_purged") if sweeper is not None else 0
    return {
        **status,
        "retention_seconds": service.settings.outbox_retention,
        "purging": sweeper is not None and sweeper.running,
        "purged_by_this_process": purged,
        "summaries": (
            service.running_summaries.book.status(thread_prefix=_scope(service).prefix)
            if service.running_summaries is not None
            else None
        ),
    }


def dead_letters(service: Service, limit: int) -> dict[str, Any]:
    scope = _scope(service)
    entries = service.open_memory().outbox.dead_letters(limit, namespace_prefix=scope.namespace_prefix)
    return {
        "dead_letters": [
            {
                "namespace": scope.unnamespace(entry.namespace),
                "key": entry.key,
                "thread_id": entry.thread_id,
                "attempts": entry.attempts,
                "last_error": entry.last_error,
                "pruned_at": entry.pruned_at.isoformat(),
            }
            for entry in entries
        ]
    }


def retry_dead(service: Service) -> dict[str, Any]:
    scope = _scope(service)
    answer = {"requeued": service.open_memory().outbox.retry_dead(namespace_prefix=scope.namespace_prefix)}
    running = service.running_summaries
    if running is not None:
        answer["summary_steps_requeued"] = running.book.retry_dead(thread_prefix=scope.prefix)
        if answer["summary_steps_requeued"]:
            running.wake()
    return answer


def _running_summaries(service: Service) -> RunningSummaries:
    running = service.running_summaries
    if running is None:
        raise NotFound("running summaries are off: this service was started without --summarizer")
    return running


def summary_dead_steps(service: Service, limit: int) -> dict[str, Any]:
    """The caller's summary batches that failed every attempt, oldest first (``limit`` of them).

    Raises:
        NotFound: If the service runs without ``--summarizer``.
    """
    scope = _scope(service)
    steps = _running_summaries(service).book.dead_letters(limit, thread_prefix=scope.prefix)
    return {
        "dead_steps": [
            {
                "thread_id": scope.unthread(step.thread_id),
                "checkpoint_ns": step.checkpoint_ns,
                "step_id": step.step_id,
                "messages": step.messages,
                "attempts": step.attempts,
                "last_error": None if step.last_error is None else scope.text(step.last_error),
            }
            for step in steps
        ]
    }


def summary_retry_dead(service: Service) -> dict[str, Any]:
    """Send the caller's dead summary batches back to the summarizer.

    Raises:
        NotFound: If the service runs without ``--summarizer``.
    """
    running = _running_summaries(service)
    requeued = running.book.retry_dead(thread_prefix=_scope(service).prefix)
    if requeued:
        running.wake()
    return {"requeued": requeued}


def sweeps_status(service: Service) -> dict[str, Any]:
    if service.sweeper is None:
        raise Unavailable("the service is starting or stopping")
    # A tenant sees its own threads' figures; the database-wide view is for single-tenant mode only.
    return service.sweeper.status(thread_prefix=_scope(service).prefix)


def channel_uses(thread: ThreadStorage, settings: Any) -> dict[str, dict[str, str]]:
    """What the service does with the thread's messages channel and each of its DeltaChannels
    (``schemas.ChannelUse``), under ``settings``."""
    key, keep = settings.messages_key, settings.keep_checkpoints
    window = (
        f"max_messages={settings.max_messages}"
        if settings.max_messages
        else f"max_tokens={settings.max_tokens}"
        if settings.max_tokens
        else None
    )
    removed = (
        f"messages the agent removes reach long-term memory (remember_removed={settings.remember_removed})"
    )
    uses: dict[str, dict[str, str]] = {}
    if key not in thread.delta_channels:
        if window is not None:
            what = f"each stored checkpoint keeps a window ({window}); messages cut from it, and {removed}"
            uses[key] = {"kind": "windowed", "service": what}
        else:
            uses[key] = {"kind": "whole", "service": f"stored whole (no window is configured); {removed}"}
    for channel in thread.delta_channels:
        parts = [
            "rebuilt from its writes, so stored as written"
            + (f": the window ({window}) does not apply" if channel == key and window else "")
        ]
        if channel == key:
            parts.append(removed)
        if keep:
            parts.append(
                f"keep_checkpoints={keep} keeps the checkpoints back to its snapshot, and LangGraph writes one "
                f"when a run starts whose last snapshot is {keep} or more steps back"
            )
        uses[channel] = {"kind": "delta", "service": "; ".join(parts)}
    return uses


def thread_storage(service: Service, thread_id: str) -> dict[str, Any]:
    """What one of the caller's threads holds (``schemas.ThreadStorageResponse``).

    Raises:
        NotFound: If the thread has no checkpoint (another tenant's thread looks the same).
    """
    scope = _scope(service)
    selection = Selection(thread=scope.thread(thread_id), tenant_mode=service.tenant_mode)
    found = service.open_backend().storage(selection, messages_key=service.settings.messages_key)
    if not found:
        raise NotFound(f"thread {thread_id!r} has no checkpoints")
    return _thread_storage_out(found[0], scope, service.settings)


def storage_summary(service: Service, top: int) -> dict[str, Any]:
    """The caller's threads added up, and the ``top`` largest (``schemas.StorageSummaryResponse``)."""
    scope = _scope(service)
    selection = Selection(tenant=scope.tenant, tenant_mode=service.tenant_mode)
    threads = service.open_backend().storage(selection, messages_key=service.settings.messages_key)
    summary = summarize(threads, top)
    summary["largest"] = [_thread_storage_out(thread, scope, service.settings) for thread in threads[:top]]
    return summary


def _thread_storage_out(thread: ThreadStorage, scope: security.TenantScope, settings: Any) -> dict[str, Any]:
    return {
        **thread.as_dict(),
        "thread_id": scope.unthread(thread.thread_id),
        "channels": channel_uses(thread, settings),
    }
