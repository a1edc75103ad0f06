"""What one call of the PostgreSQL saver runs in its own transaction reaches that call only.

A put's outbox records, keep-checkpoints count, parent check and latest-cache probe, and a
``placed_delta_history`` read's places, travel with the call (``postgres/saver.py``: a per-call view of
the saver carries them to PostgresSaver's own methods), never on the saver, which callers share. A put
held between its start and its pipeline while another put runs, many threads putting on one saver while
the interpreter switches between them as often as it can, and history reads beside placed ones: anything
of one call that another call's pipeline ran would show as records written in another transaction or
never, a thread holding more checkpoints than its count, a latest read naming another put's checkpoint,
or history with places where the stock answer has none.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypedDict

import psycopg
import pytest
from langchain_core.messages import AnyMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base.id import uuid6
from langgraph.graph.message import _messages_delta_reducer
from psycopg_pool import ConnectionPool

from reducing_saver.service.storage import open_backend
from reducing_saver.service.storage.latest import LatestCache
from reducing_saver.service.storage.outbox import TABLE, CheckpointRecords, make_entries
from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver
from reducing_saver.wire import Blob
from tests.support.chat import build_chat_graph, human

#: Per writer thread: its keep-checkpoints count (all different, so a count applied to the wrong put shows).
KEEPS = (2, 3, 4, 5)
PUTS = 25


def _all_at_once(workers: list[Callable[[], None]]) -> None:
    """Run ``workers`` in threads started together, switching between them as often as the interpreter
    can; re-raise the first failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def run(worker: Callable[[], None]) -> None:
        start.wait()
        try:
            worker()
        except BaseException as exc:  # reported below, from the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(worker,)) for worker in workers]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]


@pytest.fixture
def backend(fresh_pg: str) -> Iterator[Any]:
    backend = open_backend(fresh_pg, pool_size=len(KEEPS) + 1, timeout=30.0)
    backend.setup()
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def saver(backend: Any) -> PostgresLifecycleSaver:
    """One saver as the service configures it: latest-checkpoint cache, record of pruned checkpoints
    (every put's pipeline checks its parent)."""
    (saver,) = backend.savers(1, latest_cache=LatestCache(100))
    assert saver.pruned_table is not None and saver.latest_cache is not None
    return saver


class _PausedCheckpoint(dict):
    """A checkpoint whose put stops where PostgresSaver's ``put`` first copies it (before its pipeline)
    until ``resume`` is set; ``reached`` is set when it gets there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reached, self.resume = threading.Event(), threading.Event()

    def copy(self) -> dict:
        if not self.reached.is_set():
            self.reached.set()
            assert self.resume.wait(30)
        return dict(self)


class Writer:
    """Puts a chain of checkpoints on one thread with its own keep count, each with outbox records, and
    checks after each that the put's own plan ran in its own transaction."""

    def __init__(self, saver: PostgresLifecycleSaver, database: str, thread_id: str, keep: int) -> None:
        self.saver, self.database, self.thread_id, self.keep = saver, database, thread_id, keep
        self.parent: str | None = None
        self.versions: dict[str, str] = {}
        self.step = 0

    def checkpoint(self, cls: type[dict] = dict) -> dict:
        self.versions = {"n": f"{self.step + 1:032}.0", "blob": f"{self.step + 1:032}.0"}
        return cls(
            v=4,
            id=str(uuid6()),
            ts="2026-01-01T00:00:00+00:00",
            channel_values={"n": self.step, "blob": Blob("msgpack", self.thread_id.encode())},
            channel_versions=dict(self.versions),
            versions_seen={},
            updated_channels=["blob", "n"],
        )

    def put(self, checkpoint: dict | None = None) -> None:
        checkpoint = self.checkpoint() if checkpoint is None else checkpoint
        checkpoint_id, step = checkpoint["id"], self.step
        configurable = {"thread_id": self.thread_id, "checkpoint_ns": "", "keep_checkpoints": self.keep}
        if self.parent is not None:
            configurable["checkpoint_id"] = self.parent
        records = CheckpointRecords()
        records.entries = make_entries(
            [{"type": "human", "id": f"{self.thread_id}-{step}", "content": "pruned"}],
            ("memories", self.thread_id),
            thread_id=self.thread_id,
            checkpoint_id=checkpoint_id,
        )
        saved = self.saver.put(
            {"configurable": configurable},
            checkpoint,
            {"source": "loop", "step": step},
            dict(self.versions),
            records=records,
        )
        assert saved["configurable"]["checkpoint_id"] == checkpoint_id
        assert records.written, (self.thread_id, step)
        self.saver.put_writes(saved, [("n", step)], f"task-{step}")
        with psycopg.connect(self.database, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT (SELECT xmin::text FROM checkpoints WHERE thread_id = %s AND checkpoint_id = %s),"
                f" (SELECT array_agg(xmin::text) FROM {TABLE} WHERE thread_id = %s AND checkpoint_id = %s),"
                " (SELECT count(*) FROM checkpoints WHERE thread_id = %s)",
                (self.thread_id, checkpoint_id, self.thread_id, checkpoint_id, self.thread_id),
            ).fetchone()
        assert row is not None
        checkpoint_xmin, outbox_xmins, kept = row
        # The records were committed by the put's own transaction, and its keep count pruned its thread.
        assert outbox_xmins == [checkpoint_xmin], (self.thread_id, step)
        assert kept == min(step + 1, self.keep), (self.thread_id, step)
        # The put's probe left this put's row in the cache (a latest read names it, writes included).
        latest = self.saver.get_tuple({"configurable": {"thread_id": self.thread_id, "checkpoint_ns": ""}})
        assert latest is not None
        assert latest.checkpoint["id"] == checkpoint_id, (self.thread_id, step)
        assert latest.checkpoint["channel_values"]["n"] == step
        assert latest.pending_writes == [(f"task-{step}", "n", step)]
        self.parent, self.step = checkpoint_id, step + 1


def _outbox_and_checkpoints(database: str) -> tuple[list[tuple], list[tuple]]:
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(f"SELECT thread_id, count(*) FROM {TABLE} GROUP BY 1 ORDER BY 1").fetchall()
        kept = conn.execute("SELECT thread_id, count(*) FROM checkpoints GROUP BY 1 ORDER BY 1").fetchall()
    return rows, kept


def test_a_put_paused_before_its_pipeline_runs_its_own_plan_after_another_put(
    saver: PostgresLifecycleSaver, fresh_pg: str
) -> None:
    paused, other = Writer(saver, fresh_pg, "paused", 2), Writer(saver, fresh_pg, "other", 3)
    for _ in range(4):  # both threads past their keep count: each put prunes
        paused.put()
        other.put()
    checkpoint = paused.checkpoint(_PausedCheckpoint)
    errors: list[BaseException] = []

    def put_paused() -> None:
        try:
            paused.put(checkpoint)
        except BaseException as exc:  # reported below, from the test's own thread
            errors.append(exc)

    thread = threading.Thread(target=put_paused)
    thread.start()
    try:
        assert checkpoint.reached.wait(30)
        other.put()  # start to end while the paused put holds its plan
    finally:
        checkpoint.resume.set()
        thread.join(30)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    assert _outbox_and_checkpoints(fresh_pg) == ([("other", 5), ("paused", 5)], [("other", 3), ("paused", 2)])


def test_concurrent_puts_on_one_saver_each_run_only_their_own_plan(
    saver: PostgresLifecycleSaver, fresh_pg: str
) -> None:
    writers = [Writer(saver, fresh_pg, f"writer-{index}", keep) for index, keep in enumerate(KEEPS)]

    def run(writer: Writer) -> Callable[[], None]:
        def puts() -> None:
            for _ in range(PUTS):
                writer.put()

        return puts

    _all_at_once([run(writer) for writer in writers])
    assert _outbox_and_checkpoints(fresh_pg) == (
        [(writer.thread_id, PUTS) for writer in writers],
        [(writer.thread_id, writer.keep) for writer in writers],
    )


class _Snapshotting(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=3)]


def test_a_placed_history_read_leaves_concurrent_stock_reads_stock(fresh_pg: str) -> None:
    with ConnectionPool(fresh_pg, min_size=1, max_size=3, kwargs={"autocommit": True}) as pool:
        saver = PostgresLifecycleSaver(pool)
        saver.setup()
        graph = build_chat_graph(saver, prefix="p", state_schema=_Snapshotting)
        config = {"configurable": {"thread_id": "placed"}}
        for turn in range(5):
            graph.invoke({"messages": [human(turn, "p")]}, config)
        configs = [item.config for item in saver.list(config)]
        stock = [saver.get_delta_channel_history(config=at, channels=["messages"]) for at in configs]
        placed = [saver.placed_delta_history(at, ["messages"]) for at in configs]
        assert stock != placed  # the two shapes differ: a read given the other's would show

        def reader(read: Callable[[dict], Any], want: list[Any]) -> Callable[[], None]:
            def run() -> None:
                for _ in range(10):
                    for at, expected in zip(configs, want, strict=True):
                        assert read(at) == expected

            return run

        _all_at_once(
            [
                reader(lambda at: saver.get_delta_channel_history(config=at, channels=["messages"]), stock),
                reader(lambda at: saver.placed_delta_history(at, ["messages"]), placed),
                reader(lambda at: saver.get_delta_channel_history(config=at, channels=["messages"]), stock),
            ]
        )


def test_a_put_checks_its_parent_in_the_statement_writing_its_row(
    saver: PostgresLifecycleSaver, fresh_pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose parent is checked (``pruned_table``) sends its blobs and its row, as a stock put does:
    the check runs inside the row's upsert, not as a statement of its own. The check itself refusing a
    parent the policy deleted is ``test_pruned_checkpoints.py``'s."""
    writer = Writer(saver, fresh_pg, "checked", keep=2)
    writer.put()  # the first checkpoint: no parent to check
    sent: list[str] = []
    execute, executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany

    def counted_execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(" ".join(str(query).split()[:3]))
        return execute(self, query, *args, **kwargs)

    def counted_executemany(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(" ".join(str(query).split()[:3]))
        return executemany(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted_execute)
    monkeypatch.setattr(psycopg.Cursor, "executemany", counted_executemany)
    checkpoint = writer.checkpoint()
    saver.put(
        {"configurable": {"thread_id": "checked", "checkpoint_ns": "", "checkpoint_id": writer.parent}},
        checkpoint,
        {"source": "loop", "step": 1},
        dict(writer.versions),
    )
    assert sent == [
        "INSERT INTO checkpoint_blobs",
        "WITH put (thread_id,",
    ]
    latest = saver.get_tuple({"configurable": {"thread_id": "checked", "checkpoint_ns": ""}})
    assert latest is not None and latest.checkpoint["id"] == checkpoint["id"]
    assert latest.parent_config is not None
    assert latest.parent_config["configurable"]["checkpoint_id"] == writer.parent


def test_the_upsert_that_checks_a_parent_is_postgres_savers_own():
    """The checked upsert is PostgresSaver's, its values read through the parent check: what a conflict
    writes comes from upstream's statement, and an upstream statement it cannot be made from is an error
    at import, not a different write."""
    from langgraph.checkpoint.postgres.base import UPSERT_CHECKPOINTS_SQL

    from reducing_saver.service.storage.postgres import latest

    conflict = UPSERT_CHECKPOINTS_SQL.partition("ON CONFLICT")[2].strip().rstrip(";")
    assert conflict in latest.UPSERT_CHECKING_PARENT_SQL
    assert "reducing_saver_refuse_pruned_parent" in latest.UPSERT_CHECKING_PARENT_SQL
    with pytest.raises(RuntimeError, match="no 'VALUES"):
        latest._checking_parent("INSERT INTO checkpoints SELECT * FROM elsewhere")
