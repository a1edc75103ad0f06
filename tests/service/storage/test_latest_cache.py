"""The latest-checkpoint cache of the PostgreSQL savers (``storage/latest.py``, ``postgres/latest.py``).

Every read of a thread's latest checkpoint through a caching saver is compared with a full read by a
saver without a cache, after every write: by the same process, by another process's savers (a second
backend: another replica), and by deletes, prunes, copies and keep-checkpoints puts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from langgraph.checkpoint.base.id import uuid6
from prometheus_client.parser import text_string_to_metric_families

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.service.state import Service
from reducing_saver.service.storage import open_backend
from reducing_saver.service.storage.latest import MAX_ENTRY_BYTES, MAX_NAMESPACES, LatestCache
from reducing_saver.service.storage.postgres.latest import json_image
from reducing_saver.wire import Blob
from tests.support.chat import build_chat_graph, human
from tests.support.encryption import new_key, ring_json

_counter = itertools.count(1)


class Replica:
    """A backend's savers sharing one cache, as one service process holds them."""

    def __init__(self, database: str, threads: int) -> None:
        self.backend = open_backend(database, pool_size=2, timeout=5.0)
        self.backend.setup()
        self.cache = LatestCache(threads)
        self.savers = self.backend.savers(2, latest_cache=self.cache)
        self.saver = self.savers[0]

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def replicas(fresh_pg: str) -> Iterator[tuple[Replica, Replica, Any]]:
    """Two caching replicas and a saver that always reads in full (the truth)."""
    one, two, plain = Replica(fresh_pg, 100), Replica(fresh_pg, 100), Replica(fresh_pg, 0)
    try:
        yield one, two, plain.saver
    finally:
        for replica in (one, two, plain):
            replica.close()


def _config(thread: str, checkpoint_id: str | None = None, ns: str = "") -> dict[str, Any]:
    configurable = {"thread_id": thread, "checkpoint_ns": ns}
    if checkpoint_id is not None:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def _version() -> str:
    return f"{next(_counter):032}.{0:016}"


def put(
    saver: Any, thread: str, parent: dict | None, changed: dict[str, Any], *, ns: str = "", **extra: Any
) -> dict:
    """Put a checkpoint that changes the channels of ``changed`` (values) on top of ``parent`` (the
    previous checkpoint dict), like LangGraph's sparse puts: unchanged channels keep their versions."""
    versions = dict(parent["channel_versions"]) if parent else {}
    new_versions = {channel: _version() for channel in changed}
    versions.update(new_versions)
    checkpoint = {
        "v": 4,
        "id": str(uuid6()),
        "ts": "2026-01-01T00:00:00+00:00",
        "channel_values": dict(changed),
        "channel_versions": versions,
        "versions_seen": {"node": dict(versions)},
        "updated_channels": sorted(changed),
    }
    config = _config(thread, parent["id"] if parent else None, ns)
    config["configurable"].update(extra)
    metadata = {"source": "loop", "step": next(_counter), "run_id": extra.get("run", "r")}
    saver.put(config, checkpoint, metadata, new_versions)
    return checkpoint


def _blob(text: str, size: int = 0) -> Blob:
    return Blob("msgpack", text.encode() + b"x" * size)


def _same(saver: Any, truth: Any, thread: str, ns: str = "") -> None:
    """The caching saver's latest checkpoint is the full read's, value for value."""
    got, want = saver.get_tuple(_config(thread, ns=ns)), truth.get_tuple(_config(thread, ns=ns))
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got.config == want.config
    assert got.checkpoint == want.checkpoint
    assert got.metadata == want.metadata
    assert got.parent_config == want.parent_config
    assert got.pending_writes == want.pending_writes


def test_a_read_after_own_puts_is_a_hit_and_writes_are_read_in_full_once(replicas) -> None:
    one, _, truth = replicas
    first = put(one.saver, "t", None, {"messages": _blob("m1"), "count": 1, "topic": "weather"})
    second = put(one.saver, "t", first, {"messages": _blob("m2"), "count": 2})  # "topic" carried over
    _same(one.saver, truth, "t")
    assert one.cache.counts == {"hit": 1, "miss": 0, "stale": 0}
    config = _config("t", second["id"])
    one.savers[1].put_writes(config, [("messages", _blob("w1")), ("count", 3)], "task-a", "~a")
    one.saver.put_writes(config, [("__error__", _blob("boom"))], "task-b")
    one.saver.put_writes(config, [("__error__", _blob("boom again"))], "task-b")  # special: overwrites
    _same(one.saver, truth, "t")  # the writes are not in the entry: read in full, and kept
    assert one.cache.counts == {"hit": 1, "miss": 0, "stale": 1}
    _same(one.saver, truth, "t")
    assert one.cache.counts == {"hit": 2, "miss": 0, "stale": 1}
    assert [w[0] for w in truth.get_tuple(_config("t")).pending_writes] == ["task-b", "task-a", "task-a"]


def test_another_replicas_puts_and_writes_are_never_missed(replicas) -> None:
    """Puts and writes alternate between two replicas on one thread; after every write both read
    exactly the newest committed checkpoint and its writes."""
    one, two, truth = replicas
    parent = None
    for step in range(6):
        writer, reader = (one, two) if step % 2 == 0 else (two, one)
        parent = put(writer.saver, "race", parent, {"messages": _blob(f"m{step}"), "count": step})
        for replica in (one, two):
            _same(replica.saver, truth, "race")
        config = _config("race", parent["id"])
        writer.saver.put_writes(config, [("messages", _blob(f"w{step}"))], f"task-{step}")
        for replica in (one, two):
            _same(replica.saver, truth, "race")
        reader.saver.put_writes(config, [("count", step)], f"other-{step}")
        for replica in (one, two):
            _same(replica.saver, truth, "race")
    for replica in (one, two):
        counts = replica.cache.counts
        assert counts["hit"] >= 3 and counts["stale"] >= 6, counts


def test_deletes_prunes_copies_and_runs_show_at_once(replicas) -> None:
    one, two, truth = replicas
    for thread in ("a", "b"):
        first = put(one.saver, thread, None, {"messages": _blob("m1")}, run="run-1")
        put(one.saver, thread, first, {"messages": _blob("m2")}, run="run-2")
        _same(one.saver, truth, thread)
    two.saver.delete_for_runs(["run-2"])  # another replica: the head of both threads goes
    _same(one.saver, truth, "a")
    two.saver.prune(["a"], strategy="delete")
    _same(one.saver, truth, "a")
    assert one.saver.get_tuple(_config("a")) is None
    two.saver.copy_thread("b", "a")
    _same(one.saver, truth, "a")
    two.saver.delete_thread("b")
    _same(one.saver, truth, "b")
    assert one.saver.get_tuple(_config("b")) is None
    third = put(one.saver, "c", None, {"messages": _blob("m1")})
    put(one.saver, "c", third, {"messages": _blob("m2")})
    one.saver.prune(["c"], strategy="keep_latest")
    _same(one.saver, truth, "c")


def test_a_keep_checkpoints_put_detaches_its_parent_as_the_database_does(replicas) -> None:
    one, _, truth = replicas
    parent = None
    for step in range(3):
        parent = put(one.saver, "k", parent, {"messages": _blob(f"m{step}")}, keep_checkpoints=1)
        _same(one.saver, truth, "k")
    assert truth.get_tuple(_config("k")).parent_config is None  # the parent was deleted by the put
    assert one.cache.counts["hit"] == 3


def test_a_row_rewritten_by_hand_is_seen(replicas, fresh_pg: str) -> None:
    """Whatever changes a row (here an UPDATE no saver makes) changes its xmin: the entry is stale."""
    one, _, truth = replicas
    head = put(one.saver, "h", None, {"messages": _blob("m1"), "count": 1})
    with psycopg.connect(fresh_pg, autocommit=True) as conn:
        conn.execute("UPDATE checkpoint_blobs SET blob = 'changed' WHERE thread_id = 'h'")
    _same(one.saver, truth, "h")
    assert one.cache.counts["stale"] == 1
    with psycopg.connect(fresh_pg, autocommit=True) as conn:
        conn.execute(
            "UPDATE checkpoints SET metadata = metadata || '{\"x\": 1}' "
            "WHERE thread_id = 'h' AND checkpoint_id = %s",
            (head["id"],),
        )
    _same(one.saver, truth, "h")
    assert one.cache.counts["stale"] == 2


def test_namespaces_floats_and_unknown_values_are_read_right(replicas) -> None:
    one, _, truth = replicas
    put(one.saver, "n", None, {"messages": _blob("root")})
    put(one.saver, "n", None, {"messages": _blob("sub"), "ratio": 0.25, "big": 1e20}, ns="call:1")
    _same(one.saver, truth, "n")
    _same(one.saver, truth, "n", ns="call:1")  # 1e20 reads back from JSONB as an int: not kept at put
    assert truth.get_tuple(_config("n", ns="call:1")).checkpoint["channel_values"]["big"] == 10**20


def test_the_cache_is_bounded_by_threads_and_entry_size(fresh_pg: str) -> None:
    replica = Replica(fresh_pg, 2)
    try:
        for thread in ("x", "y", "z"):
            put(replica.saver, thread, None, {"messages": _blob(thread)})
        assert len(replica.cache) == 2 and replica.cache.get("x", "") is None
        put(replica.saver, "big", None, {"messages": _blob("big", MAX_ENTRY_BYTES)})
        assert replica.cache.get("big", "") is None
        values = replica.saver.get_tuple(_config("big")).checkpoint["channel_values"]
        assert values["messages"].data.startswith(b"big")
    finally:
        replica.close()


def test_a_thread_keeps_its_root_and_newest_namespaces() -> None:
    class Entry:
        size = 10

    cache = LatestCache(1)
    cache.put("t", "", Entry())
    for call in range(MAX_NAMESPACES + 3):
        cache.put("t", f"node:{call}", Entry())
    kept = [ns for ns in ["", *(f"node:{call}" for call in range(MAX_NAMESPACES + 3))] if cache.get("t", ns)]
    assert kept == ["", *(f"node:{call}" for call in range(4, MAX_NAMESPACES + 3))]


def test_zero_threads_reads_everything_in_full(fresh_pg: str) -> None:
    replica = Replica(fresh_pg, 0)
    try:
        put(replica.saver, "t", None, {"messages": _blob("m")})
        assert replica.saver.get_tuple(_config("t")) is not None
        assert len(replica.cache) == 0 and replica.cache.counts == {"hit": 0, "miss": 0, "stale": 0}
    finally:
        replica.close()


# -- through the service: a real agent run ---------------------------------------------------------


@contextmanager
def _service(database: str, **settings: Any) -> Iterator[tuple[Service, TestClient]]:
    settings = {"sweep": False, "extract": False, "storage_refresh_seconds": 0, **settings}
    app = create_app(Settings(database=database, **settings))
    with TestClient(app) as http:
        yield app.state.service, http


def _remote(http: TestClient, api_key: str | None) -> RemoteReducingSaver:
    return RemoteReducingSaver("http://testserver", transport=http._transport, max_retries=0, api_key=api_key)


@pytest.mark.parametrize("mode", ["plain", "tenants-encrypted"])
def test_an_agent_run_starts_from_memory_and_sees_what_a_full_read_sees(fresh_pg: str, mode: str) -> None:
    """Every turn's first read (LangGraph's get_tuple of the latest checkpoint) is a hit after the first
    turn, under tenancy and encryption too; the state equals what a service without the cache reads."""
    key = "rs-test-key-0123456789abcdef"
    settings: dict[str, Any] = {"max_messages": 6, "min_messages": 4}
    if mode != "plain":
        ring = ring_json("k1", k1=new_key())
        settings.update(api_keys=f"acme={key}", encryption="required", encryption_keys=ring)
    api_key = key if mode != "plain" else None
    with (
        _service(fresh_pg, **settings) as (service, http),
        _service(fresh_pg, latest_cache_threads=0, **settings) as (_, plain_http),
    ):
        graph = build_chat_graph(_remote(http, api_key), prefix="lc", with_tools=True)
        plain = build_chat_graph(_remote(plain_http, api_key), prefix="lc", with_tools=True)
        config = {"configurable": {"thread_id": "agent"}}
        turns = 5
        for turn in range(turns):
            graph.invoke({"messages": [human(turn, "lc")]}, config)
            assert graph.get_state(config).values == plain.get_state(config).values
        counts = service.latest_cache.counts
        assert counts["hit"] >= 2 * turns - 1 and counts["stale"] == 0, counts
        if mode == "plain":
            samples = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(http.get("/metrics").text)
                for sample in family.samples
            }
            assert samples[("reducing_saver_latest_cache_total", (("result", "hit"),))] == counts["hit"]
            assert samples[("reducing_saver_latest_cache_total", (("result", "miss"),))] == counts["miss"]


_PLAIN = {"v": 4, "versions": {"a": "0001.0.5", "b": 2}, "ratio": 0.25, "seen": [[1, "x"], {"c": None}]}


@pytest.mark.parametrize(
    ("value", "image"),
    [
        (_PLAIN, _PLAIN),
        ({"tuple": (1, "a"), "float": 1.0}, {"tuple": [1, "a"], "float": 1.0}),  # a tuple reads as a list
        ({"deep": [{"a": [1, 2, {"b": 1e20}]}]}, None),  # an exponent: JSONB reads an int back
        ({"deep": {"a": [0.5, -0.0]}}, None),  # -0.0 reads back as 0
        ([1.5, [2.5, [3.5e-7]]], None),
    ],
)
def test_a_put_image_reads_as_jsonb_would_or_not_at_all(value: Any, image: Any) -> None:
    """An image built by a put turns into what a JSONB column gives back, or into nothing (a read from the
    database) when a float anywhere in it would not read back as it is."""
    assert json_image(value) == image
