"""TTL sweeps end to end: real ``reducing-saver serve`` processes on one PostgreSQL database, the real
client, a real chat agent; the cron command; and the closing figure (bytes per thread after 100 turns).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from contextlib import ExitStack

import httpx
import psycopg

from reducing_saver.client import RemoteReducingSaver
from tests.support.agents import build_agent, user_line
from tests.support.server import CLI, ROOT, run_service

THREAD_BYTES = """
SELECT (SELECT COALESCE(sum(pg_column_size(c.*)), 0) FROM checkpoints c WHERE c.thread_id = %(t)s)
     + (SELECT COALESCE(sum(pg_column_size(b.*)), 0) FROM checkpoint_blobs b WHERE b.thread_id = %(t)s)
     + (SELECT COALESCE(sum(pg_column_size(w.*)), 0) FROM checkpoint_writes w WHERE w.thread_id = %(t)s),
       (SELECT count(*) FROM checkpoints WHERE thread_id = %(t)s)
"""


def cfg(thread_id: str) -> dict:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}


def turn(saver, thread_id: str, index: int, **configurable) -> None:
    build_agent(saver).invoke(
        {"messages": [("user", user_line(index))]}, {"configurable": {"thread_id": thread_id, **configurable}}
    )


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def thread_bytes(database: str, thread_id: str) -> tuple[int, int]:
    with psycopg.connect(database) as conn:
        size, count = conn.execute(THREAD_BYTES, {"t": thread_id}).fetchone()
    return int(size), int(count)


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_replicas_sweeping_one_database_handle_each_expired_thread_once(tmp_path, fresh_pg):
    threads = [f"user-{index:02d}" for index in range(10)]
    args = [
        "--database",
        fresh_pg,
        "--max-messages",
        "6",
        "--min-messages",
        "4",
        "--ttl-strategy",
        "delete",
        "--default-ttl",
        "3s",
        "--sweep-interval",
        "0.1s",
        "--extractor",
        "tests.support.extractors:counting",
    ]
    with ExitStack() as stack:
        replicas = [
            stack.enter_context(run_service(tmp_path, *args, env={"RS_TEST_CALLS_DB": fresh_pg}))
            for _ in range(2)
        ]
        savers = [stack.enter_context(RemoteReducingSaver(r.url)) for r in replicas]
        # Round robin, each turn on the other replica: every thread's last write lands within one round,
        # so they all expire together and both sweepers meet them at once.
        last_write: dict[str, float] = {}
        for index in range(3):
            for number, thread_id in enumerate(threads):
                if thread_id in last_write:
                    assert time.monotonic() - last_write[thread_id] < 2.5, "a round took longer than the TTL"
                turn(savers[(index + number) % 2], thread_id, index)
                last_write[thread_id] = time.monotonic()
        ever = {
            t: {
                m.id
                for item in savers[0].list(cfg(t))
                for m in item.checkpoint["channel_values"].get("messages", [])
            }
            for t in threads
        }

        def all_swept() -> bool:
            return httpx.get(f"{replicas[0].url}/v1/sweeps/status").json()["database"][
                "threads_deleted"
            ] >= len(threads)

        wait_for(all_swept, 30, "both replicas to sweep every thread")
        wait_for(
            lambda: (
                (s := httpx.get(f"{replicas[0].url}/v1/extraction/status").json())["pending"] == 0
                and s["in_flight"] == 0
            ),
            30,
            "the outbox to drain",
        )
        deleted = [metric(r.url, "reducing_saver_sweep_threads_deleted_total") for r in replicas]
        assert all(savers[0].get_tuple(cfg(t)) is None for t in threads)

    with psycopg.connect(fresh_pg) as conn:
        log = conn.execute("SELECT thread_id, action FROM reducing_saver_sweep_log").fetchall()
        calls = Counter(
            (tuple(ns), key) for ns, key in conn.execute("SELECT namespace, key FROM extractor_calls")
        )
    assert Counter(t for t, _ in log) == Counter(threads)  # each thread handled exactly once...
    assert {a for _, a in log} == {"deleted"}
    assert sum(deleted) == len(threads)  # ...and counted once across both processes
    # Every message a thread ever had reached memory once: pruned along the way, or its last window.
    assert max(calls.values()) == 1
    assert set(calls) == {(("memories", t), key) for t, ids in ever.items() for key in ids}
    print(f"\nthreads deleted per replica: {deleted}; {len(calls)} messages extracted once each")


def test_cron_sweep_dry_run_then_sweep(tmp_path, fresh_pg):
    threads = ["a", "b", "c"]
    with run_service(tmp_path, "--database", fresh_pg, "--no-sweep", "--default-ttl", "1s") as service:
        with RemoteReducingSaver(service.url) as saver:
            for thread_id in threads:
                for index in range(3):
                    turn(saver, thread_id, index)
        time.sleep(1.2)
        before = {t: thread_bytes(fresh_pg, t) for t in threads}
        command = [str(CLI), "sweep", "--database", fresh_pg, "--default-ttl", "1s"]
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}

        dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, timeout=60, env=env)
        assert dry.returncode == 0, dry.stderr
        printed = json.loads(dry.stdout)
        assert {t: thread_bytes(fresh_pg, t) for t in threads} == before  # nothing changed
        assert sorted(t["thread_id"] for t in printed["threads"]) == threads
        assert all(t["bytes"] > 0 for t in printed["threads"])

        real = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
        assert real.returncode == 0, real.stderr
        done = json.loads(real.stdout)
        status = httpx.get(f"{service.url}/v1/sweeps/status").json()

    assert done["threads_pruned"] == 3 and done["errors"] == 0
    assert (
        printed["bytes_reclaimable"] <= done["bytes_reclaimed"] <= printed["bytes_reclaimable"] * 1.01 + 100
    )
    assert all(thread_bytes(fresh_pg, t)[1] == 1 for t in threads)
    # The service did not sweep (--no-sweep), but reports the cron run from the shared sweep log.
    assert status["sweeping"] is False and status["process"]["sweeps"] == 0
    assert status["database"]["threads_pruned"] == 3
    assert status["database"]["bytes_reclaimed"] == done["bytes_reclaimed"]
    print(
        f"\ncron dry run: {printed['bytes_reclaimable']} bytes in {printed['thread_count']} threads; "
        f"sweep reclaimed {done['bytes_reclaimed']}"
    )


def test_closing_figure_bytes_per_thread_after_100_turns(tmp_path, fresh_pg):
    turns = 100
    args = ["--database", fresh_pg, "--max-messages", "10", "--min-messages", "6", "--sweep-interval", "0.2s"]
    with run_service(tmp_path, *args) as service, RemoteReducingSaver(service.url) as saver:
        started = time.monotonic()

        def converse(thread_id: str, **configurable) -> None:
            for index in range(turns):
                turn(saver, thread_id, index, **configurable)

        # The two conversations at once (the service is another process), to keep the test short.
        other = threading.Thread(target=converse, args=("without-sweeps",))
        other.start()
        converse("with-keep-latest", checkpoint_ttl="1s")
        other.join()
        seconds = time.monotonic() - started
        head = saver.get_tuple(cfg("with-keep-latest"))
        unswept = thread_bytes(fresh_pg, "with-keep-latest")
        wait_for(lambda: thread_bytes(fresh_pg, "with-keep-latest")[1] == 1, 20, "the keep_latest sweep")
        after = saver.get_tuple(cfg("with-keep-latest"))
    plain, swept = thread_bytes(fresh_pg, "without-sweeps"), thread_bytes(fresh_pg, "with-keep-latest")
    assert after.checkpoint == head.checkpoint and after.metadata == head.metadata
    assert swept[0] * 20 < plain[0]
    print(
        f"\nbytes per thread after {turns} turns (real agent with tools, window 6-10 messages, PostgreSQL, "
        f"{2 * turns} turns in {seconds:.1f} s):\n"
        f"  without sweeps:            {plain[0]:>9,} bytes in {plain[1]} checkpoints\n"
        f"  before its keep_latest:    {unswept[0]:>9,} bytes in {unswept[1]} checkpoints\n"
        f"  after keep_latest sweep:   {swept[0]:>9,} bytes in {swept[1]} checkpoint "
        f"({plain[0] / swept[0]:.0f}x smaller)"
    )
