"""The lifecycle savers of service/savers.py on PostgreSQL, SQLite and in memory.

Each backend runs with LangGraph's default serde and with the service's ``VerbatimSerde`` (client blobs
stored verbatim). The conformance suite checks the contract with plain values; the targeted tests below
use threads shaped like real ones: sparse puts whose unchanged channels keep pointing at blobs written
several checkpoints (or runs) earlier, pending writes on every checkpoint, subgraph namespaces.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import psycopg
import pytest
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES, Capability, DetectedCapabilities
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot
from langgraph.graph import END, START, StateGraph
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from reducing_saver.service.storage.inmemory.saver import InMemoryLifecycleSaver
from reducing_saver.service.storage.lifecycle import ThreadNotEmptyError
from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.sqlite.saver import SqliteLifecycleSaver
from reducing_saver.wire import Blob, is_inline
from reducing_saver.wire.capabilities import saver_capabilities
from tests.support.sync_adapter import SyncAdapter

KINDS = ("postgres", "sqlite", "memory")
SERDES = ("default", "verbatim")
BACKENDS = [pytest.param((kind, serde), id=f"{kind}-{serde}") for kind in KINDS for serde in SERDES]
LIFECYCLE = frozenset({"copy_thread", "delete_for_runs", "prune"})
_CLIENT_SERDE = JsonPlusSerializer()


def _serde(name: str):
    return VerbatimSerde() if name == "verbatim" else None


@contextmanager
def open_saver(
    kind: str, serde: str, pg_url: str | None, sqlite_path: str | None = None, **options: Any
) -> Iterator[Any]:
    """A lifecycle saver built as the service builds its inner savers (a pool for verbatim Postgres);
    ``options``: the saver's keyword settings (``keep_checkpoints``, ...)."""
    if kind == "memory":
        yield InMemoryLifecycleSaver(serde=_serde(serde), **options)
    elif kind == "sqlite":
        conn = sqlite3.connect(sqlite_path or ":memory:", check_same_thread=False, isolation_level=None)
        try:
            saver = SqliteLifecycleSaver(conn, serde=_serde(serde), **options)
            saver.setup()
            yield saver
        finally:
            conn.close()
    elif serde == "verbatim":
        kwargs = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
        with ConnectionPool(pg_url, min_size=1, max_size=2, kwargs=kwargs, open=True) as pool:
            saver = PostgresLifecycleSaver(pool, serde=VerbatimSerde(), **options)
            saver.setup()
            yield saver
    else:
        with psycopg.Connection.connect(
            pg_url, autocommit=True, prepare_threshold=0, row_factory=dict_row
        ) as conn:
            saver = PostgresLifecycleSaver(conn, **options)
            saver.setup()
            yield saver


@dataclass
class Backend:
    kind: str
    serde: str
    saver: Any
    pg_url: str | None

    def enc(self, value: Any) -> Any:
        """A channel or write value as this saver receives it: the service's savers get client blobs."""
        if self.serde == "verbatim" and not is_inline(value):
            return Blob(*_CLIENT_SERDE.dumps_typed(value))
        return value

    def dec(self, value: Any) -> Any:
        return _CLIENT_SERDE.loads_typed((value.type, value.data)) if isinstance(value, Blob) else value

    def sql(self, query: str, params: tuple = ()) -> list:
        """Rows of a query on the backend's own tables."""
        if self.kind == "postgres":
            with psycopg.connect(self.pg_url, autocommit=True) as conn:
                return conn.execute(query, params).fetchall()
        with self.saver.lock:
            return self.saver.conn.execute(query.replace("%s", "?"), params).fetchall()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path) -> Iterator[Backend]:
    kind, serde = request.param
    pg_url = request.getfixturevalue("fresh_pg") if kind == "postgres" else None
    with open_saver(kind, serde, pg_url, str(tmp_path / "savers.sqlite")) as saver:
        yield Backend(kind, serde, saver, pg_url)


# -- realistic threads ------------------------------------------------------------------------------


@dataclass
class Thread:
    """Puts checkpoints the way the Pregel loop does: only changed channels in ``new_versions``."""

    backend: Backend
    thread_id: str
    ns: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    configs: list[dict] = field(default_factory=list)
    step: int = 0

    def run(self, run_id: str, n: int = 3, *, parents: dict | None = None, writes: bool = True) -> list[dict]:
        saver, enc = self.backend.saver, self.backend.enc
        stored = []
        for _ in range(n):
            step = self.step
            self.step += 1
            changed = {"messages": [f"message {k}" for k in range(step + 1)], "count": step}
            if "settings" not in self.values:
                changed["settings"] = {"model": "m", "tools": ["a", "b"]}  # written once, then referenced
            new_versions = {}
            for channel, value in changed.items():
                self.versions[channel] = saver.get_next_version(self.versions.get(channel), None)
                new_versions[channel] = self.versions[channel]
                self.values[channel] = enc(value)
            checkpoint = {
                "v": 4,
                "id": str(uuid6(clock_seq=step)),
                "ts": f"2026-01-01T00:00:{step:02d}+00:00",
                "channel_values": dict(self.values),
                "channel_versions": dict(self.versions),
                "versions_seen": {"node": {"messages": self.versions["messages"]}},
                "updated_channels": sorted(changed),
            }
            config = {"configurable": {"thread_id": self.thread_id, "checkpoint_ns": self.ns}}
            if self.configs:
                config["configurable"]["checkpoint_id"] = self.configs[-1]["configurable"]["checkpoint_id"]
            metadata = {"source": "loop", "step": step, "parents": parents or {}, "run_id": run_id}
            saved = saver.put(config, checkpoint, metadata, new_versions)
            if writes:
                saver.put_writes(
                    saved, [("messages", enc([f"reply {step}"])), ("count", step + 1)], f"task-{step}", "~p"
                )
                saver.put_writes(saved, [("__interrupt__", enc({"why": step}))], f"other-{step}")
            self.configs.append(saved)
            stored.append(saved)
        return stored


def state(saver: Any, thread_id: str, ns: str = "") -> list[tuple]:
    """Everything ``list`` returns for a thread namespace, in a comparable form (newest first)."""
    return [
        (
            t.config["configurable"]["checkpoint_id"],
            t.checkpoint["channel_values"],
            t.checkpoint["channel_versions"],
            t.metadata,
            t.pending_writes,
            t.parent_config and t.parent_config["configurable"]["checkpoint_id"],
        )
        for t in saver.list({"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}})
    ]


def head(saver: Any, thread_id: str, ns: str = "") -> Any:
    return saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}})


def blob_count(backend: Backend, thread_id: str) -> int | None:
    """Stored channel blobs of a thread (SQLite keeps values inside the checkpoint: ``None``)."""
    if backend.kind == "postgres":
        return backend.sql("SELECT count(*) FROM checkpoint_blobs WHERE thread_id = %s", (thread_id,))[0][0]
    if backend.kind == "memory":
        with backend.saver.lock:
            return sum(1 for key in backend.saver.blobs if key[0] == thread_id)
    return None


def referenced_blobs(backend: Backend, thread_id: str) -> int:
    """Distinct (namespace, channel, version) the thread's checkpoints keep in blobs.

    PostgresSaver keeps ``count`` (an int) inline in the checkpoint; InMemorySaver keeps every value in a blob.
    """
    stored_apart = (
        ("messages", "settings") if backend.kind == "postgres" else ("messages", "settings", "count")
    )
    refs = set()
    for t in backend.saver.list({"configurable": {"thread_id": thread_id}}):
        for channel, version in t.checkpoint["channel_versions"].items():
            if channel in stored_apart:
                refs.add((t.config["configurable"]["checkpoint_ns"], channel, version))
    return len(refs)


# -- conformance ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "serde"), [p.values[0] for p in BACKENDS], ids=[p.id for p in BACKENDS])
async def test_conformance(kind: str, serde: str, request: pytest.FixtureRequest, tmp_path) -> None:
    pg_url = request.getfixturevalue("fresh_pg") if kind == "postgres" else None
    created: list[BaseCheckpointSaver] = []

    @checkpointer_test(name=f"{kind}-{serde}")
    async def factory():
        with open_saver(kind, serde, pg_url, str(tmp_path / f"conformance-{len(created)}.sqlite")) as saver:
            # The suite only awaits; SQLite and Postgres savers are sync, so they run through the adapter.
            tested = saver if kind == "memory" else SyncAdapter(saver)
            created.append(tested)
            yield tested

    report = await validate(factory)
    for name, result in report.results.items():
        for failure in result.failures:
            print(f"{kind}-{serde} {name} FAILED: {failure}")
    detected = {Capability(name) for name, result in report.results.items() if result.detected}
    assert detected == set(ALL_CAPABILITIES) and len(detected) == 8
    assert report.passed_all()
    assert all(result.tests_passed > 0 and result.tests_failed == 0 for result in report.results.values())
    assert created and all(
        DetectedCapabilities.from_instance(s).detected == ALL_CAPABILITIES for s in created
    )


@pytest.mark.parametrize("cls", [PostgresLifecycleSaver, SqliteLifecycleSaver, InMemoryLifecycleSaver])
def test_capabilities_the_service_sees(cls: type) -> None:
    assert saver_capabilities(cls) == LIFECYCLE | {"delta_channel_history"}


def test_postgres_saver_takes_postgres_savers_arguments_in_its_order(fresh_pg: str) -> None:
    serde = VerbatimSerde()
    kwargs = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
    with psycopg.Connection.connect(fresh_pg, **kwargs) as conn, conn.pipeline() as pipe:
        saver = PostgresLifecycleSaver(conn, pipe, serde)
        assert (saver.conn, saver.pipe, saver.serde) == (conn, pipe, serde)
        settings = [saver.keep_checkpoints, saver.pruned_table, saver.summaries_table, saver.latest_cache]
        assert settings == [None] * 4
    with ConnectionPool(fresh_pg, min_size=1, max_size=1, kwargs=kwargs, open=True) as pool:
        with psycopg.Connection.connect(fresh_pg, **kwargs) as conn, conn.pipeline() as pipe:
            # PostgresSaver's own check: a pipeline belongs to one connection.
            with pytest.raises(ValueError, match="Pipeline should be used only with a single Connection"):
                PostgresLifecycleSaver(pool, pipe)


def test_sqlite_saver_takes_sqlite_savers_arguments() -> None:
    serde = VerbatimSerde()
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        saver = SqliteLifecycleSaver(conn, serde=serde)
        assert (saver.conn, saver.serde) == (conn, serde)
        assert [saver.keep_checkpoints, saver.pruned_table, saver.summaries_table] == [None] * 3
        with pytest.raises(TypeError):
            SqliteLifecycleSaver(conn, serde)  # type: ignore[misc]  # keyword-only, as on SqliteSaver
    finally:
        conn.close()


# -- prune ------------------------------------------------------------------------------------------


def test_keep_latest_keeps_the_head_with_its_writes_and_blobs(backend: Backend) -> None:
    saver = backend.saver
    root = Thread(backend, "t-root")
    root.run("run-1", 3)
    root.run("run-2", 2)
    child = Thread(backend, "t-root", ns="child")  # a checkpointer=True subgraph: keeps its head
    child.run("run-2", 3)
    other = Thread(backend, "t-other")
    other.run("run-1", 3)
    other_before = state(saver, "t-other")
    before = {ns: head(saver, "t-root", ns) for ns in ("", "child")}
    assert len(before[""].pending_writes) == 3

    saver.prune(["t-root"], strategy="keep_latest")

    for ns, previous in before.items():
        rows = state(saver, "t-root", ns)
        assert [r[0] for r in rows] == [previous.config["configurable"]["checkpoint_id"]]
        after = head(saver, "t-root", ns)
        assert after.config == previous.config
        assert after.checkpoint == previous.checkpoint  # values: messages, settings (5 puts old), count
        assert after.metadata == previous.metadata
        assert after.pending_writes == previous.pending_writes
        assert previous.parent_config is not None and after.parent_config is None
    assert backend.dec(head(saver, "t-root").checkpoint["channel_values"]["settings"]) == {
        "model": "m",
        "tools": ["a", "b"],
    }
    if (blobs := blob_count(backend, "t-root")) is not None:
        # Exactly what the two heads reference: no garbage left, nothing they need deleted.
        assert blobs == referenced_blobs(backend, "t-root") == {"postgres": 4, "memory": 6}[backend.kind]
    if backend.kind == "sqlite":
        assert backend.sql("SELECT count(*) FROM writes WHERE thread_id = %s", ("t-root",))[0][0] == 6
    assert state(saver, "t-other") == other_before


def test_keep_latest_deletes_a_finished_subgraph_call_with_its_root(backend: Backend) -> None:
    saver = backend.saver
    root = Thread(backend, "t")
    started_from = root.run("run-1", 2)[-1]["configurable"]["checkpoint_id"]
    call = Thread(backend, "t", ns="tools:6d1f")
    call.run("run-1", 2, parents={"": started_from})
    root.run("run-1", 2)
    saver.prune(["t"])
    assert len(state(saver, "t")) == 1
    assert state(saver, "t", "tools:6d1f") == []
    if backend.kind != "sqlite":
        assert (
            blob_count(backend, "t")
            == referenced_blobs(backend, "t")
            == {"postgres": 2, "memory": 3}[backend.kind]
        )


def test_prune_delete_removes_everything_of_the_threads(backend: Backend) -> None:
    saver = backend.saver
    Thread(backend, "a").run("r", 3)
    Thread(backend, "a", ns="child").run("r", 2)
    Thread(backend, "b").run("r", 2)
    b_before = state(saver, "b")
    saver.prune(["a"], strategy="delete")
    assert list(saver.list({"configurable": {"thread_id": "a"}})) == []
    assert blob_count(backend, "a") in (0, None)
    assert state(saver, "b") == b_before
    with pytest.raises(TypeError):
        saver.prune("b")
    with pytest.raises(ValueError, match="Unknown prune strategy"):
        saver.prune(["b"], strategy="keep_some")
    assert state(saver, "b") == b_before


def test_keep_latest_refuses_delta_channel_threads_and_prunes_nothing(backend: Backend) -> None:
    saver = backend.saver
    plain = Thread(backend, "plain")
    plain.run("r", 3)
    counted = Thread(backend, "counted")
    counted.run("r", 3)
    # A DeltaChannel's counters in the metadata of the newest checkpoint.
    config = {
        "configurable": {
            "thread_id": "counted",
            "checkpoint_ns": "",
            "checkpoint_id": counted.configs[-1]["configurable"]["checkpoint_id"],
        }
    }
    checkpoint = {**head(saver, "counted").checkpoint, "id": str(uuid6(clock_seq=99))}
    checkpoint["channel_values"] = {**counted.values}
    metadata = {
        "source": "loop",
        "step": 9,
        "parents": {},
        "counters_since_delta_snapshot": {"items": [1, 1]},
    }
    saver.put(config, checkpoint, metadata, {})
    before = {t: state(saver, t) for t in ("plain", "counted")}

    with pytest.raises(NotImplementedError, match="DeltaChannel: counted$"):
        saver.prune(["plain", "counted"], strategy="keep_latest")
    assert {t: state(saver, t) for t in before} == before

    # The only marker a snapshot leaves: the value itself (the snapshot checkpoint resets the counters).
    snapshot = Thread(backend, "snapshot")
    snapshot.run("r", 2)
    snapshot.values["items"] = backend.enc(_DeltaSnapshot(["a", "b"]))
    snapshot.versions["items"] = saver.get_next_version(None, None)
    config = {
        "configurable": {
            "thread_id": "snapshot",
            "checkpoint_ns": "",
            "checkpoint_id": snapshot.configs[-1]["configurable"]["checkpoint_id"],
        }
    }
    checkpoint = {**head(saver, "snapshot").checkpoint, "id": str(uuid6(clock_seq=98))}
    checkpoint["channel_values"] = dict(snapshot.values)
    checkpoint["channel_versions"] = dict(snapshot.versions)
    saver.put(
        config,
        checkpoint,
        {"source": "loop", "step": 5, "parents": {}},
        {"items": snapshot.versions["items"]},
    )
    Thread(backend, "snapshot").run("r", 1, writes=False)  # a later checkpoint without any marker
    before["snapshot"] = state(saver, "snapshot")

    with pytest.raises(NotImplementedError, match="DeltaChannel: snapshot$"):
        saver.prune(["plain", "snapshot"])
    assert {t: state(saver, t) for t in before} == before

    saver.prune(["plain"])
    assert len(state(saver, "plain")) == 1
    saver.prune(["counted", "snapshot"], strategy="delete")  # "delete" needs no history
    assert state(saver, "counted") == state(saver, "snapshot") == []


def _extend(current: list, writes: list) -> list:
    return [*current, *(x for w in writes for x in (w if isinstance(w, list) else [w]))]


class _DeltaState(TypedDict):
    items: Annotated[list, DeltaChannel(_extend, snapshot_frequency=3)]


@pytest.mark.parametrize("kind", KINDS)
def test_keep_latest_refuses_a_real_delta_channel_graph(kind: str, request: pytest.FixtureRequest) -> None:
    builder = StateGraph(_DeltaState)
    builder.add_node("node", lambda s: {"items": ["x"]})
    builder.add_edge(START, "node")
    builder.add_edge("node", END)
    pg_url = request.getfixturevalue("fresh_pg") if kind == "postgres" else None
    with open_saver(kind, "default", pg_url) as saver:
        graph = builder.compile(checkpointer=saver)
        config = {"configurable": {"thread_id": "delta"}}
        for _ in range(4):
            graph.invoke({"items": ["in"]}, config)
        before = state(saver, "delta")
        with pytest.raises(NotImplementedError, match="DeltaChannel: delta"):
            saver.prune(["delta"])
        assert state(saver, "delta") == before
        assert graph.get_state(config).values["items"] == ["in", "x"] * 4


# -- delete_for_runs --------------------------------------------------------------------------------


def test_delete_for_runs_keeps_other_runs_readable(backend: Backend) -> None:
    saver = backend.saver
    thread = Thread(backend, "t")
    first = thread.run("run-a", 3)
    second = thread.run("run-b", 2)  # continues from run-a's head; "settings" still points at run-a's blob
    child = Thread(backend, "t", ns="child")
    child.run("run-a", 2)
    other = Thread(backend, "t-other")
    other.run("run-a", 2)
    Thread(backend, "t-other", ns="x").run("run-c", 1)
    head_before = head(saver, "t")
    run_b_before = state(saver, "t")[:2]
    other_x_before = state(saver, "t-other", "x")

    saver.delete_for_runs(["run-a"])

    rows = state(saver, "t")
    assert [r[0] for r in rows] == [c["configurable"]["checkpoint_id"] for c in reversed(second)]
    assert rows[0] == run_b_before[0]
    assert rows[1][:5] == run_b_before[1][:5] and rows[1][5] is None  # its parent (run-a's head) is gone
    after = head(saver, "t")
    assert (after.checkpoint, after.metadata, after.pending_writes) == (
        head_before.checkpoint,
        head_before.metadata,
        head_before.pending_writes,
    )
    assert backend.dec(after.checkpoint["channel_values"]["settings"]) == {"model": "m", "tools": ["a", "b"]}
    for config in first:
        assert saver.get_tuple(config) is None
    assert state(saver, "t", "child") == []
    assert state(saver, "t-other") == []
    assert state(saver, "t-other", "x") == other_x_before
    if backend.kind == "sqlite":
        assert backend.sql("SELECT count(*) FROM writes WHERE thread_id = %s", ("t",))[0][0] == 2 * 3
    else:
        # run-b's blobs, plus the settings blob run-a wrote and run-b still references; nothing else.
        expected = {"postgres": (3, 2), "memory": (5, 3)}[backend.kind]
        assert blob_count(backend, "t") == referenced_blobs(backend, "t") == expected[0]
        assert blob_count(backend, "t-other") == referenced_blobs(backend, "t-other") == expected[1]

    saver.delete_for_runs(["run-b", "run-c"])
    assert list(saver.list(None)) == []
    assert blob_count(backend, "t") in (0, None)
    with pytest.raises(TypeError):
        saver.delete_for_runs("run-b")


# -- copy_thread ------------------------------------------------------------------------------------


def test_copy_thread_target_reads_like_the_source(backend: Backend) -> None:
    saver = backend.saver
    source = Thread(backend, "src")
    source.run("run-1", 3)
    source.run("run-2", 2)
    Thread(backend, "src", ns="child:1").run(
        "run-2", 2, parents={"": source.configs[1]["configurable"]["checkpoint_id"]}
    )
    before = {ns: state(saver, "src", ns) for ns in ("", "child:1")}

    saver.copy_thread("src", "dst")

    for ns, rows in before.items():
        assert state(saver, "dst", ns) == rows
        assert state(saver, "src", ns) == rows
        assert head(saver, "dst", ns).config["configurable"]["thread_id"] == "dst"
        parent = head(saver, "dst", ns).parent_config["configurable"]
        assert parent["thread_id"] == "dst" and saver.get_tuple({"configurable": parent}) is not None
    assert blob_count(backend, "dst") == blob_count(backend, "src")

    # The copy is a thread of its own.
    Thread(
        backend,
        "dst",
        configs=[head(saver, "dst").config],
        versions=dict(source.versions),
        values=dict(source.values),
        step=5,
    ).run("run-3", 1)
    saver.prune(["src"])
    assert len(state(saver, "dst")) == 6 and len(state(saver, "src")) == 1

    # The target must be unused; a missing source copies nothing.
    dst_before = state(saver, "dst")
    with pytest.raises(ThreadNotEmptyError, match="'dst'"):
        saver.copy_thread("src", "dst")
    with pytest.raises(ValueError, match="same thread"):
        saver.copy_thread("src", "src")
    assert state(saver, "dst") == dst_before
    saver.copy_thread("missing", "new")
    assert state(saver, "new") == [] and blob_count(backend, "new") in (0, None)


def test_copy_thread_refuses_a_target_holding_only_writes(backend: Backend) -> None:
    saver = backend.saver
    Thread(backend, "src").run("r", 1)
    # Writes can commit before their checkpoint does: such a target is in use too.
    orphan = {"configurable": {"thread_id": "dst", "checkpoint_ns": "", "checkpoint_id": str(uuid6())}}
    saver.put_writes(orphan, [("count", 1)], "task")
    with pytest.raises(ThreadNotEmptyError):
        saver.copy_thread("src", "dst")
    assert list(saver.list({"configurable": {"thread_id": "dst"}})) == []


# -- atomicity ----------------------------------------------------------------------------------------


def _pg_fail_on(url: str, table: str, event: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE OR REPLACE FUNCTION rs_fail() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'injected failure'; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER rs_fail BEFORE {event} ON {table} FOR EACH ROW EXECUTE FUNCTION rs_fail()"
        )


def _pg_clear(url: str, table: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP TRIGGER rs_fail ON {table}")


def _sqlite_fail_on(saver: SqliteLifecycleSaver, table: str, event: str) -> None:
    with saver.lock:
        saver.conn.execute(
            f"CREATE TRIGGER rs_fail BEFORE {event} ON {table} BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
        )


def _sqlite_clear(saver: SqliteLifecycleSaver) -> None:
    with saver.lock:
        saver.conn.execute("DROP TRIGGER rs_fail")


def _tables(backend: Backend) -> dict:
    if backend.kind == "postgres":
        tables = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")
    else:
        tables = ("checkpoints", "writes")
    return {table: sorted(map(tuple, backend.sql(f"SELECT * FROM {table}"))) for table in tables}


# Each operation fails at its last statement (or, for a copy, its last table).
FAILURES: dict[str, list[tuple[str, str, str, Callable[[Any], None]]]] = {
    "postgres": [
        ("copy_thread", "checkpoint_writes", "INSERT", lambda s: s.copy_thread("t", "copy")),
        ("delete_for_runs", "checkpoint_blobs", "DELETE", lambda s: s.delete_for_runs(["run-a"])),
        ("keep_latest", "checkpoint_blobs", "DELETE", lambda s: s.prune(["t"])),
        ("delete", "checkpoint_writes", "DELETE", lambda s: s.prune(["t", "u"], strategy="delete")),
    ],
    "sqlite": [
        ("copy_thread", "writes", "INSERT", lambda s: s.copy_thread("t", "copy")),
        ("delete_for_runs", "checkpoints", "UPDATE", lambda s: s.delete_for_runs(["run-a"])),
        ("keep_latest", "checkpoints", "UPDATE", lambda s: s.prune(["u", "t"])),
        ("delete", "checkpoints", "DELETE", lambda s: s.prune(["t", "u"], strategy="delete")),
    ],
}


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
@pytest.mark.parametrize("operation", ["copy_thread", "delete_for_runs", "keep_latest", "delete"])
def test_a_failure_half_way_changes_nothing(
    kind: str, operation: str, request: pytest.FixtureRequest, tmp_path
) -> None:
    _, table, event, call = next(f for f in FAILURES[kind] if f[0] == operation)
    pg_url = request.getfixturevalue("fresh_pg") if kind == "postgres" else None
    with open_saver(kind, "verbatim", pg_url, str(tmp_path / "atomic.sqlite")) as saver:
        backend = Backend(kind, "verbatim", saver, pg_url)
        thread = Thread(backend, "t")
        thread.run("run-a", 3)
        thread.run("run-b", 2)
        Thread(backend, "u").run("run-a", 2)
        before = _tables(backend)
        if kind == "postgres":
            _pg_fail_on(pg_url, table, event)
        else:
            _sqlite_fail_on(saver, table, event)
        error = psycopg.Error if kind == "postgres" else sqlite3.Error
        with pytest.raises(error, match="injected failure"):
            call(saver)
        assert _tables(backend) == before
        # The saver and its connection stay usable, and the operation succeeds once nothing fails.
        if kind == "postgres":
            _pg_clear(pg_url, table)
        else:
            _sqlite_clear(saver)
        call(saver)
        assert _tables(backend) != before


def test_in_memory_lifecycle_is_atomic_when_decoding_fails() -> None:
    """The in-memory saver computes every change before applying one: a failure leaves all as it was."""
    saver = InMemoryLifecycleSaver()
    backend = Backend("memory", "default", saver, None)
    Thread(backend, "t").run("run-a", 3)
    Thread(backend, "u").run("run-a", 2)

    def contents() -> tuple:
        storage = {t: {ns: dict(cps) for ns, cps in nss.items()} for t, nss in saver.storage.items()}
        return storage, {k: dict(v) for k, v in saver.writes.items()}, dict(saver.blobs)

    before = contents()
    original = saver.serde.loads_typed
    calls = {"n": 0, "fail_at": 0}

    def flaky(data):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected failure")
        return original(data)

    saver.serde.loads_typed = flaky
    # delete_for_runs reads 5 metadata, prune 5 metadata, then 3 checkpoints of "t" and 2 of "u":
    # both fail on the second thread, after the first one's changes are computed.
    for fail_at, call in [
        (4, lambda: saver.delete_for_runs(["run-a"])),
        (9, lambda: saver.prune(["t", "u"])),
    ]:
        calls.update(n=0, fail_at=fail_at)
        with pytest.raises(RuntimeError, match="injected failure"):
            call()
        assert contents() == before
    saver.serde.loads_typed = original
    saver.prune(["t", "u"])
    assert contents() != before and len(state(saver, "t")) == 1


def test_sqlite_transactions_work_in_sqlite3_default_mode(tmp_path) -> None:
    """Connections opened without ``isolation_level=None`` (sqlite3's implicit transactions) work too."""
    conn = sqlite3.connect(tmp_path / "legacy.sqlite", check_same_thread=False)
    try:
        saver = SqliteLifecycleSaver(conn)
        backend = Backend("sqlite", "default", saver, None)
        Thread(backend, "t").run("run-a", 3)
        saver.copy_thread("t", "c")
        saver.delete_for_runs(["nothing"])
        saver.prune(["t"])
        assert len(state(saver, "t")) == 1 and len(state(saver, "c")) == 3
        assert not conn.in_transaction
    finally:
        conn.close()


def test_in_memory_lifecycle_runs_alongside_other_calls() -> None:
    """Lifecycle calls iterate the saver's dicts; puts and reads in other threads must not disturb them."""
    import threading

    saver = InMemoryLifecycleSaver(serde=VerbatimSerde())
    backend = Backend("memory", "verbatim", saver, None)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(name: str) -> None:
        try:
            while not stop.is_set():
                thread = Thread(backend, f"{name}-{uuid6()}")
                thread.run(f"run-{name}", 2)
                list(saver.list(None, limit=5))
                saver.get_tuple(thread.configs[-1])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(3)]
    for worker in workers:
        worker.start()
    try:
        Thread(backend, "base").run("run-base", 2)
        for i in range(150):
            saver.copy_thread("base", f"copy-{i}")
            saver.prune([f"copy-{i}"], strategy="keep_latest" if i % 2 else "delete")
            saver.delete_for_runs([f"run-w{i % 3}"])
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert errors == []
    assert len(state(saver, "base")) == 2 and len(state(saver, "copy-149")) == 1
