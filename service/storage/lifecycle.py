"""Thread-lifecycle pieces the three backends' savers share: argument checks, DeltaChannel markers,
the copy conflict, the keep-checkpoints rule.

Semantics of ``copy_thread``, ``delete_for_runs``, ``prune`` and ``keep_checkpoints``, the same on every backend (each backend's
``saver.py`` implements them against its own tables):

* ``copy_thread(source, target)`` copies every checkpoint, blob and pending write of ``source`` to
  ``target``, ids, parents and metadata unchanged. ``target`` must hold nothing: otherwise
  :class:`ThreadNotEmptyError` and nothing is copied, since merging two histories under one id would
  silently mix them. A ``source`` with nothing stored copies nothing.
* ``delete_for_runs(run_ids)`` deletes, across all threads, the checkpoints whose metadata ``run_id`` is
  one of ``run_ids`` (a string, compared exactly), their pending writes, and the blobs they referenced
  that no remaining checkpoint of the same thread and namespace references. A remaining checkpoint whose
  parent was deleted is left with no parent.
* ``prune(thread_ids, strategy="keep_latest")`` keeps each namespace's latest checkpoint (the one
  ``get_tuple`` loads) with its pending writes and the blobs it references, and leaves it with no
  parent; a subgraph call's namespace (a ``:`` in it) goes entirely when the root checkpoint its call
  started from is saved and pruned. Threads that use a DeltaChannel are refused with
  ``NotImplementedError``, and then nothing is pruned. ``strategy="delete"`` removes everything of the
  threads. These are PostgresSaver 3.2's rules (it also keeps a pre-v4 head's parent for the pending
  sends it reads from there; the other savers never read those). The SQLite and in-memory savers prune
  the whole batch in one transaction, PostgresSaver one thread per transaction.

* ``keep_checkpoints`` (an attribute of each saver, and a put's ``config["configurable"]
  ["keep_checkpoints"]``): after each put, the put's thread and namespace keep their newest K checkpoints
  and every branch head (a checkpoint no other one names as parent), with exactly the pending writes and
  blobs those reference; the rest is deleted and a kept checkpoint whose parent goes is left with none
  (``checkpoints_to_drop``). When the root namespace's prune deletes the root checkpoint a subgraph
  call started from (its newest checkpoint's ``parents[""]``), the call's namespace goes entirely, as
  ``prune`` deletes it. Puts of threads that use a DeltaChannel prune nothing (``uses_delta_channel``;
  under encryption the values arrive sealed, and ``EncryptingSaver`` says so with
  ``DELTA_CHANNEL_KEY``).

A DeltaChannel leaves ``counters_since_delta_snapshot`` (LangGraph.js: ``delta_writes_versioned``) in
checkpoint metadata, except on checkpoints that snapshot every delta channel; a snapshot is a value that
serializes to msgpack extension 7 as a whole. The service stores client blobs verbatim
(:class:`~reducing_saver.service.storage.serde.VerbatimSerde`), so snapshots are recognized from their bytes,
not only as ``_DeltaSnapshot`` objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NotRequired, TypedDict

from langgraph.checkpoint.base import writes_sort_key
from langgraph.checkpoint.postgres.base import PRUNE_STRATEGIES
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.wire import Blob

#: LangGraph's msgpack extension code for a DeltaChannel snapshot (jsonplus.EXT_DELTA_SNAPSHOT).
EXT_DELTA_SNAPSHOT = 7
#: Metadata keys a DeltaChannel leaves on its thread's checkpoints (Python, LangGraph.js).
DELTA_METADATA_KEYS = ("counters_since_delta_snapshot", "delta_writes_versioned")


class ThreadNotEmptyError(ValueError):
    """``copy_thread`` refused: the target thread already holds checkpoints, blobs or writes."""

    def __init__(self, target_thread_id: str) -> None:
        super().__init__(
            f"copy_thread: target thread {target_thread_id!r} already has stored checkpoints or writes; "
            "copy into an unused thread id, or delete that thread first"
        )
        self.target_thread_id = target_thread_id


# -- argument checks and DeltaChannel markers shared by the three savers ---------------------------


def check_prune_args(thread_ids: Sequence[str], strategy: str) -> list[str]:
    """``prune``'s arguments checked as PostgresSaver checks them."""
    if isinstance(thread_ids, str):
        raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
    if strategy not in PRUNE_STRATEGIES:
        raise ValueError(f"Unknown prune strategy: {strategy!r}")
    return list(dict.fromkeys(str(t) for t in thread_ids))


def check_run_ids(run_ids: Sequence[str]) -> list[str]:
    if isinstance(run_ids, str):
        raise TypeError("run_ids must be a sequence of run IDs, not a str")
    return list(dict.fromkeys(str(r) for r in run_ids))


def check_copy_ids(source_thread_id: str, target_thread_id: str) -> tuple[str, str]:
    source, target = str(source_thread_id), str(target_thread_id)
    if source == target:
        raise ValueError(f"copy_thread: source and target are the same thread {source!r}")
    return source, target


#: ``config["configurable"]`` key that makes the PostgreSQL saver's ``list`` keep only thread ids with
#: this prefix (set by ``service/security/tenancy.py`` for a tenant's list across threads; never by agents).
THREAD_PREFIX_KEY = "__thread_id_prefix__"
#: ``config["configurable"]`` key that makes every backend's ``list`` keep only the checkpoints with this
#: id, across threads (the copies ``copy_thread`` made share ids): the service pages through them with a
#: cursor of id, thread and namespace (``service/security/tenancy.py``); never set by agents.
CHECKPOINT_ID_KEY = "__checkpoint_id__"


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape ``\\``) for strings starting with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def refuse_delta_threads(delta_threads: Iterable[str]) -> None:
    if found := sorted(set(delta_threads)):
        raise NotImplementedError(
            f"keep_latest can't prune threads that use a DeltaChannel: {', '.join(found)}"
        )


def run_id_of(metadata: Mapping[str, Any] | None) -> str | None:
    run_id = (metadata or {}).get("run_id")
    return run_id if isinstance(run_id, str) else None


def has_delta_metadata(metadata: Mapping[str, Any] | None) -> bool:
    return any(key in (metadata or {}) for key in DELTA_METADATA_KEYS)


# Offset of the type byte in each msgpack extension header: fixext 1/2/4/8/16, ext 8/16/32.
_EXT_TYPE_OFFSET = {0xD4: 1, 0xD5: 1, 0xD6: 1, 0xD7: 1, 0xD8: 1, 0xC7: 2, 0xC8: 3, 0xC9: 5}


def is_snapshot_blob(type_: str, data: bytes | None) -> bool:
    """True for a serialized value that is, as a whole, a DeltaChannel snapshot."""
    if type_ != "msgpack" or not data:
        return False
    offset = _EXT_TYPE_OFFSET.get(data[0])
    return offset is not None and len(data) > offset and data[offset] == EXT_DELTA_SNAPSHOT


def is_snapshot_value(value: Any) -> bool:
    """A channel value as a saver's serde loads it: a ``_DeltaSnapshot``, or a client blob of one."""
    if isinstance(value, _DeltaSnapshot):
        return True
    return isinstance(value, Blob) and is_snapshot_blob(value.type, value.data)


def parents_root(metadata: Mapping[str, Any] | None) -> str | None:
    """The root graph's checkpoint a subgraph call started from (metadata ``parents[""]``)."""
    parents = (metadata or {}).get("parents")
    root = parents.get("") if isinstance(parents, Mapping) else None
    return root if isinstance(root, str) else None




# -- keep the last K checkpoints ---------------------------------------------------------------------

#: ``config["configurable"]`` key with a thread's own keep-checkpoints count (0 keeps every checkpoint).
KEEP_CHECKPOINTS_KEY = "keep_checkpoints"


def keep_checkpoints_of(config: Mapping[str, Any], default: int | None) -> int | None:
    """How many newest checkpoints per namespace a put of this config keeps; ``None`` keeps them all.

    ``config["configurable"]["keep_checkpoints"]`` wins when present; otherwise ``default`` (the saver's,
    from ``--keep-checkpoints``) applies. ``0`` keeps every checkpoint, as ``None`` does.

    Raises:
        ValueError: If the configured value is not a whole number >= 0.
    """
    value = (config.get("configurable") or {}).get(KEEP_CHECKPOINTS_KEY)
    if value is None:
        return default or None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"config.configurable.{KEEP_CHECKPOINTS_KEY} must be a whole number >= 0 "
            f"(0 keeps every checkpoint), not {value!r}"
        )
    return value or None


def checkpoints_to_drop(parents: Mapping[str, str | None], keep: int) -> set[str]:
    """The checkpoints of one namespace that keeping the last ``keep`` deletes.

    ``parents`` maps each checkpoint id of the namespace to its parent's id. Kept: the ``keep`` newest
    (checkpoint ids grow with time) and every branch head, a checkpoint no other one names as its
    parent; every other checkpoint goes.
    """
    newest = set(sorted(parents, reverse=True)[:keep])
    named = {parent for parent in parents.values() if parent is not None}
    return {checkpoint for checkpoint in parents if checkpoint not in newest and checkpoint in named}


def is_subgraph_call(checkpoint_ns: str) -> bool:
    """A subgraph call's own namespace (``node:task_id``), not a ``checkpointer=True`` subgraph's."""
    return ":" in checkpoint_ns


#: ``config["configurable"]`` key with which a wrapper that saw a put's plain values says the put belongs
#: to a thread with a DeltaChannel (``EncryptingSaver``: the backend's saver then receives the values
#: sealed, and no snapshot is recognizable). A ``__`` key: LangGraph's metadata merge skips it, so it is
#: never stored, and a client cannot send it (``check_configurable`` refuses ``__`` keys).
DELTA_CHANNEL_KEY = "__delta_channel__"


def uses_delta_channel(
    config: Mapping[str, Any], checkpoint: Mapping[str, Any], metadata: Mapping[str, Any] | None
) -> bool:
    """True when a put belongs to a thread with a DeltaChannel: its values are rebuilt from older
    checkpoints' writes, so its history cannot be cut. Told by the put's metadata counters, a snapshot
    among its channel values, or ``config["configurable"][DELTA_CHANNEL_KEY]``."""
    if (config.get("configurable") or {}).get(DELTA_CHANNEL_KEY) is True:
        return True
    values = checkpoint.get("channel_values") or {}
    return has_delta_metadata(metadata) or any(is_snapshot_value(v) for v in values.values())


# -- DeltaChannel history with the places of its values ---------------------------------------------


class PlacedHistory(TypedDict):
    """``get_delta_channel_history``'s entry for one channel, each value with the place it was stored at.

    A sealed value opens only with the place it is bound to (``EncryptingSaver``), which the saver API's
    history leaves out: ``writes`` are ``(checkpoint_id, task_id, value)``, oldest first, in the order
    ``get_delta_channel_history`` returns them; ``seed`` is ``(version, value)``, the channel's version at
    the ancestor whose stored value starts the replay (absent when the walk reached the thread's root).
    """

    writes: list[tuple[str, str, Any]]
    seed: NotRequired[tuple[Any, Any]]


def placed_histories(
    channels: Sequence[str],
    chain_by_channel: Mapping[str, Sequence[str]],
    writes: Iterable[tuple[str, str, str, int, str, Any]],
    seeds: Mapping[str, tuple[Any, Any]],
) -> dict[str, PlacedHistory]:
    """Assemble :class:`PlacedHistory` entries from what a backend read.

    Args:
        channels: The channels asked for.
        chain_by_channel: Each channel's ancestors of the target, newest first, down to and including
            the one holding its seed.
        writes: ``(checkpoint_id, channel, task_id, idx, task_path, value)`` of those ancestors, any order.
        seeds: ``channel -> (version, value)`` for the channels whose walk found a stored value.
    """
    by_place: dict[tuple[str, str], list[tuple[str, str, int, Any]]] = {}
    for checkpoint_id, channel, task_id, idx, task_path, value in writes:
        by_place.setdefault((channel, checkpoint_id), []).append((task_path or "", task_id, idx, value))
    result: dict[str, PlacedHistory] = {}
    for channel in channels:
        collected: list[tuple[str, str, Any]] = []
        for checkpoint_id in reversed(chain_by_channel.get(channel, ())):
            found = by_place.get((channel, checkpoint_id), [])
            # The order a super-step's tasks apply their writes in (writes_sort_key).
            for _path, task_id, _idx, value in sorted(found, key=lambda w: writes_sort_key(w[0], w[1], w[2])):
                collected.append((checkpoint_id, task_id, value))
        entry = PlacedHistory(writes=collected)
        if channel in seeds:
            entry["seed"] = seeds[channel]
        result[channel] = entry
    return result
