"""Plain rows a stock PostgresSaver planted, through the modes and the sweep, then a key rotation.

``required`` refuses to read them (fail closed, naming the thread); ``migrate`` reads them and
``reducing-saver encrypt-sweep`` encrypts them; a new primary key keeps everything readable, the sweep
moves every row to it, and the old key can then be removed. A stock PostgresSaver reading the encrypted
database fails with "Unknown serialization type", never a plausible value.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import time
import uuid
from typing import Any

import httpx
import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.postgres import PostgresSaver
from psycopg import Connection
from psycopg.rows import dict_row

from reducing_saver.client import ReducingSaverError, RemoteReducingSaver
from tests.support.encrypted_graph import graph
from tests.support.encryption import new_key, ring_json
from tests.support.server import CLI, ROOT, run_service

pytestmark = pytest.mark.e2e


def _stock_thread(database: str, thread_id: str, sentinel: str) -> None:
    """A thread written by a stock PostgresSaver: plain blobs, inline values, metadata, a pending write."""
    with Connection.connect(database, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        saver = PostgresSaver(conn)
        saver.setup()
        app = graph(saver)
        config = {"configurable": {"thread_id": thread_id}, "metadata": {"tag": f"meta {sentinel}"}}
        app.invoke({"messages": [HumanMessage(f"hello {sentinel}")]}, config)
        head = saver.get_tuple(config)
        saver.put_writes(head.config, [("notes", f"write {sentinel}")], "task-1")


def _sweep(database: str, ring: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    env.update(REDUCING_SAVER_ENCRYPTION_KEYS=ring, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [str(CLI), "encrypt-sweep", "--database", database],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert ring.split('"keys"')[1][10:30] not in done.stdout + done.stderr  # no key in its output
    return json.loads(done.stdout)


def _read(url: str, thread_id: str) -> dict:
    with RemoteReducingSaver(url, max_retries=0) as saver:
        item = saver.get_tuple({"configurable": {"thread_id": thread_id}})
        return {
            "values": item.checkpoint["channel_values"],
            "metadata": item.metadata,
            "writes": item.pending_writes,
        }


def _serve(tmp_path, database: str, mode: str, ring: str):
    """The service in ``mode``, without TTL sweeps (under migrate they would encrypt: the CLI's job here)."""
    return run_service(
        tmp_path,
        "--database",
        database,
        "--encryption",
        mode,
        "--no-sweep",
        env={"REDUCING_SAVER_ENCRYPTION_KEYS": ring},
    )


def _encrypted_rows_once_swept(url: str) -> dict[str, str]:
    """``reducing_saver_encrypted_rows`` by key id, once the TTL sweeper's encryption pass has left no
    plain row (or after 30 s, as last scraped)."""
    deadline, rows = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        metrics = httpx.get(url + "/metrics").text
        rows = dict(re.findall(r'^reducing_saver_encrypted_rows\{key_id="([^"]+)"\} (\S+)$', metrics, re.M))
        if rows and "plain" not in rows:
            break
        time.sleep(0.5)
    return rows


def test_plain_rows_through_the_modes_the_sweep_and_a_rotation(tmp_path, fresh_pg):
    sentinel = f"SENTINEL-{uuid.uuid4().hex}"
    _stock_thread(fresh_pg, "legacy", sentinel)
    k1, k2 = new_key(), new_key()
    ring1 = ring_json("k1", k1=k1)

    with _serve(tmp_path, fresh_pg, "required", ring1) as process:
        with pytest.raises(
            ReducingSaverError, match="thread 'legacy'.*plain text.*required refuses"
        ) as caught:
            _read(process.url, "legacy")
        assert caught.value.status_code == 500

    with _serve(tmp_path, fresh_pg, "migrate", ring1) as process:
        plain = _read(process.url, "legacy")
        assert plain["metadata"]["tag"] == f"meta {sentinel}"
        assert plain["values"]["notes"].startswith("notes about hello")
        assert [w[1:] for w in plain["writes"]] == [("notes", f"write {sentinel}")]
        with RemoteReducingSaver(process.url) as saver:  # a new turn on the old thread, written sealed
            graph(saver).invoke(
                {"messages": [HumanMessage("again")]}, {"configurable": {"thread_id": "legacy"}}
            )

    report = _sweep(fresh_pg, ring1)
    assert report["remaining"] == 0 and report["rewritten"]
    assert set(report["rows_by_key_id"]) == {"k1"}
    assert _sweep(fresh_pg, ring1)["rewritten"] == {}  # nothing left to do
    dump = subprocess.run(["pg_dump", fresh_pg], check=True, capture_output=True, text=True).stdout
    assert sentinel not in dump and sentinel.encode().hex() not in dump

    ring12 = json.dumps({"primary": "k2", "keys": {"k1": k1, "k2": k2}})
    with _serve(tmp_path, fresh_pg, "required", ring1) as process:
        after_sweep = _read(process.url, "legacy")
    contents = [m.content for m in after_sweep["values"]["messages"]]
    assert contents[0] == f"hello {sentinel}" and contents[2:] == ["again", "echo: again"]

    with _serve(tmp_path, fresh_pg, "required", ring12) as process:  # rotation: k2 writes, k1 still reads
        assert _read(process.url, "legacy") == after_sweep
        with RemoteReducingSaver(process.url) as saver:
            graph(saver).invoke({"messages": [HumanMessage("k2")]}, {"configurable": {"thread_id": "other"}})
    report = _sweep(fresh_pg, ring12)
    assert report["remaining"] == 0 and set(report["rows_by_key_id"]) == {"k2"}

    with _serve(tmp_path, fresh_pg, "required", ring_json("k2", k2=k2)) as process:  # k1 removed
        assert _read(process.url, "legacy") == after_sweep
        assert len(_read(process.url, "other")["values"]["messages"]) == 2

    # A stock PostgresSaver on the encrypted database fails clearly.
    with Connection.connect(fresh_pg, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        with pytest.raises(NotImplementedError, match="Unknown serialization type: reducing-saver/aesgcm"):
            PostgresSaver(conn).get_tuple({"configurable": {"thread_id": "legacy"}})


def test_the_ttl_sweeper_encrypts_under_migrate_and_counts_rows_per_key(tmp_path, fresh_pg):
    sentinel = f"SENTINEL-{uuid.uuid4().hex}"
    _stock_thread(fresh_pg, "legacy", sentinel)
    args = ("--database", fresh_pg, "--encryption", "migrate", "--sweep-interval", "1s")
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())}
    with run_service(tmp_path, *args, env=env) as process:
        rows = _encrypted_rows_once_swept(process.url)
        assert set(rows) == {"k1"} and float(rows["k1"]) > 0, rows
        assert _read(process.url, "legacy")["metadata"]["tag"] == f"meta {sentinel}"
    dump = subprocess.run(["pg_dump", fresh_pg], check=True, capture_output=True, text=True).stdout
    assert sentinel not in dump and sentinel.encode().hex() not in dump


def test_a_sweep_killed_midway_loses_nothing(tmp_path, fresh_pg):
    """kill -9 during a rotation sweep: every row is as it was or rewritten; the next sweep finishes."""
    import signal
    import time

    k1, k2 = new_key(), new_key()
    ring1 = ring_json("k1", k1=k1)
    threads = [f"t{index:03}" for index in range(60)]
    with _serve(tmp_path, fresh_pg, "required", ring1) as process, RemoteReducingSaver(process.url) as saver:
        app = graph(saver)
        for thread_id in threads:
            for turn in range(2):
                app.invoke(
                    {"messages": [HumanMessage(f"{thread_id} {turn}")]},
                    {"configurable": {"thread_id": thread_id}},
                )
    ring12 = json.dumps({"primary": "k2", "keys": {"k1": k1, "k2": k2}})
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    env.update(REDUCING_SAVER_ENCRYPTION_KEYS=ring12, PYTHONPATH=str(ROOT))
    sweep = subprocess.Popen(
        [str(CLI), "encrypt-sweep", "--database", fresh_pg], env=env, stdout=subprocess.DEVNULL
    )
    with Connection.connect(fresh_pg, autocommit=True) as conn:  # kill once it has rewritten some rows
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            moved = conn.execute(
                "SELECT count(*) FROM checkpoint_blobs WHERE type = 'reducing-saver/aesgcm' "
                "AND substring(blob from 3 for 2) = 'k2'"
            ).fetchone()[0]
            if moved >= 20:
                break
            time.sleep(0.01)
        sweep.send_signal(signal.SIGKILL)
        sweep.wait(timeout=10)
        total = conn.execute("SELECT count(*) FROM checkpoint_blobs WHERE type <> 'empty'").fetchone()[0]
    assert sweep.returncode == -signal.SIGKILL and 20 <= moved < total, (moved, total)

    with _serve(tmp_path, fresh_pg, "required", ring12) as process:  # half-rotated: everything reads
        for thread_id in threads:
            contents = [m.content for m in _read(process.url, thread_id)["values"]["messages"]]
            assert contents == [
                f"{thread_id} 0",
                f"echo: {thread_id} 0",
                f"{thread_id} 1",
                f"echo: {thread_id} 1",
            ]
    report = _sweep(fresh_pg, ring12)
    assert report["remaining"] == 0 and set(report["rows_by_key_id"]) == {"k2"}
    with _serve(tmp_path, fresh_pg, "required", ring_json("k2", k2=k2)) as process:
        for thread_id in threads:
            assert len(_read(process.url, thread_id)["values"]["messages"]) == 4


# -- every table the service writes, swept on both databases -----------------------------------------

API_KEYS = "acme=acme-key-0123456789abcdef"


def _sweep_tenants(database: str, ring: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    env.update(REDUCING_SAVER_ENCRYPTION_KEYS=ring, REDUCING_SAVER_API_KEYS=API_KEYS, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [str(CLI), "encrypt-sweep", "--database", database],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _plain_text_of(database: str, path: Any) -> str:
    """Every row of the database as text (pg_dump; SQLite's dump, blobs as hex)."""
    if path is None:
        return subprocess.run(["pg_dump", database], check=True, capture_output=True, text=True).stdout
    with sqlite3.connect(path) as conn:
        return "\n".join(conn.iterdump())


def _holds(text: str, sentinel: str) -> bool:
    """The sentinel as text or as hex (bytea in pg_dump, blobs in SQLite's dump)."""
    return any(form in text for form in (sentinel, sentinel.encode().hex(), sentinel.encode().hex().upper()))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_sweep_seals_every_table_then_required_reads_it(tmp_path, kind, request):
    """Plain rows of every kind (a summarized cut included), written without encryption, swept; then
    ``required`` reads the thread, its summary and the store, and the next turn works."""
    from reducing_saver.client import RemoteStore
    from tests.support.encrypted_graph import fill

    path = tmp_path / "db.sqlite" if kind == "sqlite" else None
    database = f"sqlite:///{path}" if path else request.getfixturevalue("fresh_pg")
    sentinel = f"SENTINEL-{uuid.uuid4().hex}"
    key = API_KEYS.split("=")[1]
    serve = (
        "--database",
        database,
        "--no-sweep",
        "--max-messages",
        "4",
        "--min-messages",
        "2",
        "--summarizer",
        "tests.support.summarizers:verbatim",
    )
    with run_service(tmp_path, *serve, env={"REDUCING_SAVER_API_KEYS": API_KEYS}) as process:
        fill(process.url, key, "t1", sentinel)
        with RemoteStore(process.url, api_key=key) as store:
            deadline = time.monotonic() + 20
            while store.get(("threads", "t1", "summary"), "running") is None:
                assert time.monotonic() < deadline, "no summary"
                time.sleep(0.1)
        with RemoteReducingSaver(process.url, api_key=key) as saver:
            before = saver.get_tuple({"configurable": {"thread_id": "t1"}})
    assert _holds(_plain_text_of(database, path), sentinel)

    ring = ring_json("k1", k1=new_key())
    report = _sweep_tenants(database, ring)
    assert report["remaining"] == 0 and not report["errors"] and set(report["rows_by_key_id"]) == {"k1"}, (
        report
    )
    channel_values = "checkpoints.channel_values" if kind == "sqlite" else "checkpoint_blobs"
    writes = "writes" if kind == "sqlite" else "checkpoint_writes"
    tables = {
        channel_values,
        writes,
        "checkpoints.metadata",
        "reducing_saver_outbox",
        "store",
        "reducing_saver_summaries",
    }
    assert tables <= set(report["rewritten"]), report
    assert _sweep_tenants(database, ring)["rewritten"] == {}  # nothing left to do
    assert not _holds(_plain_text_of(database, path), sentinel)

    env = {"REDUCING_SAVER_API_KEYS": API_KEYS, "REDUCING_SAVER_ENCRYPTION_KEYS": ring}
    with run_service(tmp_path, *serve, "--encryption", "required", env=env) as process:
        with RemoteReducingSaver(process.url, api_key=key, max_retries=0) as saver:
            after = saver.get_tuple({"configurable": {"thread_id": "t1"}})
            assert after.checkpoint["channel_values"] == before.checkpoint["channel_values"]
            assert after.metadata["tag"] == f"meta {sentinel}"
            graph(saver).invoke(
                {"messages": [HumanMessage("after the sweep")]}, {"configurable": {"thread_id": "t1"}}
            )
            messages = saver.get_tuple({"configurable": {"thread_id": "t1"}}).checkpoint["channel_values"][
                "messages"
            ]
        assert sentinel in str(messages[0].content)  # the summary, read from the sealed book
        with RemoteStore(process.url, api_key=key, max_retries=0) as store:
            assert sentinel in store.get(("threads", "t1", "summary"), "running").value["text"]
            assert store.get(("prefs", "t1"), "item").value == {"text": f"item {sentinel}"}
    if path is not None:  # SQLite keeps freed pages until VACUUM (docs/encryption.md)
        with sqlite3.connect(path) as conn:
            conn.execute("VACUUM")
        for file in path.parent.iterdir():
            assert sentinel.encode() not in file.read_bytes(), file.name


def test_the_sweep_refuses_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    env.update(REDUCING_SAVER_ENCRYPTION_KEYS=ring_json("k1", k1=new_key()), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [str(CLI), "encrypt-sweep", "--database", "memory://"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "memory:// keeps nothing beyond the service process" in done.stderr


def test_the_ttl_sweeper_encrypts_sqlite_under_migrate(tmp_path):
    """The TTL sweeper's pass of the encryption sweep, on a SQLite file a service without encryption wrote."""
    path = tmp_path / "db.sqlite"
    sentinel = f"SENTINEL-{uuid.uuid4().hex}"
    with run_service(tmp_path, "--database", f"sqlite:///{path}", "--no-sweep") as process:
        with RemoteReducingSaver(process.url) as saver:
            graph(saver).invoke(
                {"messages": [HumanMessage(f"hello {sentinel}")]}, {"configurable": {"thread_id": "t"}}
            )
    assert _holds(_plain_text_of(f"sqlite:///{path}", path), sentinel)
    args = ("--database", f"sqlite:///{path}", "--encryption", "migrate", "--sweep-interval", "1s")
    with run_service(
        tmp_path, *args, env={"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())}
    ) as process:
        rows = _encrypted_rows_once_swept(process.url)
        assert set(rows) == {"k1"} and float(rows["k1"]) > 0, rows
        assert _read(process.url, "t")["values"]["messages"][0].content == f"hello {sentinel}"
    assert not _holds(_plain_text_of(f"sqlite:///{path}", path), sentinel)
