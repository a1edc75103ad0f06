"""PostgresSaver with ``copy_thread`` and ``delete_for_runs``, ``prune`` that also refuses DeltaChannel
snapshots stored verbatim, and reads of a thread's latest checkpoint answered from the process's
latest-checkpoint cache once proven (``postgres/latest.py``); its SQL lives in ``postgres/sql.py``.
"""

from __future__ import annotations

import builtins
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, closing, contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
)
from langgraph.checkpoint.postgres import PostgresSaver, _internal
from langgraph.checkpoint.postgres.base import PRUNE_DELETE_THREADS_SQL, PRUNE_DELTA_THREADS_SQL
from langgraph.checkpoint.serde.base import SerializerProtocol
from psycopg.rows import dict_row

from reducing_saver.service.storage.latest import LatestCache
from reducing_saver.service.storage.lifecycle import (
    CHECKPOINT_ID_KEY,
    THREAD_PREFIX_KEY,
    CheckpointPrunedError,
    PlacedHistory,
    ThreadNotEmptyError,
    check_copy_ids,
    check_prune_args,
    check_run_ids,
    keep_checkpoints_of,
    like_prefix,
    placed_histories,
    refuse_delta_threads,
    was_pruned,
)
from reducing_saver.service.storage.outbox import CheckpointRecords
from reducing_saver.service.storage.postgres import latest
from reducing_saver.service.storage.postgres.outbox import insert_entries
from reducing_saver.service.storage.postgres.sql import (
    COPY_LOCK_CLASS,
    COPY_LOCK_SQL,
    COPY_THREAD_SQL,
    DELETE_BLOBS_SQL,
    DELETE_RUN_CHECKPOINTS_SQL,
    DELETE_WRITES_SQL,
    DETACH_CHILDREN_SQL,
    FORGET_NAMESPACE_SUMMARIES_SQL,
    FORGET_THREAD_SUMMARIES_SQL,
    KEEP_LAST_RECORDING_SQL,
    KEEP_LAST_SQL,
    KEEP_LOCK_CLASS,
    KEEP_LOCK_SQL,
    PRUNED_PARENT_SQLSTATE,
    PRUNED_THROUGH_SQL,
    REFERENCED_BLOBS_SQL,
    SNAPSHOT_BLOB_THREADS_SQL,
    THREAD_IN_USE_SQL,
)


class _Probe:
    """A statement run last in a write's pipeline (its transaction), and the row it read; with no
    statement, the row the write's own last statement returned."""

    __slots__ = ("sql", "params", "row")

    def __init__(self, sql: str | None = None, params: tuple[Any, ...] = ()) -> None:
        self.sql, self.params = sql, params
        self.row: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class _WritePlan:
    """What one write's pipeline runs around the write's own statements (``_queued``), in this order.

    Attributes:
        check_parent: A put whose checkpoint row is written by ``latest.UPSERT_CHECKING_PARENT_SQL``: a
            parent the keep-checkpoints policy deleted fails the pipeline, in the upsert's own statement.
        forget_pruned: The thread a ``delete_thread`` takes the record of what the policy deleted along for.
        records: A put's outbox entries, inserted ahead of its checkpoint (``records.written`` then set).
        keep: ``(thread, namespace, count)`` of a put whose namespace is pruned after its statements.
        probe: Read last: the row of the put's checkpoint, for the latest-checkpoint cache.
    """

    check_parent: bool = False
    forget_pruned: str | None = None
    records: CheckpointRecords | None = None
    keep: tuple[str, str, int] | None = None
    probe: _Probe | None = None


#: A write with nothing to run around its statements: PostgresSaver's own, on the saver itself.
_NO_PLAN = _WritePlan()


def forget_summaries(cur: Any, table: str | None, thread_ids: Sequence[str]) -> None:
    """Delete the running-summary steps of the namespaces of ``thread_ids`` that have no checkpoint left
    (``table`` ``None``: the database has no such table; nothing)."""
    if table is not None and thread_ids:
        cur.execute(FORGET_THREAD_SUMMARIES_SQL.format(table=table), (list(thread_ids),), prepare=False)


def _versions_by_group(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], tuple[list[str], set]]:
    """Deleted checkpoint rows grouped by (thread, namespace): their ids and the blobs they referenced."""
    groups: dict[tuple[str, str], tuple[list[str], set]] = {}
    for row in rows:
        ids, freed = groups.setdefault((row["thread_id"], row["checkpoint_ns"]), ([], set()))
        ids.append(row["checkpoint_id"])
        freed.update((channel, str(version)) for channel, version in (row["versions"] or {}).items())
    return groups


class PostgresLifecycleSaver(PostgresSaver):
    """PostgresSaver with ``copy_thread`` and ``delete_for_runs``; constructed like it (``conn``, ``pipe``
    and ``serde`` as PostgresSaver takes them), with the service's settings as keyword arguments.

    Each method runs in one transaction on one connection, under the saver's lock, as
    ``PostgresSaver.prune`` does. Only the sync methods exist, as on PostgresSaver.

    Args:
        conn: PostgresSaver's: a connection or a connection pool.
        pipe: PostgresSaver's: a pipeline of ``conn`` (a connection only).
        serde: PostgresSaver's: the serializer.
        keep_checkpoints: Keep only the newest this many checkpoints of each thread and namespace, plus
            branch heads and the ancestors their DeltaChannels are rebuilt from (see ``lifecycle``);
            ``None`` keeps every one. A put's ``config["configurable"]["keep_checkpoints"]`` overrides it
            for that thread.
        pruned_table: The service's table of what the keep-checkpoints policy deleted
            (``lifecycle.PRUNED_TABLE``), when the database has it: each prune records there in its
            transaction, ``get_tuple`` and ``list`` of a deleted checkpoint raise ``CheckpointPrunedError``,
            and so does a put naming one as parent (checked first in the put's own pipeline);
            ``delete_thread``, ``prune("delete")`` and ``copy_thread`` take the record along. ``None``:
            nothing.
        summaries_table: The service's table of running-summary steps (``service/storage/summaries.py``),
            when the database has it: ``delete_for_runs`` and ``prune`` then delete the steps of the
            namespaces they leave without a checkpoint, in their own transaction (``prune("keep_latest")``:
            right after it). ``None``: nothing.
        latest_cache: The process's latest-checkpoint cache (the service's savers share one): ``get_tuple``
            of a thread's latest checkpoint is answered from it when one query proves the database still
            holds exactly the rows it records (``postgres/latest.py``); puts keep it up to date, put_writes
            to the checkpoint it holds mark that checkpoint's writes unknown (its next read is a full one).
            ``None``: every read is from the database.
    """

    #: The settings (see Args).
    keep_checkpoints: int | None = None
    pruned_table: str | None = None
    summaries_table: str | None = None
    latest_cache: LatestCache | None = None
    #: A view's (``_view``): the plan of the write it was made for, until its pipeline runs it.
    _plan: _WritePlan | None = None
    #: A view's: ``_build_delta_channels_writes_history`` assembles its rows with their places.
    _placing: bool = False
    #: PostgresSaver's upsert, returning the row's xmin and parent (read only for the latest cache).
    UPSERT_CHECKPOINTS_SQL = latest.UPSERT_RETURNING_SQL

    #: ``list`` filters by a thread-id prefix in its query (``THREAD_PREFIX_KEY``, see ``_search_where``).
    lists_by_thread_prefix = True
    #: Primitive channel values and metadata live in JSONB, which keeps any integer exactly: one beyond 64
    #: bits is stored inline, as a stock PostgresSaver stores it (SqliteSaver's JSON and the memory
    #: backend's msgpack cannot, so there it stays in its typed wire form).
    keeps_big_ints_inline = True
    #: ``put`` stores the values of the channels in ``new_versions``; a read finds every other channel's
    #: value by its version, in the rows of the put that wrote it (``EncryptingSaver`` seals no others).
    stores_written_channels_only = True
    #: Primitive channel values live inline in the checkpoint row, with no blob row: a database of the
    #: plain era may hold a channel's value only in the row of the checkpoint that wrote it.
    inlines_primitive_values = True

    def __init__(
        self,
        conn: _internal.Conn,
        pipe: psycopg.Pipeline | None = None,
        serde: SerializerProtocol | None = None,
        *,
        keep_checkpoints: int | None = None,
        pruned_table: str | None = None,
        summaries_table: str | None = None,
        latest_cache: LatestCache | None = None,
    ) -> None:
        super().__init__(conn, pipe, serde)
        self.keep_checkpoints = keep_checkpoints
        self.pruned_table = pruned_table
        self.summaries_table = summaries_table
        self.latest_cache = latest_cache

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
        source, target = check_copy_ids(source_thread_id, target_thread_id)
        with self._transaction() as cur:
            cur.execute(COPY_LOCK_SQL, (COPY_LOCK_CLASS, target), prepare=False)
            cur.execute(THREAD_IN_USE_SQL, (target, target, target), prepare=False)
            if cur.fetchone()["in_use"]:
                raise ThreadNotEmptyError(target)
            cur.execute(COPY_THREAD_SQL, {"source": source, "target": target}, prepare=False)
            if self.pruned_table is not None:
                cur.execute(
                    f"INSERT INTO {self.pruned_table} (thread_id, checkpoint_ns, pruned_through)"
                    f" SELECT %s, checkpoint_ns, pruned_through FROM {self.pruned_table} WHERE thread_id = %s",
                    (target, source),
                    prepare=False,
                )
        self._forget([target])

    def delete_for_runs(self, run_ids: Sequence[str], *, thread_id_prefix: str | None = None) -> None:
        """Delete the checkpoints of runs, their pending writes, and the blobs only they referenced.

        ``thread_id_prefix`` (the service's tenant scoping) restricts it to threads whose id starts so.
        A checkpoint belongs to a run when its metadata ``run_id`` is that string. Blobs a deleted
        checkpoint referenced stay while any remaining checkpoint of the same thread and namespace
        references them; a remaining checkpoint whose parent is deleted is left with no parent. All in
        one transaction, with the running-summary steps of each namespace left without a checkpoint
        (``summaries_table``). Like ``prune``, deleting checkpoints a run in progress is building on is not
        safe.

        Args:
            run_ids: The run ids; empty deletes nothing.

        Raises:
            TypeError: If ``run_ids`` is a single string.
        """
        runs = check_run_ids(run_ids)
        if not runs:
            return
        with self._transaction() as cur:
            like = None if thread_id_prefix is None else like_prefix(thread_id_prefix)
            cur.execute(DELETE_RUN_CHECKPOINTS_SQL, (runs, like, like), prepare=False)
            groups = _versions_by_group(cur.fetchall())
            for (thread_id, ns), (ids, freed) in sorted(groups.items()):
                cur.execute(DELETE_WRITES_SQL, (thread_id, ns, ids), prepare=False)
                cur.execute(DETACH_CHILDREN_SQL, (thread_id, ns, ids), prepare=False)
                cur.execute(REFERENCED_BLOBS_SQL, (thread_id, ns), prepare=False)
                referenced = {(r["channel"], r["version"]) for r in cur.fetchall()}
                garbage: dict[str, list[str]] = defaultdict(list)
                for channel, version in sorted(freed - referenced):
                    garbage[channel].append(version)
                for channel, versions in garbage.items():
                    cur.execute(DELETE_BLOBS_SQL, (thread_id, ns, channel, versions), prepare=False)
                if self.summaries_table is not None:
                    cur.execute(
                        FORGET_NAMESPACE_SUMMARIES_SQL.format(table=self.summaries_table),
                        (thread_id, ns),
                        prepare=False,
                    )
        self._forget(thread_id for thread_id, _ns in groups)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``PostgresSaver.prune``, refusing also DeltaChannel snapshots stored verbatim.

        PostgresSaver recognizes a thread that uses a DeltaChannel by its metadata counters, or by the
        inline marker its own ``put`` leaves for a ``_DeltaSnapshot``. A saver with a pass-through serde
        (the service's) stores a client's snapshot as an ordinary blob, so ``keep_latest`` first looks for
        blobs that are a snapshot as a whole, in all requested threads, before anything is pruned.
        Everything else is PostgresSaver's: see its docstring. With ``summaries_table``, ``delete`` also
        deletes the threads' running-summary steps in its transaction, and ``keep_latest`` those of the
        namespaces it deleted (subgraph calls) right after its own.

        Raises:
            TypeError: If ``thread_ids`` is a single string.
            ValueError: If ``strategy`` is unknown.
            NotImplementedError: If ``strategy`` is ``"keep_latest"`` and a thread uses a DeltaChannel.
        """
        ids = check_prune_args(thread_ids, strategy)
        if ids and strategy == "keep_latest":
            with self._cursor() as cur:
                cur.execute(PRUNE_DELTA_THREADS_SQL, (ids, ids), prepare=False)
                delta = [r["thread_id"] for r in cur.fetchall()]
                cur.execute(SNAPSHOT_BLOB_THREADS_SQL, (ids,), prepare=False)
                delta += [r["thread_id"] for r in cur.fetchall()]
            refuse_delta_threads(delta)
        try:
            if (
                ids
                and strategy == "delete"
                and (self.summaries_table is not None or self.pruned_table is not None)
            ):
                with self._transaction() as cur:
                    for statement in PRUNE_DELETE_THREADS_SQL:
                        cur.execute(statement, (ids,), prepare=False)
                    forget_summaries(cur, self.summaries_table, ids)
                    if self.pruned_table is not None:
                        cur.execute(
                            f"DELETE FROM {self.pruned_table} WHERE thread_id = ANY(%s)",
                            (ids,),
                            prepare=False,
                        )
                return
            super().prune(ids, strategy=strategy)
            if ids and self.summaries_table is not None:
                with self._transaction() as cur:
                    forget_summaries(cur, self.summaries_table, ids)
        finally:
            self._forget(ids)

    def delete_thread(self, thread_id: str) -> None:
        """PostgresSaver's ``delete_thread``, with the record of what the policy deleted in the same
        transaction (``pruned_table``); the thread leaves the latest-checkpoint cache too."""
        saver = self if self.pruned_table is None else self._view(_WritePlan(forget_pruned=str(thread_id)))
        try:
            PostgresSaver.delete_thread(saver, thread_id)
        finally:
            self._forget([str(thread_id)])

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """PostgresSaver's ``list``; a checkpoint the keep-checkpoints policy deleted raises
        ``CheckpointPrunedError`` (with ``pruned_table``) rather than listing nothing."""
        found = False
        listed = super().list(config, filter=filter, before=before, limit=limit)
        with closing(listed) as items:  # type: ignore[type-var]  # PostgresSaver's list is a generator
            for item in items:
                found = True
                yield item
        if not found:
            self._refuse_pruned(config)

    def _refuse_pruned(self, config: RunnableConfig | None) -> None:
        """Raise ``CheckpointPrunedError`` when ``config`` names a checkpoint not stored that the
        keep-checkpoints policy deleted (nothing without ``pruned_table``)."""
        configurable = (config or {}).get("configurable") or {}
        checkpoint_id = configurable.get("checkpoint_id")
        if self.pruned_table is None or not checkpoint_id or configurable.get("thread_id") is None:
            return
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns") or ""
        with self._cursor() as cur:
            cur.execute(
                PRUNED_THROUGH_SQL.format(table=self.pruned_table),
                (thread_id, ns, checkpoint_id),
                prepare=False,
            )
            row = cur.fetchone()
        if row is not None and was_pruned(checkpoint_id, row["pruned_through"]):
            raise CheckpointPrunedError(checkpoint_id, row["pruned_through"])

    def _forget(self, thread_ids: Iterable[str]) -> None:
        """Drop threads from the latest-checkpoint cache: memory only, since every read proves its entry
        against the database (a delete by any other path shows there)."""
        if self.latest_cache is not None:
            self.latest_cache.discard(thread_ids)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """PostgresSaver's ``get_tuple``; the latest checkpoint (no ``checkpoint_id``) from the cache when
        one query proves the database holds exactly the rows of its entry, else read in full (with each
        row's xmin) and kept. A checkpoint the keep-checkpoints policy deleted raises
        ``CheckpointPrunedError`` (with ``pruned_table``)."""
        cache = self.latest_cache
        if get_checkpoint_id(config):
            item = super().get_tuple(config)
            if item is None:
                self._refuse_pruned(config)
            return item
        if cache is None or not cache.enabled:
            return super().get_tuple(config)
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns", "")
        image = cache.get(thread_id, ns)
        with self._cursor() as cur:
            if image is not None:
                cur.execute(latest.TOKEN_SQL, image.token_params)
                if image.proven_by(cur.fetchone()) and image.load():
                    cache.count("hit")
                    return self._load_checkpoint_tuple(image.row())
                cache.count("stale")
            else:
                cache.count("miss")
            cur.execute(latest.READ_SQL, (thread_id, ns))
            value = cur.fetchone()
        if value is None:
            cache.put(thread_id, ns, None)
            return None
        if value["checkpoint"]["v"] < 4:  # PostgresSaver migrates the pending sends of older checkpoints
            cache.put(thread_id, ns, None)
            return super().get_tuple(config)
        read = latest.Image.from_row(value)
        # A put of this process may have kept a newer checkpoint meanwhile: the newer entry stays.
        cache.update(
            thread_id,
            ns,
            lambda held: held if held is not None and held.checkpoint_id > read.checkpoint_id else read,
        )
        return self._load_checkpoint_tuple(read.row())

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """PostgresSaver's ``put_writes``; the latest-checkpoint cache forgets the writes of the checkpoint
        it holds when they change (its next read of that checkpoint is a full one)."""
        cache = self.latest_cache
        if cache is None or not cache.enabled:
            return super().put_writes(config, writes, task_id, task_path)
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), configurable["checkpoint_ns"]
        checkpoint_id = configurable["checkpoint_id"]
        try:
            super().put_writes(config, writes, task_id, task_path)
        finally:
            cache.update(thread_id, ns, lambda current: latest.after_writes(current, checkpoint_id))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        *,
        records: CheckpointRecords | None = None,
    ) -> RunnableConfig:
        """PostgresSaver's ``put``; when a keep-checkpoints count applies, the put's pipeline also prunes
        its namespace (``_cursor``), in the same transaction: one round trip, as without the policy. With
        ``pruned_table``, the upsert of the put's row checks its parent first (no statement of its own:
        ``latest.UPSERT_CHECKING_PARENT_SQL``): one the policy deleted raises ``CheckpointPrunedError``,
        and nothing of the put is stored.

        ``records``: the put's outbox entries (the service's ``Memory.with_checkpoint``), inserted ahead of
        the checkpoint in its pipeline, so they are committed with it or not at all; ``records.written``
        is set once they are queued.

        The prune waits for the thread's advisory lock, so prunes of one thread run one after another
        across replicas, each on a snapshot that holds every put committed before it; a put committing
        meanwhile is newer than anything the prune deletes. A checkpoint kept on a DeltaChannel thread keeps
        the ancestors its channels are rebuilt from (``lifecycle.checkpoints_to_drop``).
        """
        keep = keep_checkpoints_of(config, self.keep_checkpoints)
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), configurable["checkpoint_ns"]
        cache = self.latest_cache
        probe = None
        if cache is not None and cache.enabled:
            # The upsert returns the row; a prune after it may change the row's parent: read it again.
            probe = (
                _Probe() if keep is None else _Probe(latest.PUT_PROBE_SQL, (thread_id, ns, checkpoint["id"]))
            )
        parent = configurable.get("checkpoint_id")
        plan = _WritePlan(
            check_parent=bool(parent) and self.pruned_table is not None,
            records=records if records is not None and records.entries and not records.written else None,
            keep=None if keep is None else (thread_id, ns, keep),
            probe=probe,
        )
        saver = self if plan == _NO_PLAN else self._view(plan)
        try:
            next_config = PostgresSaver.put(saver, config, checkpoint, metadata, new_versions)
        except BaseException as exc:
            if cache is not None:
                cache.put(thread_id, ns, None)
            if isinstance(exc, psycopg.Error) and exc.sqlstate == PRUNED_PARENT_SQLSTATE:
                raise CheckpointPrunedError(
                    str(parent), exc.diag.message_detail or "", as_parent=True
                ) from None
            raise
        if cache is not None and probe is not None:
            row = probe.row
            cache.update(
                thread_id,
                ns,
                lambda previous: latest.after_put(
                    previous,
                    row,
                    self.serde,
                    config=config,
                    checkpoint=checkpoint,
                    metadata=metadata,
                    new_versions=new_versions,
                ),
            )
        return next_config

    def placed_delta_history(
        self, config: RunnableConfig, channels: Sequence[str]
    ) -> dict[str, PlacedHistory]:
        """``get_delta_channel_history`` with the place of every value (``lifecycle.PlacedHistory``), read
        by PostgresSaver's own two queries: what ``EncryptingSaver`` needs to open sealed values."""
        history = self._view(placing=True).get_delta_channel_history(config=config, channels=channels)
        return history  # type: ignore[return-value]

    def _build_delta_channels_writes_history(
        self,
        *,
        channels: Sequence[str],
        chain_by_ch: Mapping[str, builtins.list[str]],
        seed_ver_by_ch: Mapping[str, str | None],
        seed_inline_by_ch: Mapping[str, Any],
        stage2_rows: Sequence[Any],
    ) -> dict[str, Any]:
        """PostgresSaver's assembly of its history rows; under ``placed_delta_history``, with places."""
        if not self._placing:
            return super()._build_delta_channels_writes_history(
                channels=channels,
                chain_by_ch=chain_by_ch,
                seed_ver_by_ch=seed_ver_by_ch,
                seed_inline_by_ch=seed_inline_by_ch,
                stage2_rows=stage2_rows,
            )
        writes, blobs = [], {}
        for row in stage2_rows:
            value = None if row["type"] == "empty" else self.serde.loads_typed((row["type"], row["blob"]))
            if row["_kind"] == "w":
                writes.append(
                    (
                        row["checkpoint_id"],
                        row["channel"],
                        row["task_id"],
                        row["idx"],
                        row["task_path"],
                        value,
                    )
                )
            elif row["type"] != "empty":
                blobs[(row["channel"], row["version"])] = value
        seeds = {}
        for channel in channels:
            version = seed_ver_by_ch.get(channel)
            if version is None:
                continue
            if (channel, version) in blobs:
                seeds[channel] = (version, blobs[(channel, version)])
            elif channel in seed_inline_by_ch:  # a primitive kept inline in the checkpoint row
                seeds[channel] = (version, seed_inline_by_ch[channel])
        return placed_histories(channels, chain_by_ch, writes, seeds)

    def _search_where(
        self, config: RunnableConfig | None, filter: Any, before: RunnableConfig | None = None
    ) -> tuple[str, builtins.list[Any]]:
        """PostgresSaver's, plus ``thread_id LIKE prefix%`` when ``config`` names a thread-id prefix
        (``THREAD_PREFIX_KEY``: the service lists one tenant's threads in the query, before the LIMIT), and
        ``checkpoint_id = id`` across threads when it names a checkpoint id (``CHECKPOINT_ID_KEY``)."""
        configurable = (config or {}).get("configurable") or {}
        prefix, checkpoint_id = configurable.get(THREAD_PREFIX_KEY), configurable.get(CHECKPOINT_ID_KEY)
        if prefix is None and checkpoint_id is None:
            return super()._search_where(config, filter, before)
        where, params = super()._search_where(None, filter, before)
        clauses: list[tuple[str, Any]] = []
        if prefix is not None:
            clauses.append(("thread_id LIKE %s ESCAPE '\\'", like_prefix(prefix)))
        if checkpoint_id is not None:
            clauses.append(("checkpoint_id = %s", checkpoint_id))
        for clause, param in clauses:
            where = f"{where} AND {clause}" if where else f"WHERE {clause}"
            params = [*params, param]
        return where, params

    def _view(self, plan: _WritePlan | None = None, *, placing: bool = False) -> PostgresLifecycleSaver:
        """This saver for one call of PostgresSaver's own methods (``put``, ``delete_thread``,
        ``get_delta_channel_history``), carrying what that call's ``_cursor``, ``_queued`` or
        ``_build_delta_channels_writes_history`` needs: a shallow copy, sharing the connection, its lock,
        the pipeline, the serde and every setting (``copy.copy``, without its generic machinery: a
        fraction of a microsecond). PostgresSaver's methods set nothing on the saver, so the copy sees
        what the saver sees; the saver itself carries no plan."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._plan, view._placing = plan, placing
        if plan is not None and plan.check_parent:
            view.UPSERT_CHECKPOINTS_SQL = latest.UPSERT_CHECKING_PARENT_SQL
        return view

    def _cursor(  # type: ignore[override]  # PostgresSaver's own context manager, or a generator's
        self, *, pipeline: bool = False
    ) -> AbstractContextManager[Any]:
        """PostgresSaver's cursor (itself, not wrapped: most calls have no plan); on a view with a write's
        plan (``_view``), :meth:`_planned_cursor`."""
        plan = self._plan if pipeline else None
        if plan is None:
            return super()._cursor(pipeline=pipeline)
        return self._planned_cursor(plan)

    @contextmanager
    def _planned_cursor(self, plan: _WritePlan) -> Iterator[Any]:
        """PostgresSaver's pipeline cursor, for a view with a write's plan (``_view``): the first pipeline
        runs the plan's statements around the write's own (``_queued``): a put's outbox entries first, its
        keep-checkpoints prune after its statements, its probe last (its parent check is in its upsert).
        PostgreSQL runs a pipeline up to its sync as one transaction, so the entries, the checkpoint (its
        blobs and its row) and the prune are committed together, or none is, and the probe sees what that
        transaction wrote. The probe's row is read once the pipeline is synced: no round trip of its own."""
        self._plan = None  # the write's own pipeline only (the view's: see _view)
        probe = plan.probe
        if probe is None or self.pipe or not self.supports_pipeline:
            with super()._cursor(pipeline=True) as cur, self._queued(cur, plan, None):
                yield cur
            return
        with (
            self.lock,
            _internal.get_connection(self.conn) as conn,
            conn.cursor(binary=True, row_factory=dict_row) as cur,
        ):
            with conn.pipeline(), self._queued(cur, plan, probe):
                yield cur
            probe.row = cur.fetchone()

    @contextmanager
    def _queued(self, cur: Any, plan: _WritePlan, probe: _Probe | None) -> Iterator[None]:
        """The statements of ``plan`` a write's pipeline runs around the write's own (see ``_cursor``);
        ``probe``: the plan's, when this pipeline reads it."""
        if plan.forget_pruned is not None:
            cur.execute(
                f"DELETE FROM {self.pruned_table} WHERE thread_id = %s", (plan.forget_pruned,), prepare=False
            )
        if plan.records is not None:
            insert_entries(cur, plan.records.entries)
            plan.records.written = True
        yield
        if plan.keep is not None:
            thread_id, ns, count = plan.keep
            # Prepared as the connection prepares PostgresSaver's own statements: planning the prune
            # takes several times as long as running it on a namespace of K + 1 checkpoints.
            cur.execute(KEEP_LOCK_SQL, (KEEP_LOCK_CLASS, thread_id))
            if self.pruned_table is None:
                cur.execute(KEEP_LAST_SQL, {"thread": thread_id, "ns": ns, "keep": count})
            else:
                cur.execute(
                    KEEP_LAST_RECORDING_SQL.replace("{table}", self.pruned_table),
                    {"thread": thread_id, "ns": ns, "keep": count},
                )
        if probe is not None and probe.sql is not None:
            cur.execute(probe.sql, probe.params)

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        """A cursor inside one transaction, as ``PostgresSaver.prune`` opens it."""
        with self._cursor() as cur:
            if self.pipe:
                # In pipeline mode the transaction would take in what ran since the last sync.
                self.pipe.sync()
            with cur.connection.transaction():
                yield cur
