"""Thread-lifecycle pieces the three backends' savers share: argument checks, DeltaChannel markers,
the copy conflict, the keep-checkpoints rule.

``copy_thread``, ``delete_for_runs``, ``prune`` and ``keep_checkpoints`` mean the same on every backend
(each backend's ``saver.py`` implements them against its own tables); docs/storage.md ("Copy, delete by
run, prune: the same on every backend", "Keep the last K checkpoints") states their rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NotRequired, Protocol, TypedDict, runtime_checkable

from langgraph.checkpoint.base import CheckpointMetadata, writes_sort_key
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


#: The service's table of what the keep-checkpoints policy deleted: ``(thread_id, checkpoint_ns,
#: pruned_through)``, the newest checkpoint id it deleted in that namespace.
PRUNED_TABLE = "reducing_saver_pruned"


class CheckpointPrunedError(LookupError):
    """A call named a checkpoint the keep-checkpoints policy deleted (as the one to read, or as the
    parent of a put).

    Attributes:
        checkpoint_id: The checkpoint named.
        pruned_through: The newest checkpoint id the policy deleted in that thread and namespace.
        as_parent: The checkpoint was named as a put's parent.
    """

    def __init__(self, checkpoint_id: str, pruned_through: str, *, as_parent: bool = False) -> None:
        self.checkpoint_id, self.pruned_through, self.as_parent = checkpoint_id, pruned_through, as_parent
        gone = (
            f"checkpoint {checkpoint_id!r} was deleted: this thread keeps only its newest checkpoints "
            f"(--keep-checkpoints, or config.configurable.keep_checkpoints), and those up to "
            f"{pruned_through!r} are gone"
        )
        if as_parent:
            super().__init__(
                f"config.configurable.checkpoint_id: {gone}; a checkpoint on it would become the thread's "
                "head, built on nothing, so nothing was stored. Continue from a checkpoint "
                "get_state_history lists"
            )
        else:
            super().__init__(f"{gone}; travel to a checkpoint get_state_history lists")


def was_pruned(checkpoint_id: str, pruned_through: str | None) -> bool:
    """True when a checkpoint not stored is one the keep-checkpoints policy deleted (ids grow with time,
    compared by code point: the bytes of their UTF-8, as ``COLLATE "C"`` and SQLite compare)."""
    return pruned_through is not None and str(checkpoint_id) <= pruned_through


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


@runtime_checkable
class ScopedRunDeletion(Protocol):
    """A saver whose ``delete_for_runs`` can keep to the threads whose id starts with ``thread_id_prefix``
    (a tenant's): every backend's saver, and the encryption wrappers over them, which pass it on.

    An ``isinstance`` check sees only that the method exists, not its signature.
    """

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None: ...


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
#: The largest count: PostgreSQL's LIMIT and SQLite's integers are signed 64-bit.
MAX_KEEP_CHECKPOINTS = 2**63 - 1


def keep_checkpoints_of(config: Mapping[str, Any], default: int | None) -> int | None:
    """How many newest checkpoints per namespace a put of this config keeps; ``None`` keeps them all.

    ``config["configurable"]["keep_checkpoints"]`` wins when present; otherwise ``default`` (the saver's,
    from ``--keep-checkpoints``) applies. ``0`` keeps every checkpoint, as ``None`` does.

    Raises:
        ValueError: If the configured value is not a whole number from 0 to :data:`MAX_KEEP_CHECKPOINTS`.
    """
    value = (config.get("configurable") or {}).get(KEEP_CHECKPOINTS_KEY)
    if value is None:
        return default or None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_KEEP_CHECKPOINTS:
        raise ValueError(
            f"config.configurable.{KEEP_CHECKPOINTS_KEY} must be a whole number >= 0 and at most "
            f"{MAX_KEEP_CHECKPOINTS} (0 keeps every checkpoint), not {value!r}"
        )
    return value or None


def delta_needs(metadata: Mapping[str, Any] | None) -> frozenset[str]:
    """The DeltaChannels a checkpoint does not hold a value of: those its metadata counts steps for since
    their last snapshot (``counters_since_delta_snapshot``), rebuilt from its ancestors' writes back to
    one. A thread of LangGraph.js (``delta_writes_versioned``) needs all its history: ``{"*"}``, which no
    ancestor provides."""
    metadata = metadata or {}
    if "delta_writes_versioned" in metadata:
        return frozenset({"*"})
    counters = metadata.get("counters_since_delta_snapshot")
    return frozenset(counters) if isinstance(counters, Mapping) else frozenset()


#: An update count LangGraph's loop finds at or past any DeltaChannel's ``snapshot_frequency``.
SNAPSHOT_DUE = 2**31 - 1


def with_snapshots_due(
    metadata: CheckpointMetadata, keep: int | None, snapshotted: Iterable[str] = ()
) -> CheckpointMetadata:
    """The latest checkpoint's metadata as the service answers it when a thread keeps ``keep`` checkpoints.

    LangGraph's loop snapshots a DeltaChannel when the counters it reads from the checkpoint it starts
    from say the channel's updates reached its ``snapshot_frequency``. When a channel's last snapshot is
    ``keep`` or more steps back, every DeltaChannel of the checkpoint (those counted, and ``snapshotted``:
    the ones holding a snapshot there) is answered as due (updates :data:`SNAPSHOT_DUE`), so the run's
    first checkpoint stores every value (LangGraph folds each with the graph's own reducer), holds them
    all, and the checkpoints before it can go. The stored metadata is left as it is; without ``keep``, or
    with every snapshot near, so is the answer.
    """
    counters = metadata.get("counters_since_delta_snapshot")
    if keep is None or not isinstance(counters, Mapping):
        return metadata

    def steps(counted: Any) -> int:
        found = counted[1] if isinstance(counted, (list, tuple)) and len(counted) == 2 else None
        return found if isinstance(found, int) and not isinstance(found, bool) else 0

    if not any(steps(counted) >= keep for counted in counters.values()):
        return metadata
    # Pairs as lists, as stored metadata reads back from JSON (LangGraph's type says tuples).
    due: dict[str, Any] = {channel: [SNAPSHOT_DUE, steps(counted)] for channel, counted in counters.items()}
    due.update({channel: [SNAPSHOT_DUE, 0] for channel in snapshotted if channel not in due})
    return {**metadata, "counters_since_delta_snapshot": due}


def checkpoints_to_drop(
    parents: Mapping[str, str | None], keep: int, needs: Mapping[str, frozenset[str]] | None = None
) -> set[str]:
    """The checkpoints of one namespace that keeping the last ``keep`` deletes.

    ``parents`` maps each checkpoint id of the namespace to its parent's id. Kept: the ``keep`` newest
    (checkpoint ids grow with time), every branch head (a checkpoint no other one names as its parent),
    and the ancestors their DeltaChannels are rebuilt from: ``needs`` maps a checkpoint to the channels it
    does not hold (:func:`delta_needs`); a kept checkpoint that lacks any keeps its parent, which is read
    back as well, so it keeps its own parent in turn while it lacks any, back to a checkpoint that holds
    every channel (one with no counters) or the namespace's first. Every other checkpoint goes.
    """
    newest = set(sorted(parents, reverse=True)[:keep])
    named = {parent for parent in parents.values() if parent is not None}
    kept = newest | (set(parents) - named)
    if needs:
        for checkpoint in list(kept):
            current = checkpoint
            while needs.get(current) and (parent := parents.get(current)) is not None and parent in parents:
                current = parent
                if current in kept and current != checkpoint:
                    break
                kept.add(current)
    return set(parents) - kept


def is_subgraph_call(checkpoint_ns: str) -> bool:
    """A subgraph call's own namespace (``node:task_id``), not a ``checkpointer=True`` subgraph's."""
    return ":" in checkpoint_ns


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
