"""TTL sweeps in-process, on every backend: the service app (FastAPI TestClient), the real client, a real
chat agent, and ``Sweeper.sweep()`` called directly (the background thread is off: ``sweep=False``).

TTLs are 0.3 seconds; a thread that must not expire gets an hour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from langgraph.checkpoint.postgres import PostgresSaver

from reducing_saver.client import BadRequestError, RemoteReducingSaver
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import Service, create_app
from reducing_saver.service.storage.ledger import uuid6_time
from reducing_saver.service.ttl.durations import format_duration, parse_duration
from reducing_saver.service.ttl.sweeper import Sweeper
from tests.support.agents import build_agent, user_line

TTL = 0.3
EXPIRE = TTL + 0.1  # how long to wait for a TTL thread to expire


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/rs.sqlite"
    return request.getfixturevalue("fresh_pg")


@dataclass
class Running:
    service: Service
    saver: RemoteReducingSaver
    http: TestClient

    @property
    def sweeper(self) -> Sweeper:
        assert self.service.sweeper is not None
        return self.service.sweeper


@contextmanager
def running(database: str, *, api_key: str | None = None, **settings: Any) -> Iterator[Running]:
    settings = {"max_messages": 6, "min_messages": 4, "sweep": False, "extract": False, **settings}
    app = create_app(Settings(database=database, **settings))
    with TestClient(app) as http:
        saver = RemoteReducingSaver(
            "http://testserver", transport=http._transport, max_retries=0, api_key=api_key
        )
        try:
            yield Running(app.state.service, saver, http)
        finally:
            saver.close()


def chat(saver: Any, thread_id: str, turns: int, *, start: int = 0, **configurable: Any) -> None:
    graph = build_agent(saver)
    config = {"configurable": {"thread_id": thread_id, **configurable}}
    for turn in range(start, start + turns):
        graph.invoke({"messages": [("user", user_line(turn))]}, config)


def cfg(thread_id: str) -> dict:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def history(saver: Any, thread_id: str) -> list:
    return list(saver.list(cfg(thread_id)))


def message_ids(saver: Any, thread_id: str) -> set[str]:
    """Every message id in any stored checkpoint of the thread: all it ever had (each message is in the
    window of the put that added it)."""
    return {
        m.id
        for item in history(saver, thread_id)
        for m in item.checkpoint["channel_values"].get("messages", [])
    }


def stored(service: Service, thread_id: str) -> dict[str, Any]:
    """The thread's raw rows: checkpoint ids, the checkpoint ids its writes belong to, and its blob count."""
    with service.savers.borrow() as saver:
        inner = saver.inner
    kind = service.backend.kind
    if kind == "memory":
        with inner.lock:
            checkpoints = {(ns, cid) for ns, cps in inner.storage.get(thread_id, {}).items() for cid in cps}
            writes = {(k[1], k[2]) for k, v in inner.writes.items() if k[0] == thread_id and v}
            blobs = sum(1 for k in inner.blobs if k[0] == thread_id)
    elif kind == "sqlite":
        with inner.lock:
            conn = inner.conn
            checkpoints = set(
                conn.execute(
                    "SELECT checkpoint_ns, checkpoint_id FROM checkpoints WHERE thread_id = ?", (thread_id,)
                )
            )
            writes = set(
                conn.execute(
                    "SELECT checkpoint_ns, checkpoint_id FROM writes WHERE thread_id = ?", (thread_id,)
                )
            )
            blobs = 0
    else:
        with psycopg.connect(service.settings.database) as conn:
            checkpoints = set(
                conn.execute(
                    "SELECT checkpoint_ns, checkpoint_id FROM checkpoints WHERE thread_id = %s", (thread_id,)
                )
            )
            writes = set(
                conn.execute(
                    "SELECT checkpoint_ns, checkpoint_id FROM checkpoint_writes WHERE thread_id = %s",
                    (thread_id,),
                )
            )
            blobs = conn.execute(
                "SELECT count(*) FROM checkpoint_blobs WHERE thread_id = %s", (thread_id,)
            ).fetchone()[0]
    return {"checkpoints": checkpoints, "writes": writes, "blobs": blobs}


def outbox_keys(service: Service) -> dict[tuple[str, ...], set[str]]:
    """Everything recorded for extraction, by namespace (claims every row: call once, at the end)."""
    keys: dict[tuple[str, ...], set[str]] = {}
    for entry in service.memory.outbox.claim("test", 100_000, 60):
        keys.setdefault(entry.namespace, set()).add(entry.key)
    return keys


def same_state(before: Any, after: Any) -> None:
    assert after.config == before.config
    assert after.checkpoint == before.checkpoint
    assert after.metadata == before.metadata
    assert after.pending_writes == before.pending_writes


# -- keep_latest -----------------------------------------------------------------------------------


def test_keep_latest_leaves_each_expired_thread_its_head_and_its_writes(database):
    with running(database, default_ttl=TTL) as run:
        for thread_id in ("old-1", "old-2"):
            chat(run.saver, thread_id, 4)
            head = run.saver.get_tuple(cfg(thread_id))
            # A run interrupted after its tasks wrote: the head carries pending writes of its own.
            run.saver.put_writes(head.config, [("note", f"pending on {thread_id}")], task_id="interrupted")
        chat(run.saver, "young", 3, checkpoint_ttl="1h")
        before = {t: run.saver.get_tuple(cfg(t)) for t in ("old-1", "old-2", "young")}
        rows_before = {t: stored(run.service, t) for t in ("old-1", "old-2", "young")}
        assert all(len(rows_before[t]["checkpoints"]) > 10 for t in rows_before)
        time.sleep(EXPIRE)

        report = run.sweeper.sweep()

        assert (report.threads_pruned, report.threads_deleted, report.errors) == (2, 0, 0)
        assert report.bytes_reclaimed > 0
        for thread_id in ("old-1", "old-2"):
            head = before[thread_id]
            rows = stored(run.service, thread_id)
            assert rows["checkpoints"] == {("", head.checkpoint["id"])}
            assert rows["writes"] == {("", head.checkpoint["id"])}  # only the head's writes are left
            assert [item.checkpoint["id"] for item in history(run.saver, thread_id)] == [
                head.checkpoint["id"]
            ]
            same_state(head, run.saver.get_tuple(cfg(thread_id)))
            assert ("interrupted", "note", f"pending on {thread_id}") in head.pending_writes
        if run.service.backend.kind != "sqlite":  # SqliteSaver keeps values inside the checkpoint row
            assert 0 < stored(run.service, "old-1")["blobs"] < rows_before["old-1"]["blobs"]
        assert stored(run.service, "young") == rows_before["young"]
        same_state(before["young"], run.saver.get_tuple(cfg("young")))

        # A second sweep finds nothing new; the pruned thread carries on from its head.
        assert run.sweeper.sweep().threads_pruned == 0
        chat(run.saver, "old-1", 1, start=6)  # a plain turn: two messages, the old window stays
        assert len(history(run.saver, "old-1")) > 1
        messages = run.saver.get_tuple(cfg("old-1")).checkpoint["channel_values"]["messages"]
        assert {m.id for m in before["old-1"].checkpoint["channel_values"]["messages"]} & {
            m.id for m in messages
        }


# -- delete ----------------------------------------------------------------------------------------


def test_delete_sends_the_last_window_to_memory_then_removes_the_thread(database):
    namespace = ("memories", "user-7")
    with running(database, default_ttl=TTL, ttl_strategy="delete") as run:
        chat(run.saver, "gone", 7, memory_namespace=list(namespace))
        chat(run.saver, "kept", 3, checkpoint_ttl="1h")
        everything = message_ids(run.saver, "gone")
        window = {m.id for m in run.saver.get_tuple(cfg("gone")).checkpoint["channel_values"]["messages"]}
        assert window < everything
        kept_before = stored(run.service, "kept")
        time.sleep(EXPIRE)

        report = run.sweeper.sweep()

        assert (report.threads_deleted, report.threads_pruned, report.errors) == (1, 0, 0)
        assert run.saver.get_tuple(cfg("gone")) is None
        assert history(run.saver, "gone") == []
        assert stored(run.service, "gone") == {"checkpoints": set(), "writes": set(), "blobs": 0}
        assert stored(run.service, "kept") == kept_before
        # Nothing lost: what the reducer pruned earlier plus the last window, under the thread's namespace.
        recorded = outbox_keys(run.service)
        assert recorded[namespace] == everything


def test_a_thread_written_while_a_sweep_runs_is_not_touched_by_it(database, monkeypatch):
    with running(database, default_ttl=TTL, ttl_strategy="delete") as run:
        chat(run.saver, "idle", 2)
        chat(run.saver, "busy", 2)
        time.sleep(EXPIRE)
        ledger = run.sweeper.ledger
        listed = ledger.candidates

        def list_then_write(policy, limit, skip, **options):
            # Both threads are expired when the sweep lists them; "busy" is written before it is handled.
            ids = listed(policy, limit, skip, **options)
            if "busy" in ids and not written:
                chat(run.saver, "busy", 1, start=2)
                written.append(True)
            return ids

        written: list[bool] = []
        monkeypatch.setattr(ledger, "candidates", list_then_write)
        count = len(history(run.saver, "busy"))

        report = run.sweeper.sweep()

        assert written and report.threads_deleted == 1
        assert run.saver.get_tuple(cfg("idle")) is None
        assert len(history(run.saver, "busy")) > count  # its whole history, and the new turn
        assert len(run.saver.get_tuple(cfg("busy")).checkpoint["channel_values"]["messages"]) >= 4


# -- per-thread TTL, dry run -------------------------------------------------------------------------


def test_a_threads_own_ttl_wins_over_the_default(database):
    with running(database, default_ttl=TTL) as run:
        chat(run.saver, "plain", 2)
        chat(run.saver, "own-long", 2, checkpoint_ttl=3600)  # seconds, as a number
        time.sleep(EXPIRE)
        assert run.sweeper.sweep().threads_pruned == 1
        assert len(history(run.saver, "plain")) == 1
        assert len(history(run.saver, "own-long")) > 1
    with running(database, default_ttl="1h") as run:
        chat(run.saver, "own-short", 2, checkpoint_ttl=f"{TTL}s")
        chat(run.saver, "default-long", 2)
        # A later put without checkpoint_ttl keeps the thread's own.
        chat(run.saver, "own-short", 1, start=2)
        time.sleep(EXPIRE)
        assert run.sweeper.sweep().threads_pruned == 1
        assert len(history(run.saver, "own-short")) == 1
        assert len(history(run.saver, "default-long")) > 1


@pytest.mark.parametrize("strategy", ["keep_latest", "delete"])
def test_dry_run_changes_nothing_and_reports_the_bytes(database, strategy):
    with running(database, default_ttl=TTL, ttl_strategy=strategy) as run:
        for thread_id in ("a", "b"):
            chat(run.saver, thread_id, 3)
        chat(run.saver, "young", 2, checkpoint_ttl="1h")
        time.sleep(EXPIRE)
        rows = {t: stored(run.service, t) for t in ("a", "b", "young")}
        heads = {t: run.saver.get_tuple(cfg(t)) for t in ("a", "b")}

        dry = run.sweeper.sweep(dry_run=True)

        assert sorted(t["thread_id"] for t in dry.threads) == ["a", "b"]
        assert all(t["bytes"] > 1000 for t in dry.threads)
        assert {t: stored(run.service, t) for t in rows} == rows
        for thread_id, head in heads.items():
            same_state(head, run.saver.get_tuple(cfg(thread_id)))
        assert run.service.sweeper.status()["process"]["sweeps"] == 0

        real = run.sweeper.sweep()
        estimate = sum(t["bytes"] for t in dry.threads)
        # keep_latest detaches the head from its parent, which frees a few bytes more.
        assert estimate <= real.bytes_reclaimed <= estimate * 1.01 + 100
        print(
            f"\n{run.service.backend.kind} {strategy}: dry run {estimate} bytes, sweep {real.bytes_reclaimed} bytes"
        )


def test_a_checkpoint_ttl_that_is_not_a_duration_is_refused():
    with running("memory://") as run:
        with pytest.raises(BadRequestError, match="checkpoint_ttl must be a duration"):
            chat(run.saver, "t", 1, checkpoint_ttl="soon")
        with pytest.raises(BadRequestError, match="positive"):
            chat(run.saver, "t", 1, checkpoint_ttl=-5)
        with pytest.raises(BadRequestError, match="at most 36500d"):
            chat(run.saver, "t", 1, checkpoint_ttl=1e308)
        assert run.saver.get_tuple(cfg("t")) is None


# -- explicit deletes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("extract_on_delete", [False, True])
def test_a_clients_delete_extracts_only_with_extract_on_delete(database, extract_on_delete):
    with running(database, extract_on_delete=extract_on_delete) as run:
        chat(run.saver, "t", 6)
        window = {m.id for m in run.saver.get_tuple(cfg("t")).checkpoint["channel_values"]["messages"]}
        everything = message_ids(run.saver, "t")
        run.saver.delete_thread("t")
        assert run.saver.get_tuple(cfg("t")) is None
        recorded = outbox_keys(run.service).get(("memories", "t"), set())
        assert recorded == (everything if extract_on_delete else everything - window)


def test_tenant_mode_sends_a_deleted_threads_window_to_its_tenants_memory():
    key = "acme-key-0123456789abcdef"
    with running(
        "memory://", api_key=key, api_keys=f"acme={key}", default_ttl=TTL, ttl_strategy="delete"
    ) as run:
        chat(run.saver, "t", 6)
        everything = message_ids(run.saver, "t")
        time.sleep(EXPIRE)
        assert run.sweeper.sweep().threads_deleted == 1
        entries = run.service.memory.outbox.claim("test", 1000, 60)
    assert {e.namespace for e in entries} == {("tenants", "acme", "memories", "t")}
    assert {e.key for e in entries} == everything
    assert {e.thread_id for e in entries} == {"t"}  # the agent's own thread id, as the put path records it


# -- figures, discovery, several sweepers --------------------------------------------------------------


def test_status_route_and_metrics_show_the_figures():
    with running("memory://", default_ttl=TTL) as run:
        chat(run.saver, "t", 3)
        time.sleep(EXPIRE)
        assert run.http.get("/v1/sweeps/status").json()["database"]["threads_expired"] == 1
        report = run.sweeper.sweep()
        status = run.http.get("/v1/sweeps/status").json()
        metrics = run.http.get("/metrics").text
    assert status["strategy"] == "keep_latest" and status["default_ttl_seconds"] == TTL
    assert status["process"]["threads_pruned"] == 1 and status["process"]["sweeps"] == 1
    assert status["process"]["bytes_reclaimed"] == report.bytes_reclaimed > 0
    assert status["process"]["last_sweep_at"] is not None
    assert status["database"]["threads_pruned"] == 1 and status["database"]["threads_expired"] == 0
    assert status["database"]["bytes_reclaimed"] == report.bytes_reclaimed
    assert "reducing_saver_sweep_threads_pruned_total 1.0" in metrics
    assert f"reducing_saver_sweep_bytes_reclaimed_total {float(report.bytes_reclaimed)}" in metrics
    assert "reducing_saver_sweep_last_timestamp_seconds" in metrics


def test_each_tenant_sees_only_its_own_sweep_figures(database):
    # "a_" and "ab": a LIKE 'a_:%' filter would count ab's threads as a_'s.
    keys = {"a_": "key-of-tenant-a-0123456789", "ab": "key-of-tenant-b-0123456789"}
    api_keys = ",".join(f"{tenant}={key}" for tenant, key in keys.items())
    with running(database, api_key=keys["a_"], api_keys=api_keys, default_ttl=TTL) as run:
        other = RemoteReducingSaver(
            "http://testserver", transport=run.http._transport, max_retries=0, api_key=keys["ab"]
        )
        chat(run.saver, "t1", 3)
        chat(run.saver, "t2", 3)
        chat(other, "t1", 3)
        other.close()
        time.sleep(EXPIRE)

        def status(tenant: str) -> dict[str, Any]:
            answer = run.http.get("/v1/sweeps/status", headers={"Authorization": f"Bearer {keys[tenant]}"})
            assert answer.status_code == 200, answer.text
            return answer.json()

        def figures(tenant: str) -> dict[str, Any]:
            return status(tenant)["database"]

        assert (figures("a_")["threads_tracked"], figures("a_")["threads_expired"]) == (2, 2)
        assert (figures("ab")["threads_tracked"], figures("ab")["threads_expired"]) == (1, 1)
        report = run.sweeper.sweep()
        assert report.threads_pruned == 3
        mine, theirs = status("a_"), status("ab")
    for section in ("database", "process"):  # the sweep log's figures, and this process's
        assert (mine[section]["threads_pruned"], theirs[section]["threads_pruned"]) == (2, 1), section
        assert (
            0 < theirs[section]["bytes_reclaimed"] < mine[section]["bytes_reclaimed"] < report.bytes_reclaimed
        )
        assert mine[section]["bytes_reclaimed"] + theirs[section]["bytes_reclaimed"] == report.bytes_reclaimed
    assert (mine["database"]["threads_expired"], theirs["database"]["threads_expired"]) == (0, 0)
    assert mine["process"]["sweeps"] == theirs["process"]["sweeps"] == 1


def test_threads_written_before_the_ledger_are_found_and_aged_by_their_checkpoint_ids(fresh_pg):
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        stock.setup()
        chat(stock, "legacy", 3)
        head = stock.get_tuple(cfg("legacy")).checkpoint["id"]
    assert abs(uuid6_time(head) - time.time()) < 30
    time.sleep(EXPIRE)
    with running(fresh_pg, default_ttl=TTL) as run:
        report = run.sweeper.sweep()
        assert report.threads_pruned == 1
        assert [item.checkpoint["id"] for item in history(run.saver, "legacy")] == [head]


def test_two_sweepers_at_once_handle_each_expired_thread_once(fresh_pg):
    threads = [f"t{index:02d}" for index in range(20)]
    with running(fresh_pg, default_ttl=TTL) as one, running(fresh_pg, default_ttl=TTL) as two:
        for index, thread_id in enumerate(threads):
            chat((one if index % 2 else two).saver, thread_id, 1)
        time.sleep(EXPIRE)
        start = threading.Barrier(2)
        reports = []

        def sweep(run: Running) -> None:
            start.wait()
            reports.append(run.sweeper.sweep())

        workers = [threading.Thread(target=sweep, args=(run,)) for run in (one, two)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        with psycopg.connect(fresh_pg) as conn:
            log = conn.execute("SELECT thread_id, swept_by FROM reducing_saver_sweep_log").fetchall()
        assert all(len(history(one.saver, t)) == 1 for t in threads)
    assert sorted(t for t, _ in log) == threads  # one row per thread: each handled once
    assert sum(r.threads_pruned for r in reports) == len(threads)
    assert sum(r.errors for r in reports) == 0
    print(f"\nsweeper split: {[r.threads_pruned for r in reports]}")


def test_durations():
    assert [parse_duration(v) for v in (90, "90", "90s", "15m", "2h", "7d", "1h30m", " 1.5 h ")] == [
        90,
        90,
        90,
        900,
        7200,
        604800,
        5400,
        5400,
    ]
    for bad in ("", "soon", "5x", "1h 3", 0, -1, "nan", True, None, [1]):
        with pytest.raises(ValueError, match="default_ttl"):
            parse_duration(bad, name="default_ttl")
    assert [format_duration(s) for s in (604800, 7200, 90, 1.5)] == ["7d", "2h", "90s", "1.5s"]
    assert Settings(database="memory://", default_ttl="off").default_ttl is None
    assert Settings(database="memory://", sweep_interval="2m").sweep_interval == 120
