"""Keeping the last K checkpoints (``keep_checkpoints``) on PostgreSQL, SQLite and in memory.

Every put goes to the saver under test and, unchanged, to a stock ``InMemorySaver`` that keeps everything
(``Tee``), so the checkpoint ids are the same on both. After any history of puts, forks and pending writes,
each namespace must hold exactly its newest K checkpoints plus every branch head (a checkpoint no other one
names as parent), each readable with ``get_tuple`` as the unpruned saver returns it, and no blob or write
that no kept checkpoint references.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, interrupt
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver
from tests.service.storage.test_savers import KINDS, open_saver

_ids = itertools.count()
_clock = itertools.count(1)
_guard = threading.Lock()


def _new_id() -> str:
    with _guard:
        return str(uuid6(clock_seq=next(_clock) % 16384))


class Tee:
    """Writes go to ``saver`` and to an unpruned ``InMemorySaver``; ``reference`` answers what a saver that
    keeps everything would."""

    def __init__(self, saver: Any) -> None:
        self.saver = saver
        self.reference = InMemorySaver()
        self.lock = threading.Lock()

    def put(self, config: dict, checkpoint: dict, metadata: dict, new_versions: dict) -> dict:
        saved = self.saver.put(config, checkpoint, metadata, new_versions)
        with self.lock:
            self.reference.put(config, checkpoint, metadata, new_versions)
        return saved

    def put_writes(self, config: dict, writes: list, task_id: str) -> None:
        self.saver.put_writes(config, writes, task_id)
        with self.lock:
            self.reference.put_writes(config, writes, task_id)


def _config(thread_id: str, ns: str, checkpoint_id: str | None = None) -> dict:
    configurable = {"thread_id": thread_id, "checkpoint_ns": ns}
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def stored_ids(saver: Any, thread_id: str, ns: str) -> list[str]:
    return [t.config["configurable"]["checkpoint_id"] for t in saver.list(_config(thread_id, ns))]


def expected_ids(reference: InMemorySaver, thread_id: str, ns: str, keep: int) -> set[str]:
    """The newest ``keep`` of everything ever put, and every checkpoint nobody names as parent."""
    parents = {cid: parent for cid, (_, _, parent) in reference.storage[thread_id][ns].items()}
    newest = sorted(parents, reverse=True)[:keep]
    return set(newest) | (set(parents) - set(parents.values()))


def _call_root(reference: InMemorySaver, thread_id: str, ns: str) -> str | None:
    """The root checkpoint a subgraph call started from: its newest checkpoint's ``parents[""]``."""
    checkpoints = reference.storage[thread_id][ns]
    metadata = reference.serde.loads_typed(checkpoints[max(checkpoints)][1])
    return (metadata.get("parents") or {}).get("")


def _readable(t: Any) -> tuple:
    return (
        t.checkpoint["id"],
        t.checkpoint["channel_values"],
        t.checkpoint["channel_versions"],
        t.metadata,
        sorted(t.pending_writes),
    )


def check_thread(saver: Any, reference: InMemorySaver, kind: str, thread_id: str, keep: int) -> int:
    """Assert the rule on every namespace of a thread; return how many checkpoints are kept."""
    kept_total = 0
    roots = reference.storage[thread_id].get("", {})
    kept_roots = set(stored_ids(saver, thread_id, ""))
    for ns in reference.storage[thread_id]:
        kept = set(stored_ids(saver, thread_id, ns))
        if ":" in ns and _call_root(reference, thread_id, ns) in set(roots) - kept_roots:
            assert kept == set(), f"subgraph call {ns} outlived its root checkpoint"
            continue
        assert kept == expected_ids(reference, thread_id, ns, keep), ns
        kept_total += len(kept)
        for checkpoint_id in kept:
            mine = saver.get_tuple(_config(thread_id, ns, checkpoint_id))
            theirs = reference.get_tuple(_config(thread_id, ns, checkpoint_id))
            assert _readable(mine) == _readable(theirs)
            parent = theirs.parent_config and theirs.parent_config["configurable"]["checkpoint_id"]
            want_parent = parent if parent in kept else None
            assert (mine.parent_config and mine.parent_config["configurable"]["checkpoint_id"]) == want_parent
        assert _readable(saver.get_tuple(_config(thread_id, ns))) == _readable(
            reference.get_tuple(_config(thread_id, ns))
        )
    _check_nothing_unreferenced(saver, kind, thread_id)
    return kept_total


def _check_nothing_unreferenced(saver: Any, kind: str, thread_id: str) -> None:
    """No blob and no write outlives the kept checkpoints that reference it."""
    referenced, kept = set(), set()
    for t in saver.list({"configurable": {"thread_id": thread_id}}):
        ns = t.config["configurable"]["checkpoint_ns"]
        kept.add((ns, t.checkpoint["id"]))
        referenced |= {
            (ns, channel, str(version)) for channel, version in t.checkpoint["channel_versions"].items()
        }
    if kind == "postgres":
        with saver._cursor() as cur:
            cur.execute(
                "SELECT checkpoint_ns, channel, version FROM checkpoint_blobs WHERE thread_id = %s",
                (thread_id,),
            )
            blobs = {(r["checkpoint_ns"], r["channel"], r["version"]) for r in cur.fetchall()}
            cur.execute(
                "SELECT checkpoint_ns, checkpoint_id FROM checkpoint_writes WHERE thread_id = %s",
                (thread_id,),
            )
            writes = {(r["checkpoint_ns"], r["checkpoint_id"]) for r in cur.fetchall()}
    elif kind == "memory":
        with saver.lock:
            blobs = {(ns, channel, str(version)) for t, ns, channel, version in saver.blobs if t == thread_id}
            writes = {(ns, cid) for (t, ns, cid), w in saver.writes.items() if t == thread_id and w}
    else:
        with saver.lock:
            rows = saver.conn.execute(
                "SELECT checkpoint_ns, checkpoint_id FROM writes WHERE thread_id = ?", (thread_id,)
            ).fetchall()
        blobs, writes = set(), {tuple(r) for r in rows}
    assert blobs <= referenced
    assert writes <= kept


# -- random histories -------------------------------------------------------------------------------

CHANNELS = ("messages", "profile", "count")
NAMESPACES = ("", "tools:1")


@dataclass
class History:
    """Puts like the Pregel loop's: a new checkpoint copies its parent's values and versions and changes
    the channels ``mask`` names (unchanged channels keep pointing at versions written long before)."""

    tee: Tee
    thread_id: str
    tasks: Iterator[int] = field(default_factory=itertools.count)

    def put(self, ns: str, parent_id: str | None, mask: int, root: str | None = None) -> str:
        saver, reference = self.tee.saver, self.tee.reference
        with self.tee.lock:
            parent = reference.get_tuple(_config(self.thread_id, ns, parent_id)) if parent_id else None
        values = dict(parent.checkpoint["channel_values"]) if parent else {}
        versions = dict(parent.checkpoint["channel_versions"]) if parent else {}
        checkpoint_id = _new_id()
        new_versions = {}
        for bit, channel in enumerate(CHANNELS):
            if mask & (1 << bit) or channel not in versions:
                new_versions[channel] = versions[channel] = saver.get_next_version(
                    versions.get(channel), None
                )
                values[channel] = (
                    len(values)
                    if channel == "count"
                    else [f"{channel} of {checkpoint_id}", {"at": checkpoint_id}]
                )
        checkpoint = {
            "v": 4,
            "id": checkpoint_id,
            "ts": "2026-01-01T00:00:00+00:00",
            "channel_values": values,
            "channel_versions": versions,
            "versions_seen": {},
            "updated_channels": sorted(new_versions),
        }
        metadata = {"source": "loop", "step": len(versions), "parents": {"": root or "root"} if ns else {}}
        saved = self.tee.put(_config(self.thread_id, ns, parent_id), checkpoint, metadata, new_versions)
        return saved["configurable"]["checkpoint_id"]

    def writes(self, ns: str, checkpoint_id: str) -> None:
        task = next(self.tasks)
        self.tee.put_writes(
            _config(self.thread_id, ns, checkpoint_id),
            [("messages", [f"w{task}"]), ("count", task)],
            f"task-{task}",
        )


OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "append", "append", "fork", "writes"]),
        st.booleans(),
        st.integers(0, 10_000),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=40,
)


def run_history(saver: Any, kind: str, keep: int, ops: list[tuple]) -> None:
    tee = Tee(saver)
    history = History(tee, f"t-{next(_ids)}")
    for op, where, choice, mask in ops:
        root = None
        if where:  # a subgraph call from the newest root checkpoint, in a namespace of its own
            roots = stored_ids(saver, history.thread_id, "")
            root = max(roots) if roots else history.put("", None, mask)
        ns = f"tools:{root}" if root else ""
        kept = sorted(stored_ids(saver, history.thread_id, ns))
        if op == "append" or not kept:
            history.put(ns, kept[-1] if kept else None, mask, root)
        elif op == "fork":  # from any checkpoint still kept, the newest included
            history.put(ns, kept[choice % len(kept)], mask, root)
        else:
            history.writes(ns, kept[choice % len(kept)])
    check_thread(saver, tee.reference, kind, history.thread_id, keep)


@pytest.fixture(params=KINDS)
def kept_saver(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[str, Any]]:
    kind = request.param
    pg_url = request.getfixturevalue("fresh_pg") if kind == "postgres" else None
    with open_saver(kind, "default", pg_url, str(tmp_path / "k.sqlite")) as saver:
        yield kind, saver


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.integers(1, 4), ops=OPS)
def test_random_histories_keep_the_newest_k_and_branch_heads(kept_saver, keep: int, ops: list[tuple]) -> None:
    kind, saver = kept_saver
    saver.keep_checkpoints = keep
    run_history(saver, kind, keep, ops)


def test_the_config_overrides_the_saver_and_zero_keeps_everything(kept_saver) -> None:
    kind, saver = kept_saver
    saver.keep_checkpoints = 2
    tee = Tee(saver)
    history = History(tee, "own")
    last = None
    for _ in range(6):
        last = history.put("", last, 1)
    assert len(stored_ids(saver, "own", "")) == 2
    saver.keep_checkpoints = None
    per_thread = {"configurable": {"thread_id": "own", "checkpoint_ns": "", "keep_checkpoints": 3}}
    checkpoint = tee.reference.get_tuple(_config("own", "", last)).checkpoint
    tee.put(
        {**per_thread, "configurable": {**per_thread["configurable"], "checkpoint_id": last}},
        {**checkpoint, "id": _new_id()},
        {},
        {},
    )
    assert len(stored_ids(saver, "own", "")) == 3
    for value in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="keep_checkpoints must be a whole number >= 0"):
            saver.put(
                {"configurable": {"thread_id": "own", "checkpoint_ns": "", "keep_checkpoints": value}},
                {**checkpoint, "id": _new_id()},
                {},
                {},
            )
    saver.keep_checkpoints = 1
    zero = {"configurable": {"thread_id": "all", "checkpoint_ns": "", "keep_checkpoints": 0}}
    for _ in range(4):
        saver.put(zero, {**checkpoint, "id": _new_id()}, {}, {})
    assert len(stored_ids(saver, "all", "")) == 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("keep", [None, 2])
def test_keep_checkpoints_given_to_the_constructor_applies_from_the_first_put(
    kind: str, keep: int | None, request: pytest.FixtureRequest, tmp_path
) -> None:
    pg_url = request.getfixturevalue("fresh_pg") if kind == "postgres" else None
    with open_saver(kind, "default", pg_url, str(tmp_path / "c.sqlite"), keep_checkpoints=keep) as saver:
        tee = Tee(saver)
        history = History(tee, "built")
        last = None
        for _ in range(5):
            last = history.put("", last, 1)
        assert len(stored_ids(saver, "built", "")) == (5 if keep is None else keep)
        if keep is not None:
            check_thread(saver, tee.reference, kind, "built", keep)


# -- a real graph: subgraphs, interrupts, update_state, forks ------------------------------------------


# Messages carry ids of their own: add_messages would otherwise give them one while a put of the same
# objects is being written in the background, and the two savers could store different bytes.
class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    notes: list[str]


def _graph(checkpointer: Any) -> Any:
    def research(state: State) -> dict:
        return {"notes": [*state.get("notes", []), f"looked up {len(state['messages'])}"]}

    sub = StateGraph(State)
    sub.add_node("research", research)
    sub.add_edge(START, "research")
    sub.add_edge("research", END)

    def ask(state: State) -> dict:
        answer = interrupt("approve?")
        return {"messages": [AIMessage(f"approved: {answer}", id=f"approved-{answer}")]}

    def reply(state: State) -> dict:
        last = state["messages"][-1]
        return {"messages": [AIMessage(f"reply to {last.content}", id=f"reply-{last.id}")]}

    builder = StateGraph(State)
    # "sub" keeps its state across calls in one namespace; "lookup" gets a namespace per call.
    builder.add_node("sub", sub.compile(checkpointer=True))
    builder.add_node("lookup", sub.compile())
    builder.add_node("ask", ask)
    builder.add_node("reply", reply)
    builder.add_edge(START, "sub")
    builder.add_edge("sub", "lookup")
    builder.add_edge("lookup", "ask")
    builder.add_edge("ask", "reply")
    builder.add_edge("reply", END)
    return builder.compile(checkpointer=checkpointer)


class TeeSaver(InMemorySaver):
    """A checkpointer for a graph: reads from the pruned saver, writes to both it and ``reference``."""

    def __init__(self, saver: Any) -> None:
        super().__init__()
        self.inner = saver
        self.reference = InMemorySaver()

    def get_tuple(self, config):
        return self.inner.get_tuple(config)

    def list(self, config, **kwargs):
        return self.inner.list(config, **kwargs)

    def put(self, config, checkpoint, metadata, new_versions):
        self.reference.put(config, checkpoint, metadata, new_versions)
        return self.inner.put(config, checkpoint, metadata, new_versions)

    def put_writes(self, config, writes, task_id, task_path=""):
        self.reference.put_writes(config, writes, task_id, task_path)
        self.inner.put_writes(config, writes, task_id, task_path)

    def get_next_version(self, current, channel):
        return self.inner.get_next_version(current, channel)


@pytest.mark.parametrize("keep", [3, 5])
def test_a_graph_with_subgraphs_interrupts_and_forks(kept_saver, keep: int) -> None:
    kind, saver = kept_saver
    saver.keep_checkpoints = keep
    tee = TeeSaver(saver)
    graph = _graph(tee)
    config = {"configurable": {"thread_id": "chat"}}
    for turn in range(6):
        graph.invoke({"messages": [HumanMessage(f"q{turn}", id=f"q{turn}")]}, config)
        assert graph.get_state(config).interrupts
        graph.invoke(Command(resume=f"yes {turn}"), config)
        assert graph.get_state(config).values["messages"][-1].content == f"reply to approved: yes {turn}"
    history = list(graph.get_state_history(config))
    assert keep <= len(history) < 6 * 6
    # Fork from the oldest checkpoint still kept, and from one in the middle, and run each branch on (the
    # first branch's puts may delete the second's start: it is picked from what is kept then).
    for pick in (lambda kept: kept[-1], lambda kept: kept[len(kept) // 2]):
        snapshot = pick(list(graph.get_state_history(config)))
        forked = graph.update_state(snapshot.config, {"notes": ["forked"]})
        if graph.get_state(forked).next:
            graph.invoke(None if not graph.get_state(forked).interrupts else Command(resume="fork"), forked)
    graph.update_state(config, {"notes": ["edited"]})
    graph.invoke({"messages": [HumanMessage("last", id="last")]}, config)
    graph.invoke(Command(resume="done"), config)
    values = graph.get_state(config).values
    assert [m.content for m in values["messages"]][-2:] == ["approved: done", "reply to approved: done"]
    kept = check_thread(saver, tee.reference, kind, "chat", keep)
    total = sum(len(c) for c in tee.reference.storage["chat"].values())
    assert kept < total
    calls = [ns for ns in tee.reference.storage["chat"] if ns.startswith("lookup:")]
    stored_calls = [ns for ns in calls if stored_ids(saver, "chat", ns)]
    assert len(calls) >= 7 and len(stored_calls) < len(calls)
    assert stored_ids(saver, "chat", "sub")


# -- two replicas on one PostgreSQL --------------------------------------------------------------------


@pytest.fixture
def replicas(fresh_pg: str) -> Iterator[list[PostgresLifecycleSaver]]:
    """Two savers on pools of their own: two replicas of the service on one database."""
    kwargs = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
    with (
        ConnectionPool(fresh_pg, min_size=1, max_size=2, kwargs=kwargs) as pool_a,
        ConnectionPool(fresh_pg, min_size=1, max_size=2, kwargs=kwargs) as pool_b,
    ):
        savers = [PostgresLifecycleSaver(pool) for pool in (pool_a, pool_b)]
        savers[0].setup()
        yield savers


WRITER_OPS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 7), st.booleans()), min_size=5, max_size=40)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keep=st.integers(1, 3), ops=st.tuples(WRITER_OPS, WRITER_OPS))
def test_two_replicas_writing_and_pruning_one_thread_lose_nothing_kept(
    replicas: list[PostgresLifecycleSaver], fresh_pg: str, keep: int, ops: tuple[list, list]
) -> None:
    """Two replicas extend branches of one thread at once (three branches each, in the root namespace and a
    subgraph's), every put pruning the namespace it wrote; what the rule keeps is all there and readable
    at the end, also by a stock PostgresSaver."""
    for replica in replicas:
        replica.keep_checkpoints = None
    tee = Tee(replicas[0])
    thread_id = f"shared-{next(_ids)}"
    history = History(tee, thread_id)
    root = history.put("", None, 7)
    # Each writer's branches start before the race and before any prune: once the root has a child, a
    # prune may delete it, and a fork from it after that would be a fork from a deleted checkpoint.
    heads = [
        [
            (NAMESPACES[b % 2], history.put(NAMESPACES[b % 2], root if b % 2 == 0 else None, b))
            for b in range(3)
        ]
        for _ in replicas
    ]
    for replica in replicas:
        replica.keep_checkpoints = keep
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        branch = History(Tee(replicas[index]), thread_id)
        branch.tee.reference, branch.tee.lock = tee.reference, tee.lock
        try:
            for choice, mask, with_writes in ops[index]:
                ns, parent = heads[index][choice]
                heads[index][choice] = (ns, branch.put(ns, parent, mask))
                if with_writes:
                    branch.writes(ns, heads[index][choice][1])
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check_thread(replicas[1], tee.reference, "postgres", thread_id, keep)
    with psycopg.connect(fresh_pg, autocommit=True, row_factory=dict_row) as conn:
        stock = PostgresSaver(conn)
        for t in stock.list({"configurable": {"thread_id": thread_id}}):
            assert _readable(t) == _readable(tee.reference.get_tuple(t.config))


# -- counts beyond 64 bits -----------------------------------------------------------------------------

BIGINT_MAX = 2**63 - 1


def test_a_count_beyond_64_bits_is_refused_at_start_naming_the_setting(capsys: pytest.CaptureFixture) -> None:
    from pydantic import ValidationError

    from reducing_saver.service.cli import main
    from reducing_saver.service.configuration.settings import Settings

    with pytest.raises(ValidationError, match="keep_checkpoints"):
        Settings(database="memory://", keep_checkpoints=2**63)
    assert Settings(database="memory://", keep_checkpoints=BIGINT_MAX).keep_checkpoints == BIGINT_MAX
    assert main(["serve", "--database", "memory://", "--keep-checkpoints", str(2**63)]) == 2
    assert "--keep-checkpoints / REDUCING_SAVER_KEEP_CHECKPOINTS" in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_a_threads_count_beyond_64_bits_is_a_422_naming_the_field(
    kind: str, request: pytest.FixtureRequest, tmp_path
) -> None:
    """The documented 422 naming ``config.configurable.keep_checkpoints``, on every backend (PostgreSQL
    used to answer "bigint out of range"); the largest count that fits keeps everything, as it says."""
    from fastapi.testclient import TestClient

    from reducing_saver.client import BadRequestError, RemoteReducingSaver
    from reducing_saver.service.configuration.settings import Settings
    from reducing_saver.service.http.app import create_app

    database = {
        "postgres": request.getfixturevalue("fresh_pg") if kind == "postgres" else None,
        "sqlite": f"sqlite:///{tmp_path}/big.sqlite",
        "memory": "memory://",
    }[kind]
    app = create_app(Settings(database=database, extract=False, sweep=False, keep_checkpoints=2))
    with (
        TestClient(app) as client,
        RemoteReducingSaver("http://testserver", transport=client._transport) as saver,
    ):
        checkpoint = {
            "v": 4,
            "id": _new_id(),
            "ts": "2026-01-01T00:00:00+00:00",
            "channel_values": {},
            "channel_versions": {},
            "versions_seen": {},
            "updated_channels": [],
        }
        for count in (2**63, 2**64, 10**30):
            config = {"configurable": {"thread_id": "big", "checkpoint_ns": "", "keep_checkpoints": count}}
            with pytest.raises(BadRequestError) as refused:
                saver.put(config, {**checkpoint, "id": _new_id()}, {}, {})
            assert refused.value.status_code == 422
            assert "config.configurable.keep_checkpoints must be a whole number >= 0" in refused.value.message
            assert str(BIGINT_MAX) in refused.value.message
        assert list(saver.list({"configurable": {"thread_id": "big"}})) == []
        fits = {"configurable": {"thread_id": "big", "checkpoint_ns": "", "keep_checkpoints": BIGINT_MAX}}
        for _ in range(4):
            fits = saver.put(fits, {**checkpoint, "id": _new_id()}, {}, {})
            fits["configurable"]["keep_checkpoints"] = BIGINT_MAX
        assert len(list(saver.list({"configurable": {"thread_id": "big"}}))) == 4
