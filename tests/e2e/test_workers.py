"""Four agent worker processes, real LangGraph graphs with tool calls, one service on PostgreSQL.

Checks: windows stay bounded, every pruned message reaches on_prune once under the right namespace,
the agents answer exactly as they do in-process on ReducingSaver(PostgresSaver), and a stock
PostgresSaver reads the service's threads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psycopg
from langchain_core.messages import messages_to_dict
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from reducing_saver.client import RemoteReducingSaver
from tests.support.agent_worker import thread_config
from tests.support.server import ROOT, run_service
from tests.support.windows import assert_valid_window

WORKERS = 4
THREADS_PER_WORKER = 2
TURNS = 30
MAX_MESSAGES, MIN_MESSAGES = 6, 4


def _threads(worker: int) -> list[str]:
    return [f"w{worker}-t{index}" for index in range(THREADS_PER_WORKER)]


def _run_workers(commands: list[list[str]], cwd: Path) -> None:
    env_path = {"PYTHONPATH": str(ROOT)}
    import os

    env = {**os.environ, **env_path}
    processes = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd in commands
    ]
    for process in processes:
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output.decode(errors="replace")


def _messages_blob_sizes(database: str, thread_id: str) -> list[tuple[int, int]]:
    """(stored message count, blob bytes) of every messages blob of the thread, oldest first."""
    serde = JsonPlusSerializer()
    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT type, blob FROM checkpoint_blobs WHERE thread_id = %s AND channel = 'messages' "
            "ORDER BY version",
            (thread_id,),
        ).fetchall()
    return [(len(serde.loads_typed((kind, bytes(blob)))), len(blob)) for kind, blob in rows]


def test_four_workers_against_one_service(tmp_path, make_database):
    service_db, inprocess_db = make_database(), make_database()
    prune_log = tmp_path / "pruned.jsonl"
    worker = [sys.executable, "-m", "tests.support.agent_worker", "--turns", str(TURNS)]
    all_threads = [t for w in range(WORKERS) for t in _threads(w)]

    with run_service(
        tmp_path,
        "--database",
        service_db,
        "--max-messages",
        str(MAX_MESSAGES),
        "--min-messages",
        str(MIN_MESSAGES),
        "--on-prune",
        "tests.support.hooks:record",
        env={"RS_TEST_PRUNE_LOG": str(prune_log)},
    ) as service:
        _run_workers(
            [
                [
                    *worker,
                    "--url",
                    service.url,
                    "--threads",
                    ",".join(_threads(w)),
                    "--out",
                    str(tmp_path / f"remote-{w}.json"),
                    *(["--async"] if w % 2 else []),
                ]
                for w in range(WORKERS)
            ],
            tmp_path,
        )
        with RemoteReducingSaver(service.url) as client:
            remote_windows = {
                t: client.get_tuple(thread_config(t)).checkpoint["channel_values"]["messages"]
                for t in all_threads
            }

    # The same agents in-process, on ReducingSaver(PostgresSaver), one worker for all threads.
    _run_workers(
        [
            [
                *worker,
                "--database",
                inprocess_db,
                "--threads",
                ",".join(all_threads),
                "--max-messages",
                str(MAX_MESSAGES),
                "--min-messages",
                str(MIN_MESSAGES),
                "--out",
                str(tmp_path / "inprocess.json"),
            ]
        ],
        tmp_path,
    )
    remote = {}
    for w in range(WORKERS):
        remote.update(json.loads((tmp_path / f"remote-{w}.json").read_text()))
    inprocess = json.loads((tmp_path / "inprocess.json").read_text())

    # Congruence: every answer of every turn is the same as in-process.
    for thread_id in all_threads:
        assert remote[thread_id]["answers"] == inprocess[thread_id]["answers"], thread_id

    # Every pruned message reached on_prune exactly once, with the thread's namespace.
    pruned = [json.loads(line) for line in prune_log.read_text().splitlines()]
    counts = Counter((tuple(p["namespace"]), p["id"]) for p in pruned)
    assert counts and max(counts.values()) == 1, [k for k, n in counts.items() if n > 1][:5]
    with PostgresSaver.from_conn_string(service_db) as stock:
        for thread_id in all_threads:
            configurable = thread_config(thread_id)["configurable"]
            namespace = tuple(configurable.get("memory_namespace") or ("memories", thread_id))
            pruned_ids = {p["id"] for p in pruned if tuple(p["namespace"]) == namespace}
            # Interop: a stock PostgresSaver reads the service's thread, equal to what the agent sees.
            stored = stock.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
            window = stored.checkpoint["channel_values"]["messages"]
            assert messages_to_dict(window) == messages_to_dict(remote_windows[thread_id])
            assert_valid_window(window)
            assert len(window) <= MAX_MESSAGES
            window_ids = {m.id for m in window}
            assert not pruned_ids & window_ids
            assert pruned_ids | window_ids == set(remote[thread_id]["ids"]), thread_id

            sizes = _messages_blob_sizes(service_db, thread_id)
            fill = next(size for count, size in sizes if count >= MAX_MESSAGES)
            assert max(count for count, _ in sizes) <= MAX_MESSAGES
            assert sizes[-1][1] <= fill, (thread_id, sizes[-1], fill)
    print(
        f"\n{len(pruned)} messages pruned over {len(all_threads)} threads x {TURNS} turns; "
        f"newest blob {sizes[-1][1]} B vs {fill} B at window fill"
    )
