"""The service's inner savers: LangGraph's savers plus the thread-lifecycle capabilities.

``copy_thread``, ``delete_for_runs`` and ``prune`` (strategies ``"keep_latest"`` and ``"delete"``) on
each backend the service hosts, each call one transaction against the backend's own tables:

* :class:`PostgresLifecycleSaver` adds ``copy_thread`` and ``delete_for_runs`` to PostgresSaver and
  keeps its ``prune``, with one more DeltaChannel check before it (see :meth:`~PostgresLifecycleSaver.prune`).
* :class:`SqliteLifecycleSaver` adds all three to SqliteSaver.
* :class:`InMemoryLifecycleSaver` adds all three (and their async twins, as InMemorySaver has async
  twins for everything) to InMemorySaver, and serializes every call on one lock.

Semantics, the same on every backend:

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

A DeltaChannel leaves ``counters_since_delta_snapshot`` (LangGraph.js: ``delta_writes_versioned``) in
checkpoint metadata, except on checkpoints that snapshot every delta channel; a snapshot is a value that
serializes to msgpack extension 7 as a whole. The service stores client blobs verbatim
(:class:`~reducing_saver.service.serde.VerbatimSerde`), so snapshots are recognized from their bytes,
not only as ``_DeltaSnapshot`` objects.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
)
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.base import PRUNE_DELTA_THREADS_SQL, PRUNE_STRATEGIES
from langgraph.checkpoint.serde.types import _DeltaSnapshot
from langgraph.checkpoint.sqlite import SqliteSaver

from reducing_saver.client._wire import Blob

__all__ = [
    "InMemoryLifecycleSaver",
    "PostgresLifecycleSaver",
    "SqliteLifecycleSaver",
    "ThreadNotEmptyError",
]

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


def _thread_ids(thread_ids: Sequence[str], strategy: str) -> list[str]:
    """``prune``'s arguments checked as PostgresSaver checks them."""
    if isinstance(thread_ids, str):
        raise TypeError("thread_ids must be a sequence of thread IDs, not a str")
    if strategy not in PRUNE_STRATEGIES:
        raise ValueError(f"Unknown prune strategy: {strategy!r}")
    return list(dict.fromkeys(str(t) for t in thread_ids))


def _run_ids(run_ids: Sequence[str]) -> list[str]:
    if isinstance(run_ids, str):
        raise TypeError("run_ids must be a sequence of run IDs, not a str")
    return list(dict.fromkeys(str(r) for r in run_ids))


def _copy_ids(source_thread_id: str, target_thread_id: str) -> tuple[str, str]:
    source, target = str(source_thread_id), str(target_thread_id)
    if source == target:
        raise ValueError(f"copy_thread: source and target are the same thread {source!r}")
    return source, target


#: ``config["configurable"]`` key that makes the PostgreSQL saver's ``list`` keep only thread ids with
#: this prefix (set by ``service/security.py`` for a tenant's list across threads; never by agents).
THREAD_PREFIX_KEY = "__thread_id_prefix__"


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape ``\\``) for strings starting with ``prefix``."""
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _refuse(delta_threads: Iterable[str]) -> None:
    if found := sorted(set(delta_threads)):
        raise NotImplementedError(
            f"keep_latest can't prune threads that use a DeltaChannel: {', '.join(found)}"
        )


def _run_id(metadata: Mapping[str, Any] | None) -> str | None:
    run_id = (metadata or {}).get("run_id")
    return run_id if isinstance(run_id, str) else None


def _has_delta_metadata(metadata: Mapping[str, Any] | None) -> bool:
    return any(key in (metadata or {}) for key in DELTA_METADATA_KEYS)


# Offset of the type byte in each msgpack extension header: fixext 1/2/4/8/16, ext 8/16/32.
_EXT_TYPE_OFFSET = {0xD4: 1, 0xD5: 1, 0xD6: 1, 0xD7: 1, 0xD8: 1, 0xC7: 2, 0xC8: 3, 0xC9: 5}


def _is_snapshot_blob(type_: str, data: bytes | None) -> bool:
    """True for a serialized value that is, as a whole, a DeltaChannel snapshot."""
    if type_ != "msgpack" or not data:
        return False
    offset = _EXT_TYPE_OFFSET.get(data[0])
    return offset is not None and len(data) > offset and data[offset] == EXT_DELTA_SNAPSHOT


def _is_snapshot_value(value: Any) -> bool:
    """A channel value as a saver's serde loads it: a ``_DeltaSnapshot``, or a client blob of one."""
    if isinstance(value, _DeltaSnapshot):
        return True
    return isinstance(value, Blob) and _is_snapshot_blob(value.type, value.data)


def _parents_root(metadata: Mapping[str, Any] | None) -> str | None:
    """The root graph's checkpoint a subgraph call started from (metadata ``parents[""]``)."""
    parents = (metadata or {}).get("parents")
    root = parents.get("") if isinstance(parents, Mapping) else None
    return root if isinstance(root, str) else None


# -- PostgreSQL --------------------------------------------------------------------------------------

# Two-key advisory locks live apart from one-key ones (the service's set-up lock is one key).
_COPY_LOCK_CLASS = 0x72736374  # "rsct"
_COPY_LOCK_SQL = "SELECT pg_advisory_xact_lock(%s, hashtext(%s))"

_PG_THREAD_IN_USE_SQL = """
SELECT EXISTS (SELECT 1 FROM checkpoints WHERE thread_id = %s)
    OR EXISTS (SELECT 1 FROM checkpoint_blobs WHERE thread_id = %s)
    OR EXISTS (SELECT 1 FROM checkpoint_writes WHERE thread_id = %s) AS in_use
"""

# One statement, so the three tables are read on one snapshot of the source thread.
_PG_COPY_THREAD_SQL = """
WITH c AS (
    INSERT INTO checkpoints
        (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata)
    SELECT %(target)s, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata
    FROM checkpoints WHERE thread_id = %(source)s
    RETURNING 1
), b AS (
    INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
    SELECT %(target)s, checkpoint_ns, channel, version, type, blob
    FROM checkpoint_blobs WHERE thread_id = %(source)s
    RETURNING 1
), w AS (
    INSERT INTO checkpoint_writes
        (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob)
    SELECT %(target)s, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob
    FROM checkpoint_writes WHERE thread_id = %(source)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM c) AS checkpoints,
       (SELECT count(*) FROM b) AS blobs,
       (SELECT count(*) FROM w) AS writes
"""

_PG_DELETE_RUN_CHECKPOINTS_SQL = """
DELETE FROM checkpoints
WHERE jsonb_typeof(metadata -> 'run_id') = 'string' AND metadata ->> 'run_id' = ANY(%s)
  AND (%s::text IS NULL OR thread_id LIKE %s ESCAPE '\\')
RETURNING thread_id, checkpoint_ns, checkpoint_id, checkpoint -> 'channel_versions' AS versions
"""

_PG_DELETE_WRITES_SQL = """
DELETE FROM checkpoint_writes
WHERE thread_id = %s AND checkpoint_ns = %s AND checkpoint_id = ANY(%s)
"""

_PG_DETACH_CHILDREN_SQL = """
UPDATE checkpoints SET parent_checkpoint_id = NULL
WHERE thread_id = %s AND checkpoint_ns = %s AND parent_checkpoint_id = ANY(%s)
"""

_PG_REFERENCED_BLOBS_SQL = """
SELECT DISTINCT v.key AS channel, v.value AS version
FROM checkpoints c
CROSS JOIN LATERAL jsonb_each_text(c.checkpoint -> 'channel_versions') AS v
WHERE c.thread_id = %s AND c.checkpoint_ns = %s
"""

_PG_DELETE_BLOBS_SQL = """
DELETE FROM checkpoint_blobs
WHERE thread_id = %s AND checkpoint_ns = %s AND channel = %s AND version = ANY(%s)
"""

# PostgresSaver marks a `_DeltaSnapshot` with an inline `true`; a snapshot stored verbatim from a client
# blob has no such marker, only its bytes: msgpack extension 7 as the whole value. CASE keeps the reads
# inside the value.
_PG_SNAPSHOT_BLOB_THREADS_SQL = f"""
SELECT DISTINCT thread_id FROM checkpoint_blobs
WHERE thread_id = ANY(%s) AND type = 'msgpack' AND CASE
    WHEN length(blob) < 2 THEN false
    WHEN get_byte(blob, 0) BETWEEN 212 AND 216 THEN get_byte(blob, 1) = {EXT_DELTA_SNAPSHOT}
    WHEN length(blob) < 3 THEN false
    WHEN get_byte(blob, 0) = 199 THEN get_byte(blob, 2) = {EXT_DELTA_SNAPSHOT}
    WHEN length(blob) < 4 THEN false
    WHEN get_byte(blob, 0) = 200 THEN get_byte(blob, 3) = {EXT_DELTA_SNAPSHOT}
    WHEN length(blob) < 6 THEN false
    WHEN get_byte(blob, 0) = 201 THEN get_byte(blob, 5) = {EXT_DELTA_SNAPSHOT}
    ELSE false
END
"""


def _versions_by_group(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], tuple[list[str], set]]:
    """Deleted checkpoint rows grouped by (thread, namespace): their ids and the blobs they referenced."""
    groups: dict[tuple[str, str], tuple[list[str], set]] = {}
    for row in rows:
        ids, freed = groups.setdefault((row["thread_id"], row["checkpoint_ns"]), ([], set()))
        ids.append(row["checkpoint_id"])
        freed.update((channel, str(version)) for channel, version in (row["versions"] or {}).items())
    return groups


class PostgresLifecycleSaver(PostgresSaver):
    """PostgresSaver with ``copy_thread`` and ``delete_for_runs``; constructed exactly like it.

    Each method runs in one transaction on one connection, under the saver's lock, as
    ``PostgresSaver.prune`` does. Only the sync methods exist, as on PostgresSaver.
    """

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, blob and pending write of a thread to another thread id.

        Ids, parents, metadata and values are copied unchanged, with the thread id replaced, in one
        transaction: the source is read on one snapshot, and concurrent copies to one target are
        serialized. A source with nothing stored copies nothing.

        Args:
            source_thread_id: The thread to copy.
            target_thread_id: The thread id to copy to; nothing may be stored under it.

        Raises:
            ValueError: If source and target are the same thread id.
            ThreadNotEmptyError: If the target already has checkpoints, blobs or writes (nothing copied).
        """
        source, target = _copy_ids(source_thread_id, target_thread_id)
        with self._transaction() as cur:
            cur.execute(_COPY_LOCK_SQL, (_COPY_LOCK_CLASS, target), prepare=False)
            cur.execute(_PG_THREAD_IN_USE_SQL, (target, target, target), prepare=False)
            if cur.fetchone()["in_use"]:
                raise ThreadNotEmptyError(target)
            cur.execute(_PG_COPY_THREAD_SQL, {"source": source, "target": target}, prepare=False)

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None:
        """Delete the checkpoints of runs, their pending writes, and the blobs only they referenced.

        ``thread_id_prefix`` (the service's tenant scoping) restricts it to threads whose id starts so.
        A checkpoint belongs to a run when its metadata ``run_id`` is that string. Blobs a deleted
        checkpoint referenced stay while any remaining checkpoint of the same thread and namespace
        references them; a remaining checkpoint whose parent is deleted is left with no parent. All in
        one transaction. Like ``prune``, deleting checkpoints a run in progress is building on is not
        safe.

        Args:
            run_ids: The run ids; empty deletes nothing.

        Raises:
            TypeError: If ``run_ids`` is a single string.
        """
        runs = _run_ids(run_ids)
        if not runs:
            return
        with self._transaction() as cur:
            like = None if thread_id_prefix is None else _like_prefix(thread_id_prefix)
            cur.execute(_PG_DELETE_RUN_CHECKPOINTS_SQL, (runs, like, like), prepare=False)
            groups = _versions_by_group(cur.fetchall())
            for (thread_id, ns), (ids, freed) in sorted(groups.items()):
                cur.execute(_PG_DELETE_WRITES_SQL, (thread_id, ns, ids), prepare=False)
                cur.execute(_PG_DETACH_CHILDREN_SQL, (thread_id, ns, ids), prepare=False)
                cur.execute(_PG_REFERENCED_BLOBS_SQL, (thread_id, ns), prepare=False)
                referenced = {(r["channel"], r["version"]) for r in cur.fetchall()}
                garbage: dict[str, list[str]] = defaultdict(list)
                for channel, version in sorted(freed - referenced):
                    garbage[channel].append(version)
                for channel, versions in garbage.items():
                    cur.execute(_PG_DELETE_BLOBS_SQL, (thread_id, ns, channel, versions), prepare=False)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``PostgresSaver.prune``, refusing also DeltaChannel snapshots stored verbatim.

        PostgresSaver recognizes a thread that uses a DeltaChannel by its metadata counters, or by the
        inline marker its own ``put`` leaves for a ``_DeltaSnapshot``. A saver with a pass-through serde
        (the service's) stores a client's snapshot as an ordinary blob, so ``keep_latest`` first looks for
        blobs that are a snapshot as a whole, in all requested threads, before anything is pruned.
        Everything else is PostgresSaver's: see its docstring.

        Raises:
            TypeError: If ``thread_ids`` is a single string.
            ValueError: If ``strategy`` is unknown.
            NotImplementedError: If ``strategy`` is ``"keep_latest"`` and a thread uses a DeltaChannel.
        """
        ids = _thread_ids(thread_ids, strategy)
        if ids and strategy == "keep_latest":
            with self._cursor() as cur:
                cur.execute(PRUNE_DELTA_THREADS_SQL, (ids, ids), prepare=False)
                delta = [r["thread_id"] for r in cur.fetchall()]
                cur.execute(_PG_SNAPSHOT_BLOB_THREADS_SQL, (ids,), prepare=False)
                delta += [r["thread_id"] for r in cur.fetchall()]
            _refuse(delta)
        super().prune(ids, strategy=strategy)

    def _search_where(
        self, config: RunnableConfig | None, filter: Any, before: RunnableConfig | None = None
    ) -> tuple[str, list[Any]]:
        """PostgresSaver's, plus ``thread_id LIKE prefix%`` when ``config`` names only a thread-id prefix
        (``THREAD_PREFIX_KEY``: the service lists one tenant's threads in the query, before the LIMIT)."""
        prefix = ((config or {}).get("configurable") or {}).get(THREAD_PREFIX_KEY)
        if prefix is None:
            return super()._search_where(config, filter, before)
        where, params = super()._search_where(None, filter, before)
        clause = "thread_id LIKE %s ESCAPE '\\'"
        where = f"{where} AND {clause}" if where else f"WHERE {clause}"
        return where, [*params, _like_prefix(prefix)]

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        """A cursor inside one transaction, as ``PostgresSaver.prune`` opens it."""
        with self._cursor() as cur:
            if self.pipe:
                # In pipeline mode the transaction would take in what ran since the last sync.
                self.pipe.sync()
            with cur.connection.transaction():
                yield cur


# -- SQLite ----------------------------------------------------------------------------------------

_SQ_METADATA = "CAST(metadata AS TEXT)"
_SQ_DELTA_METADATA_THREADS_SQL = f"""
SELECT DISTINCT thread_id FROM checkpoints
WHERE thread_id IN (SELECT value FROM json_each(?)) AND (
    json_type({_SQ_METADATA}, '$.counters_since_delta_snapshot') IS NOT NULL
    OR json_type({_SQ_METADATA}, '$.delta_writes_versioned') IS NOT NULL
)
"""
_SQ_RUN_CHECKPOINTS_SQL = f"""
SELECT thread_id, checkpoint_ns, checkpoint_id FROM checkpoints
WHERE json_type({_SQ_METADATA}, '$.run_id') = 'text'
AND json_extract({_SQ_METADATA}, '$.run_id') IN (SELECT value FROM json_each(?))
"""


class SqliteLifecycleSaver(SqliteSaver):
    """SqliteSaver with ``copy_thread``, ``delete_for_runs`` and ``prune``; constructed exactly like it.

    Each method is one ``BEGIN IMMEDIATE`` transaction under the saver's lock, rolled back on any error
    (SqliteSaver's own ``cursor()`` commits even when its block raises, so it is not used for these).
    Works on connections in autocommit mode (``isolation_level=None``, as the service opens them) and in
    sqlite3's default mode. SqliteSaver keeps the whole checkpoint, values included, in one row: there
    are no blobs to collect. Only the sync methods exist, as on SqliteSaver.
    """

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and pending write of a thread to another thread id, in one transaction.

        Args:
            source_thread_id: The thread to copy.
            target_thread_id: The thread id to copy to; nothing may be stored under it.

        Raises:
            ValueError: If source and target are the same thread id.
            ThreadNotEmptyError: If the target already has checkpoints or writes (nothing copied).
        """
        source, target = _copy_ids(source_thread_id, target_thread_id)
        path = "task_path, " if self._has_task_path else ""
        with self._transaction() as cur:
            cur.execute(
                "SELECT EXISTS (SELECT 1 FROM checkpoints WHERE thread_id = ?)"
                " OR EXISTS (SELECT 1 FROM writes WHERE thread_id = ?)",
                (target, target),
            )
            if cur.fetchone()[0]:
                raise ThreadNotEmptyError(target)
            cur.execute(
                "INSERT INTO checkpoints"
                " (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata)"
                " SELECT ?, checkpoint_ns, checkpoint_id, parent_checkpoint_id, type, checkpoint, metadata"
                " FROM checkpoints WHERE thread_id = ?",
                (target, source),
            )
            cur.execute(
                f"INSERT INTO writes (thread_id, checkpoint_ns, checkpoint_id, task_id, {path}idx, channel, type, value)"
                f" SELECT ?, checkpoint_ns, checkpoint_id, task_id, {path}idx, channel, type, value"
                " FROM writes WHERE thread_id = ?",
                (target, source),
            )

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None:
        """Delete the checkpoints of runs and their pending writes, in one transaction.

        ``thread_id_prefix`` restricts it to threads whose id starts so (the service's tenant scoping).

        A checkpoint belongs to a run when its metadata ``run_id`` is that string. A remaining checkpoint
        whose parent is deleted is left with no parent.

        Args:
            run_ids: The run ids; empty deletes nothing.

        Raises:
            TypeError: If ``run_ids`` is a single string.
        """
        runs = _run_ids(run_ids)
        if not runs:
            return
        with self._transaction() as cur:
            groups: dict[tuple[str, str], list[str]] = defaultdict(list)
            for thread_id, ns, checkpoint_id in cur.execute(
                _SQ_RUN_CHECKPOINTS_SQL, (json.dumps(runs),)
            ).fetchall():
                if thread_id_prefix is None or thread_id.startswith(thread_id_prefix):
                    groups[(thread_id, ns)].append(checkpoint_id)
            for (thread_id, ns), ids in sorted(groups.items()):
                params = (thread_id, ns, json.dumps(ids))
                in_ids = "IN (SELECT value FROM json_each(?))"
                cur.execute(
                    f"DELETE FROM writes WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id {in_ids}",
                    params,
                )
                cur.execute(
                    f"DELETE FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id {in_ids}",
                    params,
                )
                cur.execute(
                    "UPDATE checkpoints SET parent_checkpoint_id = NULL"
                    f" WHERE thread_id = ? AND checkpoint_ns = ? AND parent_checkpoint_id {in_ids}",
                    params,
                )

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads, all of them in one transaction.

        ``"delete"`` removes every checkpoint and write of the threads. ``"keep_latest"`` keeps the
        latest checkpoint of each namespace (the one ``get_tuple`` loads) with its pending writes, and
        leaves it with no parent; a subgraph call's namespace (a ``:`` in it) is deleted with the root
        checkpoint its call started from, when that one is saved and pruned.

        Args:
            thread_ids: The thread IDs to prune.
            strategy: ``"keep_latest"`` or ``"delete"``.

        Raises:
            TypeError: If ``thread_ids`` is a single string.
            ValueError: If ``strategy`` is unknown.
            NotImplementedError: If ``strategy`` is ``"keep_latest"`` and a thread uses a DeltaChannel
                (metadata counters, or a snapshot among its channel values); nothing is pruned then.
        """
        ids = _thread_ids(thread_ids, strategy)
        if not ids:
            return
        with self._transaction() as cur:
            if strategy == "delete":
                for table in ("writes", "checkpoints"):
                    cur.execute(
                        f"DELETE FROM {table} WHERE thread_id IN (SELECT value FROM json_each(?))",
                        (json.dumps(ids),),
                    )
                return
            _refuse(self._delta_threads(cur, ids))
            for thread_id in ids:
                self._keep_latest(cur, thread_id)

    def _delta_threads(self, cur: sqlite3.Cursor, thread_ids: list[str]) -> set[str]:
        found = {
            r[0] for r in cur.execute(_SQ_DELTA_METADATA_THREADS_SQL, (json.dumps(thread_ids),)).fetchall()
        }
        for thread_id in thread_ids:
            if thread_id in found:
                continue
            # No counters: look for a snapshot among the channel values, which live in the checkpoint.
            rows = cur.execute("SELECT type, checkpoint FROM checkpoints WHERE thread_id = ?", (thread_id,))
            for type_, blob in rows:
                values = self.serde.loads_typed((type_, blob)).get("channel_values") or {}
                if any(_is_snapshot_value(v) for v in values.values()):
                    found.add(thread_id)
                    break
        return found

    @staticmethod
    def _keep_latest(cur: sqlite3.Cursor, thread_id: str) -> None:
        heads = dict(
            cur.execute(
                "SELECT checkpoint_ns, MAX(checkpoint_id) FROM checkpoints WHERE thread_id = ? GROUP BY checkpoint_ns",
                (thread_id,),
            ).fetchall()
        )
        calls = set()
        for ns, head in heads.items():
            if ":" not in ns:
                continue
            (metadata,) = cur.execute(
                "SELECT metadata FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
                (thread_id, ns, head),
            ).fetchone()
            root = _parents_root(json.loads(metadata) if metadata is not None else None)
            if root is None or root == heads.get(""):
                continue
            root_saved = cur.execute(
                "SELECT 1 FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?",
                (thread_id, root),
            ).fetchone()
            if root_saved:
                calls.add(ns)
        for ns, head in sorted(heads.items()):
            if ns in calls:
                for table in ("writes", "checkpoints"):
                    cur.execute(
                        f"DELETE FROM {table} WHERE thread_id = ? AND checkpoint_ns = ?", (thread_id, ns)
                    )
                continue
            params = (thread_id, ns, head)
            cur.execute(
                "DELETE FROM writes WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id IN ("
                " SELECT checkpoint_id FROM checkpoints"
                " WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id <> ?)",
                (thread_id, ns, *params),
            )
            cur.execute(
                "DELETE FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id <> ?",
                params,
            )
            cur.execute(
                "UPDATE checkpoints SET parent_checkpoint_id = NULL"
                " WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ? AND parent_checkpoint_id IS NOT NULL",
                params,
            )

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """A cursor inside ``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back if the block raises."""
        with self.lock:
            self.setup()
            conn = self.conn
            if getattr(conn, "autocommit", None) is False:
                # Python 3.12+ PEP 249 mode: a transaction is always open; start from a fresh one.
                conn.commit()
            else:
                if conn.in_transaction:
                    # SqliteSaver commits after each of its writes; finish what was left open.
                    conn.commit()
                conn.execute("BEGIN IMMEDIATE")
            cur = conn.cursor()
            try:
                yield cur
            except BaseException:
                conn.rollback()
                raise
            else:
                conn.commit()
            finally:
                cur.close()


# -- in memory -------------------------------------------------------------------------------------


class _Changes:
    """Dictionary changes computed under the lock, applied only once all are computed."""

    def __init__(self) -> None:
        self.namespaces: dict[tuple[str, str], dict[str, tuple] | None] = {}
        self.writes: dict[tuple[str, str, str], dict | None] = {}
        self.blobs: dict[tuple[str, str, str, Any], tuple[str, bytes] | None] = {}


class InMemoryLifecycleSaver(InMemorySaver):
    """InMemorySaver with ``copy_thread``, ``delete_for_runs`` and ``prune`` and their async twins.

    Constructed exactly like InMemorySaver. Every method runs under one re-entrant lock (``lock``), so
    the lifecycle methods, which compute all their changes before applying any, are atomic to every
    other call. ``list`` collects its results under the lock and yields them after.
    """

    def __init__(self, *, serde: Any = None, factory: type[defaultdict] = defaultdict) -> None:
        super().__init__(serde=serde, factory=factory)
        self.lock = threading.RLock()

    # -- the base methods, under the lock ----------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        with self.lock:
            return super().get_tuple(config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        with self.lock:
            items = [*super().list(config, filter=filter, before=before, limit=limit)]
        yield from items

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        with self.lock:
            return super().put(config, checkpoint, metadata, new_versions)

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        with self.lock:
            super().put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        with self.lock:
            super().delete_thread(thread_id)

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        with self.lock:
            return super().get_delta_channel_history(config=config, channels=channels)

    # -- lifecycle -----------------------------------------------------------------------------------

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, blob and pending write of a thread to another thread id, atomically.

        Args:
            source_thread_id: The thread to copy.
            target_thread_id: The thread id to copy to; nothing may be stored under it.

        Raises:
            ValueError: If source and target are the same thread id.
            ThreadNotEmptyError: If the target already has checkpoints, blobs or writes (nothing copied).
        """
        source, target = _copy_ids(source_thread_id, target_thread_id)
        with self.lock:
            if self._in_use(target):
                raise ThreadNotEmptyError(target)
            changes = _Changes()
            for ns, checkpoints in self.storage.get(source, {}).items():
                if checkpoints:
                    changes.namespaces[(target, ns)] = dict(checkpoints)
            for (thread_id, ns, checkpoint_id), writes in self.writes.items():
                if thread_id == source and writes:
                    changes.writes[(target, ns, checkpoint_id)] = dict(writes)
            for (thread_id, ns, channel, version), blob in self.blobs.items():
                if thread_id == source:
                    changes.blobs[(target, ns, channel, version)] = blob
            self._apply(changes)

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None:
        """Delete the checkpoints of runs, their pending writes, and the blobs only they referenced.

        Same rules as :meth:`PostgresLifecycleSaver.delete_for_runs` (``thread_id_prefix`` included),
        atomically.

        Raises:
            TypeError: If ``run_ids`` is a single string.
        """
        runs = set(_run_ids(run_ids))
        if not runs:
            return
        with self.lock:
            changes = _Changes()
            for thread_id, namespaces in self.storage.items():
                if thread_id_prefix is not None and not thread_id.startswith(thread_id_prefix):
                    continue
                for ns, checkpoints in namespaces.items():
                    doomed = {
                        checkpoint_id
                        for checkpoint_id, (_, metadata, _) in checkpoints.items()
                        if _run_id(self.serde.loads_typed(metadata)) in runs
                    }
                    if doomed:
                        self._drop(changes, thread_id, ns, doomed, detach_all=False)
            self._apply(changes)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads, all of them atomically. Same rules as :meth:`SqliteLifecycleSaver.prune`,
        and blobs go as in PostgresSaver: those a deleted checkpoint referenced and a kept one does not.

        Raises:
            TypeError: If ``thread_ids`` is a single string.
            ValueError: If ``strategy`` is unknown.
            NotImplementedError: If ``strategy`` is ``"keep_latest"`` and a thread uses a DeltaChannel
                (metadata counters, or a snapshot blob); nothing is pruned then.
        """
        ids = _thread_ids(thread_ids, strategy)
        if not ids:
            return
        with self.lock:
            changes = _Changes()
            if strategy == "delete":
                for thread_id in ids:
                    for ns in self.storage.get(thread_id, {}):
                        self._wipe(changes, thread_id, ns)
                    self._wipe(changes, thread_id, None)
            else:
                _refuse(self._delta_threads(ids))
                for thread_id in ids:
                    self._keep_latest(changes, thread_id)
            self._apply(changes)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        return self.copy_thread(source_thread_id, target_thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        return self.delete_for_runs(run_ids)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        return self.prune(thread_ids, strategy=strategy)

    # -- helpers (the lock is held) ------------------------------------------------------------------

    def _in_use(self, thread_id: str) -> bool:
        return (
            any(self.storage.get(thread_id, {}).values())
            or any(key[0] == thread_id and writes for key, writes in self.writes.items())
            or any(key[0] == thread_id for key in self.blobs)
        )

    def _delta_threads(self, thread_ids: list[str]) -> set[str]:
        found = set()
        for thread_id in thread_ids:
            for checkpoints in self.storage.get(thread_id, {}).values():
                if any(_has_delta_metadata(self.serde.loads_typed(m)) for _, m, _ in checkpoints.values()):
                    found.add(thread_id)
        wanted = set(thread_ids)
        for (thread_id, *_), (type_, data) in self.blobs.items():
            if thread_id in wanted and _is_snapshot_blob(type_, data):
                found.add(thread_id)
        return found

    def _keep_latest(self, changes: _Changes, thread_id: str) -> None:
        namespaces = {ns: cps for ns, cps in self.storage.get(thread_id, {}).items() if cps}
        heads = {ns: max(checkpoints) for ns, checkpoints in namespaces.items()}
        root_checkpoints = namespaces.get("", {})
        for ns, checkpoints in namespaces.items():
            head = heads[ns]
            if ":" in ns:
                root = _parents_root(self.serde.loads_typed(checkpoints[head][1]))
                if root is not None and root != heads.get("") and root in root_checkpoints:
                    self._wipe(changes, thread_id, ns)
                    continue
            self._drop(changes, thread_id, ns, set(checkpoints) - {head}, detach_all=True)

    def _drop(
        self, changes: _Changes, thread_id: str, ns: str, doomed: set[str], *, detach_all: bool
    ) -> None:
        """Plan deleting checkpoints ``doomed`` of one namespace, their writes and the blobs they free.

        Remaining checkpoints whose parent is deleted lose it; with ``detach_all``, all of them do.
        """
        checkpoints = self.storage[thread_id][ns]
        remaining: dict[str, tuple] = {}
        for checkpoint_id, (checkpoint, metadata, parent) in checkpoints.items():
            if checkpoint_id in doomed:
                continue
            if parent is not None and (detach_all or parent in doomed):
                parent = None
            remaining[checkpoint_id] = (checkpoint, metadata, parent)
        freed = {
            (channel, version)
            for checkpoint_id in doomed
            for channel, version in self.serde.loads_typed(checkpoints[checkpoint_id][0])[
                "channel_versions"
            ].items()
        }
        referenced = {
            (channel, version)
            for checkpoint, _, _ in remaining.values()
            for channel, version in self.serde.loads_typed(checkpoint)["channel_versions"].items()
        }
        changes.namespaces[(thread_id, ns)] = remaining
        for checkpoint_id in doomed:
            changes.writes[(thread_id, ns, checkpoint_id)] = None
        for channel, version in freed - referenced:
            changes.blobs[(thread_id, ns, channel, version)] = None

    def _wipe(self, changes: _Changes, thread_id: str, ns: str | None) -> None:
        """Plan deleting everything of one namespace (``None``: of every namespace) of a thread."""
        if ns is not None:
            changes.namespaces[(thread_id, ns)] = None
        for key in self.writes:
            if key[0] == thread_id and (ns is None or key[1] == ns):
                changes.writes[key] = None
        for key in self.blobs:
            if key[0] == thread_id and (ns is None or key[1] == ns):
                changes.blobs[key] = None

    def _apply(self, changes: _Changes) -> None:
        """Apply planned changes: plain dictionary updates that cannot fail half way."""
        for (thread_id, ns), checkpoints in changes.namespaces.items():
            if checkpoints:
                self.storage[thread_id][ns] = checkpoints
            elif thread_id in self.storage:
                self.storage[thread_id].pop(ns, None)
                if not self.storage[thread_id]:
                    del self.storage[thread_id]
        for key, writes in changes.writes.items():
            if writes:
                self.writes[key] = writes
            else:
                self.writes.pop(key, None)
        for key, blob in changes.blobs.items():
            if blob is not None:
                self.blobs[key] = blob
            else:
                self.blobs.pop(key, None)
