"""Central extraction to long-term memory: exactly once across replicas, nothing lost under chaos.

Two service processes on one PostgreSQL, four agent worker processes whose threads alternate between
the replicas turn by turn, real LangGraph graphs with tool calls. The extractor counts its calls in a
table of the same database.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import psycopg
import pytest
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.store.postgres import PostgresStore

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.reducer import namespace_for
from tests.support.agent_worker import thread_config
from tests.support.server import CLI, ROOT, free_port, run_service, wait_ready

WORKERS, THREADS_PER_WORKER, TURNS = 4, 2, 30
SERVICE_ARGS = [
    "--max-messages",
    "6",
    "--min-messages",
    "4",
    "--extractor",
    "tests.support.extractors:counting",
]


def _threads(worker: int) -> list[str]:
    return [f"w{worker}-t{index}" for index in range(THREADS_PER_WORKER)]


ALL_THREADS = [t for w in range(WORKERS) for t in _threads(w)]


def _agents(urls: list[str], tmp_path: Path, *extra: str) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.agent_worker",
                "--url",
                ",".join(urls),
                "--turns",
                str(TURNS),
                "--threads",
                ",".join(_threads(w)),
                "--out",
                str(tmp_path / f"agent-{w}.json"),
                *(["--async"] if w % 2 else []),
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for w in range(WORKERS)
    ]


def _wait(agents: list[subprocess.Popen]) -> dict:
    for agent in agents:
        output, _ = agent.communicate(timeout=600)
        assert agent.returncode == 0, output.decode(errors="replace")[-4000:]
    seen: dict = {}
    for path in sorted(Path(agents[0].args[agents[0].args.index("--out") + 1]).parent.glob("agent-*.json")):
        seen.update(json.loads(path.read_text()))
    return seen


def _drain(url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/extraction/status", timeout=5).json()
        if status["pending"] == 0 and status["in_flight"] == 0:
            return status
        time.sleep(0.2)
    raise AssertionError(f"outbox not drained after {timeout}s: {status}")


def _expected_pruned(database: str, seen: dict) -> dict[tuple[str, ...], set[str]]:
    """Per namespace: every message id a thread ever had, minus the ids of its latest stored window."""
    expected = {}
    with PostgresSaver.from_conn_string(database) as stock:
        for thread_id in ALL_THREADS:
            config = thread_config(thread_id)
            stored = stock.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
            window = {m.id for m in stored.checkpoint["channel_values"]["messages"]}
            expected[namespace_for(config, "memory_namespace")] = set(seen[thread_id]["ids"]) - window
    return expected


def _calls(database: str) -> Counter:
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT namespace, key FROM extractor_calls").fetchall()
    return Counter((tuple(namespace), key) for namespace, key in rows)


def _store_keys(database: str, namespace: tuple[str, ...]) -> list[str]:
    with PostgresStore.from_conn_string(database) as store:
        store.setup()
        return [item.key for item in store.search(namespace, limit=10_000)]


def _lag(database: str) -> tuple[float, float, int]:
    with psycopg.connect(database) as conn:
        lags = [
            row[0]
            for row in conn.execute(
                "SELECT extract(epoch FROM delivered_at - pruned_at) FROM reducing_saver_outbox WHERE status = 'done'"
            )
        ]
    lags.sort()
    return statistics.median(lags), lags[min(len(lags) - 1, int(0.99 * len(lags)))], len(lags)


def _check_store(database: str, expected: dict[tuple[str, ...], set[str]]) -> int:
    total = 0
    for namespace, ids in expected.items():
        keys = _store_keys(database, namespace)
        assert len(keys) == len(set(keys))
        assert set(keys) == ids, namespace
        total += len(ids)
    return total


def test_two_replicas_extract_every_pruned_message_exactly_once(tmp_path, fresh_pg):
    env = {"RS_TEST_CALLS_DB": fresh_pg}
    with ExitStack() as stack:
        replicas = [
            stack.enter_context(run_service(tmp_path, "--database", fresh_pg, *SERVICE_ARGS, env=env))
            for _ in range(2)
        ]
        seen = _wait(_agents([r.url for r in replicas], tmp_path))
        _drain(replicas[0].url)
        status = httpx.get(f"{replicas[1].url}/v1/extraction/status").json()

    expected = _expected_pruned(fresh_pg, seen)
    calls = _calls(fresh_pg)
    assert max(calls.values()) == 1, [k for k, n in calls.items() if n > 1][:5]
    assert set(calls) == {(ns, key) for ns, ids in expected.items() for key in ids}
    pruned = _check_store(fresh_pg, expected)
    assert status["delivered"] == pruned and status["dead"] == 0
    median, p99, count = _lag(fresh_pg)
    print(
        f"\n{pruned} messages pruned, {sum(calls.values())} extractor deliveries, 0 duplicates; "
        f"extraction lag median {median * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms over {count} messages"
    )


def test_chaos_kill_replicas_and_a_flaky_extractor_lose_nothing(tmp_path, fresh_pg):
    env = {
        "RS_TEST_CALLS_DB": fresh_pg,
        "RS_TEST_FAIL_RATE": "0.3",
        "REDUCING_SAVER_EXTRACTION_BASE_BACKOFF": "0.05",
        "REDUCING_SAVER_EXTRACTION_MAX_BACKOFF": "0.5",
    }
    args = [*SERVICE_ARGS, "--extraction-max-attempts", "30", "--extraction-lease-seconds", "2"]
    ports = [free_port(), free_port()]
    acks = tmp_path / "acks.jsonl"
    acks.touch()
    # A kill each time the agents have acknowledged another fifth of their turns' puts (3 a turn at the
    # least), from the first fifth: the chaos follows the agents' pace, however fast the machine.
    step = WORKERS * THREADS_PER_WORKER * TURNS * 3 // 5
    acked_at_kills: list[int] = []  # one entry a kill
    stop = threading.Event()
    with ExitStack() as stack:
        services = [
            stack.enter_context(run_service(tmp_path, "--database", fresh_pg, *args, env=env, port=port))
            for port in ports
        ]
        processes = [s.process for s in services]

        def acked_puts() -> int:
            with acks.open("rb") as lines:
                return sum(1 for _ in lines)

        def chaos() -> None:
            rng = random.Random(7)
            while not stop.wait(0.05):
                if acked_puts() < step * (len(acked_at_kills) + 1):
                    continue
                index = rng.randrange(2)
                processes[index].send_signal(signal.SIGKILL)
                processes[index].wait()
                acked_at_kills.append(acked_puts())
                log = (tmp_path / f"restart-{len(acked_at_kills)}.log").open("wb")
                stack.callback(log.close)
                full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
                processes[index] = subprocess.Popen(
                    [str(CLI), "serve", "--port", str(ports[index]), "--database", fresh_pg, *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    cwd=tmp_path,
                )
                stack.callback(_terminate, processes, index)
                wait_ready(services[index].url, processes[index], Path(log.name))

        chaos_thread = threading.Thread(target=chaos, daemon=True)
        chaos_thread.start()
        try:
            seen = _wait(_agents([s.url for s in services], tmp_path, "--retries", "12", "--acks", str(acks)))
        finally:
            stop.set()
            chaos_thread.join(timeout=60)
        status = _drain(services[0].url)

    # No acknowledged checkpoint is missing.
    acked = [json.loads(line) for line in acks.read_text().splitlines()]
    # Replicas died while the agents worked, not after.
    assert len([n for n in acked_at_kills if n < len(acked)]) >= 3, (acked_at_kills, len(acked))
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        missing = [a for a in acked if stock.get_tuple({"configurable": a}) is None]
    assert not missing, missing[:3]
    expected = _expected_pruned(fresh_pg, seen)
    pruned = _check_store(fresh_pg, expected)
    calls = _calls(fresh_pg)
    assert set(calls) == {(ns, key) for ns, ids in expected.items() for key in ids}
    assert status["dead"] == 0
    duplicates = sum(n - 1 for n in calls.values())
    print(
        f"\nchaos: {len(acked_at_kills)} replica kills (after {acked_at_kills} acknowledged puts), "
        f"{len(acked)} acknowledged checkpoints all stored; {pruned} messages "
        f"pruned, all in the store once; {sum(calls.values())} extractor deliveries, {duplicates} duplicates"
    )


def _terminate(processes: list[subprocess.Popen], index: int) -> None:
    process = processes[index]
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def test_pending_rows_are_delivered_after_a_restart(tmp_path, fresh_pg):
    config = {"configurable": {"thread_id": "restart", "memory_namespace": ["team", "restart"]}}
    from tests.support.agents import build_agent, user_line

    with run_service(tmp_path, "--database", fresh_pg, "--max-messages", "4", "--no-extract") as service:
        with RemoteReducingSaver(service.url) as saver:
            graph = build_agent(saver)
            for turn in range(6):
                graph.invoke({"messages": [("user", user_line(3 * turn))]}, config)
        time.sleep(1.5)  # a deliverer would have run by now: this process has none
        pending = httpx.get(f"{service.url}/v1/extraction/status").json()
        assert pending["pending"] > 0 and pending["delivered"] == 0
        assert _store_keys(fresh_pg, ("team", "restart")) == []

    status_cli = subprocess.run(
        [str(CLI), "extraction", "status", "--database", fresh_pg], capture_output=True, text=True, check=True
    )
    assert json.loads(status_cli.stdout)["pending"] == pending["pending"]

    with run_service(tmp_path, "--database", fresh_pg) as service:
        status = _drain(service.url)
    assert status["delivered"] == pending["pending"]
    assert len(_store_keys(fresh_pg, ("team", "restart"))) == pending["pending"]


def test_a_separate_worker_process_delivers(tmp_path, fresh_pg):
    config = {"configurable": {"thread_id": "worker.1"}}  # a dotted thread id: escaped in the namespace
    from tests.support.agents import build_agent, user_line

    with run_service(tmp_path, "--database", fresh_pg, "--max-messages", "4", "--no-extract") as service:
        with RemoteReducingSaver(service.url) as saver:
            graph = build_agent(saver)
            for turn in range(6):
                graph.invoke({"messages": [("user", user_line(3 * turn))]}, config)
        worker = subprocess.Popen(
            [str(CLI), "worker", "--database", fresh_pg],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            status = _drain(service.url, timeout=60)
        finally:
            worker.send_signal(signal.SIGTERM)
            output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output.decode(errors="replace")
    assert status["delivered"] > 0
    keys = _store_keys(fresh_pg, ("memories", "worker%2E1"))
    assert len(keys) == status["delivered"]


def test_a_namespace_the_store_refuses_is_a_422_at_put_time(tmp_path, fresh_pg):
    from tests.support.agents import build_agent, user_line

    with run_service(tmp_path, "--database", fresh_pg) as service, RemoteReducingSaver(service.url) as saver:
        graph = build_agent(saver)
        config = {"configurable": {"thread_id": "t", "memory_namespace": ["team.a", "x"]}}
        with pytest.raises(Exception) as excinfo:
            graph.invoke({"messages": [("user", user_line(0))]}, config)
        assert "team.a" in str(excinfo.value) and "memory_namespace" in str(excinfo.value)
        # The put that would have stored messages under that namespace was refused; nothing holds them.
        stored = list(saver.list({"configurable": {"thread_id": "t"}}))
        assert all("messages" not in item.checkpoint["channel_values"] for item in stored)
