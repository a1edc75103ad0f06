"""SqliteSaver with ``copy_thread``, ``delete_for_runs`` and ``prune``."""

from __future__ import annotations

import builtins
import json
import sqlite3
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite._delta import DELTA_STAGE1_SQL, build_delta_stage2_sql

from reducing_saver.service.storage.lifecycle import (
    CHECKPOINT_ID_KEY,
    CheckpointPrunedError,
    PlacedHistory,
    ThreadNotEmptyError,
    check_copy_ids,
    check_prune_args,
    check_run_ids,
    checkpoints_to_drop,
    delta_needs,
    is_snapshot_value,
    keep_checkpoints_of,
    parents_root,
    placed_histories,
    refuse_delta_threads,
    was_pruned,
)

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
    """SqliteSaver with ``copy_thread``, ``delete_for_runs`` and ``prune``; constructed like it (``conn``,
    and ``serde`` by keyword, as SqliteSaver takes them), with the service's settings as keyword arguments.

    Each method is one ``BEGIN IMMEDIATE`` transaction under the saver's lock, rolled back on any error
    (SqliteSaver's own ``cursor()`` commits even when its block raises, so it is not used for these).
    Works on connections in autocommit mode (``isolation_level=None``, as the service opens them) and in
    sqlite3's default mode. SqliteSaver keeps the whole checkpoint, values included, in one row: there
    are no blobs to collect. Only the sync methods exist, as on SqliteSaver.

    Args:
        conn: SqliteSaver's: the connection.
        serde: SqliteSaver's: the serializer.
        keep_checkpoints: Keep only the newest this many checkpoints of each thread and namespace, plus
            branch heads and the ancestors their DeltaChannels are rebuilt from (see ``lifecycle``);
            ``None`` keeps every one. A put's ``config["configurable"]["keep_checkpoints"]`` overrides it
            for that thread. ``set_keep_checkpoints`` changes it.
        pruned_table: The service's table of what the keep-checkpoints policy deleted
            (``lifecycle.PRUNED_TABLE``), when the file has it: prunes record there, ``get_tuple``, ``list``
            and a ``put`` naming a deleted checkpoint raise ``CheckpointPrunedError``, and
            ``delete_thread``, ``prune("delete")`` and ``copy_thread`` take the record along. ``None``:
            nothing.
        summaries_table: The service's table of running-summary steps (``storage/summaries.py``), when the
            file has it: ``delete_for_runs`` and ``prune`` then delete, in their transaction, the steps of
            the namespaces they leave without a checkpoint. ``None``: nothing.
    """

    #: The settings (see Args).
    keep_checkpoints: int | None = None
    pruned_table: str | None = None
    summaries_table: str | None = None

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        serde: SerializerProtocol | None = None,
        keep_checkpoints: int | None = None,
        pruned_table: str | None = None,
        summaries_table: str | None = None,
    ) -> None:
        super().__init__(conn, serde=serde)
        self.keep_checkpoints = keep_checkpoints
        self.pruned_table = pruned_table
        self.summaries_table = summaries_table

    def set_keep_checkpoints(self, keep_checkpoints: int | None) -> None:
        """Keep only the newest ``keep_checkpoints`` checkpoints from the next put on (see Args; ``None``:
        every one). The SQLite backend's one saver exists before the service's settings reach it."""
        self.keep_checkpoints = keep_checkpoints

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """SqliteSaver's ``put``; then, when a keep-checkpoints count applies, the checkpoints of the
        put's namespace it drops are deleted in a transaction of their own (``BEGIN IMMEDIATE``: one
        writer of the file at a time, so concurrent puts and prunes of a thread serialize)."""
        keep = keep_checkpoints_of(config, self.keep_checkpoints)
        self._refuse_pruned(config, as_parent=True)
        next_config = super().put(config, checkpoint, metadata, new_versions)
        if keep is not None:
            configurable = next_config["configurable"]
            with self._transaction() as cur:
                self._keep_last(cur, configurable["thread_id"], configurable["checkpoint_ns"], keep)
        return next_config

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """SqliteSaver's; a checkpoint the keep-checkpoints policy deleted raises ``CheckpointPrunedError``."""
        item = super().get_tuple(config)
        if item is None:
            self._refuse_pruned(config)
        return item

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread, and the record of what it pruned, in one
        transaction."""
        with self._transaction() as cur:
            for table in ("checkpoints", "writes", self.pruned_table):
                if table is not None:
                    cur.execute(f"DELETE FROM {table} WHERE thread_id = ?", (str(thread_id),))

    def _refuse_pruned(self, config: RunnableConfig | None, *, as_parent: bool = False) -> None:
        """Raise ``CheckpointPrunedError`` when ``config`` names a checkpoint not stored that the
        keep-checkpoints policy deleted (nothing without ``pruned_table``)."""
        configurable = (config or {}).get("configurable") or {}
        checkpoint_id = configurable.get("checkpoint_id")
        if self.pruned_table is None or not checkpoint_id or configurable.get("thread_id") is None:
            return
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns") or ""
        with self.lock:
            self.setup()
            row = self.conn.execute(
                f"SELECT p.pruned_through FROM {self.pruned_table} p WHERE p.thread_id = ? AND p.checkpoint_ns = ?"
                " AND NOT EXISTS (SELECT 1 FROM checkpoints c"
                " WHERE c.thread_id = ? AND c.checkpoint_ns = ? AND c.checkpoint_id = ?)",
                (thread_id, ns, thread_id, ns, checkpoint_id),
            ).fetchone()
        if row is not None and was_pruned(checkpoint_id, row[0]):
            raise CheckpointPrunedError(checkpoint_id, row[0], as_parent=as_parent)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """SqliteSaver's, plus every thread's checkpoints with one id when ``config`` names only that id
        (``CHECKPOINT_ID_KEY``); a checkpoint the keep-checkpoints policy deleted raises
        ``CheckpointPrunedError``."""
        checkpoint_id = ((config or {}).get("configurable") or {}).get(CHECKPOINT_ID_KEY)
        if checkpoint_id is None:
            found = False
            for item in super().list(config, filter=filter, before=before, limit=limit):
                found = True
                yield item
            if not found:
                self._refuse_pruned(config)
            return
        # SQLite compares text byte by byte: below the id followed by \x01 lie the id itself, then older ones.
        at_most: RunnableConfig = {"configurable": {"checkpoint_id": checkpoint_id + "\x01"}}
        # SqliteSaver.list is a generator; LangGraph annotates it as an Iterator, which has no close().
        with closing(super().list(None, filter=filter, before=at_most)) as items:  # type: ignore[type-var]
            for item in items:
                if item.config["configurable"]["checkpoint_id"] != checkpoint_id:
                    return
                yield item

    def placed_delta_history(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, PlacedHistory]:
        """``get_delta_channel_history`` with the place of every value (``lifecycle.PlacedHistory``): what
        ``EncryptingSaver`` needs to open sealed values. SqliteSaver's two queries: the ancestors, each
        checkpoint read until every channel has found a stored value (its seed), then their writes."""
        channels = list(channels)
        if not channels:
            return {}
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns", "")
        target = get_checkpoint_id(config)
        if not target:
            latest = self.get_tuple(config)
            if latest is None:
                return {channel: PlacedHistory(writes=[]) for channel in channels}
            target = latest.config["configurable"]["checkpoint_id"]
        chain: dict[str, list[str]] = {channel: [] for channel in channels}
        seeds: dict[str, tuple[Any, Any]] = {}
        with self.cursor(transaction=False) as cur:
            cur.execute(DELTA_STAGE1_SQL, (thread_id, ns, target, thread_id, ns))
            walking, seen = set(channels), set[str]()
            for checkpoint_id, type_, blob in cur:
                if checkpoint_id == target and not seen:  # the target itself: its writes come after it
                    seen.add(checkpoint_id)
                    continue
                if checkpoint_id in seen or not walking:  # a loop of re-put ids, or every seed found
                    break
                seen.add(checkpoint_id)
                checkpoint = self.serde.loads_typed((type_, blob))
                values, versions = (
                    checkpoint.get("channel_values") or {},
                    checkpoint.get("channel_versions") or {},
                )
                for channel in list(walking):
                    chain[channel].append(checkpoint_id)
                    if channel in values:
                        seeds[channel] = (versions.get(channel), values[channel])
                        walking.discard(channel)
            with_chain = [channel for channel in channels if chain[channel]]
            rows: list[tuple] = []
            if with_chain:
                sql = build_delta_stage2_sql(
                    has_task_path=self._has_task_path, chain_lens=[len(chain[c]) for c in with_chain]
                )
                params: list[Any] = []
                for channel in with_chain:
                    params += [thread_id, ns, channel, *chain[channel]]
                rows = cur.execute(sql, params).fetchall()
        writes = [
            (checkpoint_id, channel, task_id, idx, task_path, self.serde.loads_typed((type_, value)))
            for checkpoint_id, channel, task_id, idx, type_, value, task_path in rows
        ]
        return placed_histories(channels, chain, writes, seeds)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and pending write of a thread to another thread id, in one transaction.

        Args:
            source_thread_id: The thread to copy.
            target_thread_id: The thread id to copy to; nothing may be stored under it.

        Raises:
            ValueError: If source and target are the same thread id.
            ThreadNotEmptyError: If the target already has checkpoints or writes (nothing copied).
        """
        source, target = check_copy_ids(source_thread_id, target_thread_id)
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
            if self.pruned_table is not None:
                cur.execute(
                    f"INSERT INTO {self.pruned_table} (thread_id, checkpoint_ns, pruned_through)"
                    f" SELECT ?, checkpoint_ns, pruned_through FROM {self.pruned_table} WHERE thread_id = ?",
                    (target, source),
                )

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None:
        """Delete the checkpoints of runs and their pending writes, in one transaction.

        ``thread_id_prefix`` restricts it to threads whose id starts so (the service's tenant scoping).

        A checkpoint belongs to a run when its metadata ``run_id`` is that string. A remaining checkpoint
        whose parent is deleted is left with no parent. The running-summary steps of each namespace left
        without a checkpoint go in the same transaction (``summaries_table``).

        Args:
            run_ids: The run ids; empty deletes nothing.

        Raises:
            TypeError: If ``run_ids`` is a single string.
        """
        runs = check_run_ids(run_ids)
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
                if self.summaries_table is not None:
                    cur.execute(
                        f"DELETE FROM {self.summaries_table} WHERE thread_id = ? AND checkpoint_ns = ? AND NOT EXISTS "
                        "(SELECT 1 FROM checkpoints c WHERE c.thread_id = ? AND c.checkpoint_ns = ?)",
                        (thread_id, ns, thread_id, ns),
                    )

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads, all of them in one transaction.

        ``"delete"`` removes every checkpoint and write of the threads. ``"keep_latest"`` keeps the
        latest checkpoint of each namespace (the one ``get_tuple`` loads) with its pending writes, and
        leaves it with no parent; a subgraph call's namespace (a ``:`` in it) is deleted with the root
        checkpoint its call started from, when that one is saved and pruned. With ``summaries_table``,
        the running-summary steps of every namespace left without a checkpoint go in the same transaction.

        Args:
            thread_ids: The thread IDs to prune.
            strategy: ``"keep_latest"`` or ``"delete"``.

        Raises:
            TypeError: If ``thread_ids`` is a single string.
            ValueError: If ``strategy`` is unknown.
            NotImplementedError: If ``strategy`` is ``"keep_latest"`` and a thread uses a DeltaChannel
                (metadata counters, or a snapshot among its channel values); nothing is pruned then.
        """
        ids = check_prune_args(thread_ids, strategy)
        if not ids:
            return
        with self._transaction() as cur:
            if strategy == "delete":
                for table in ("writes", "checkpoints", self.summaries_table, self.pruned_table):
                    if table is not None:
                        cur.execute(
                            f"DELETE FROM {table} WHERE thread_id IN (SELECT value FROM json_each(?))",
                            (json.dumps(ids),),
                        )
                return
            refuse_delta_threads(self._delta_threads(cur, ids))
            for thread_id in ids:
                self._keep_latest(cur, thread_id)
            self.forget_summaries(cur, ids)

    def forget_summaries(self, cur: sqlite3.Cursor, thread_ids: Sequence[str]) -> None:
        """Delete the running-summary steps of the namespaces of ``thread_ids`` left without a checkpoint
        (nothing without ``summaries_table``)."""
        if self.summaries_table is None or not thread_ids:
            return
        table = self.summaries_table
        cur.execute(
            f"DELETE FROM {table} WHERE thread_id IN (SELECT value FROM json_each(?)) AND NOT EXISTS (SELECT 1 "
            f"FROM checkpoints c WHERE c.thread_id = {table}.thread_id AND c.checkpoint_ns = {table}.checkpoint_ns)",
            (json.dumps(list(thread_ids)),),
        )

    def _delta_threads(self, cur: sqlite3.Cursor, thread_ids: builtins.list[str]) -> set[str]:
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
                if any(is_snapshot_value(v) for v in values.values()):
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
            root = parents_root(json.loads(metadata) if metadata is not None else None)
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

    def _keep_last(self, cur: sqlite3.Cursor, thread_id: str, ns: str, keep: int) -> None:
        rows = cur.execute(
            "SELECT checkpoint_id, parent_checkpoint_id, metadata FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ?",
            (thread_id, ns),
        ).fetchall()
        parents = {checkpoint_id: parent for checkpoint_id, parent, _ in rows}
        needs = {
            checkpoint_id: delta_needs(json.loads(metadata) if metadata is not None else None)
            for checkpoint_id, _, metadata in rows
        }
        doomed = sorted(checkpoints_to_drop(parents, keep, needs))
        if not doomed:
            return
        params = (thread_id, ns, json.dumps(doomed))
        in_doomed = "IN (SELECT value FROM json_each(?))"
        for statement in (
            f"DELETE FROM writes WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id {in_doomed}",
            f"DELETE FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id {in_doomed}",
            "UPDATE checkpoints SET parent_checkpoint_id = NULL"
            f" WHERE thread_id = ? AND checkpoint_ns = ? AND parent_checkpoint_id {in_doomed}",
        ):
            cur.execute(statement, params)
        self._record_pruned(cur, thread_id, ns, doomed[-1])
        if ns == "":
            self._drop_calls_of(cur, thread_id, set(doomed))

    def _record_pruned(self, cur: sqlite3.Cursor, thread_id: str, ns: str, newest: str) -> None:
        """Record that the policy deleted checkpoints of a namespace up to ``newest`` (with ``pruned_table``)."""
        if self.pruned_table is not None:
            cur.execute(
                f"INSERT INTO {self.pruned_table} (thread_id, checkpoint_ns, pruned_through) VALUES (?, ?, ?)"
                " ON CONFLICT (thread_id, checkpoint_ns)"
                " DO UPDATE SET pruned_through = max(pruned_through, excluded.pruned_through)",
                (thread_id, ns, newest),
            )

    def _drop_calls_of(self, cur: sqlite3.Cursor, thread_id: str, roots: set[str]) -> None:
        """Delete the namespaces of subgraph calls that started from the root checkpoints ``roots``."""
        heads = cur.execute(
            "SELECT checkpoint_ns, metadata FROM checkpoints WHERE thread_id = ? AND instr(checkpoint_ns, ':') > 0"
            " AND checkpoint_id = (SELECT MAX(h.checkpoint_id) FROM checkpoints h"
            " WHERE h.thread_id = checkpoints.thread_id AND h.checkpoint_ns = checkpoints.checkpoint_ns)",
            (thread_id,),
        ).fetchall()
        for call_ns, metadata in heads:
            if parents_root(json.loads(metadata) if metadata is not None else None) in roots:
                (newest,) = cur.execute(
                    "SELECT max(checkpoint_id) FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ?",
                    (thread_id, call_ns),
                ).fetchone()
                self._record_pruned(cur, thread_id, call_ns, newest)
                for table in ("writes", "checkpoints"):
                    cur.execute(
                        f"DELETE FROM {table} WHERE thread_id = ? AND checkpoint_ns = ?", (thread_id, call_ns)
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
