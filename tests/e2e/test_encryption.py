"""Encryption at rest against a real service on real PostgreSQL (and SQLite): nothing readable is
stored, and every stored ciphertext that is changed, or moved to another place or tenant, fails to
read with an integrity error while everything else keeps working.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from reducing_saver.client import ReducingSaverError, RemoteReducingSaver, RemoteStore
from tests.support.encrypted_graph import fill
from tests.support.encryption import new_key, ring_json
from tests.support.server import ServiceProcess, run_service

pytestmark = pytest.mark.e2e

KEYS = {"acme": "acme-key-0123456789abcdef", "globex": "globex-key-0123456789abcdef"}
SERVE = ("--max-messages", "4", "--min-messages", "2")
#: A summarizer copying the cut messages into the summary: a sentinel in them reaches the summaries table.
SUMMARIZE = ("--summarizer", "tests.support.summarizers:verbatim")


def _env(ring: str | None) -> dict[str, str]:
    env = {"REDUCING_SAVER_API_KEYS": ",".join(f"{t}={k}" for t, k in KEYS.items())}
    if ring is not None:
        env["REDUCING_SAVER_ENCRYPTION_KEYS"] = ring
    return env


@pytest.fixture
def encrypted(tmp_path, fresh_pg) -> Iterator[tuple[ServiceProcess, str]]:
    args = ("--database", fresh_pg, "--encryption", "required", *SERVE)
    with run_service(tmp_path, *args, env=_env(ring_json("k1", k1=new_key()))) as process:
        yield process, fresh_pg


def _dump(database: str) -> str:
    return subprocess.run(
        ["pg_dump", "--no-owner", database], check=True, capture_output=True, text=True
    ).stdout


def _summarized(query: object, timeout: float = 20.0) -> list[str]:
    """Wait until every summary step is done (``query(sql)`` reads the database); the summaries' texts."""
    deadline = time.monotonic() + timeout
    while True:
        pending = query("SELECT count(*) FROM reducing_saver_summaries WHERE status <> 'done'")[0][0]
        texts = [row[0] for row in query("SELECT text FROM reducing_saver_summaries WHERE status = 'done'")]
        if texts and not pending:
            return texts
        assert time.monotonic() < deadline, "the summarizer did not catch up"
        time.sleep(0.1)


def _pg_query(database: str) -> object:
    def query(sql: str) -> list:
        with psycopg.connect(database) as conn:
            return conn.execute(sql).fetchall()

    return query


def _sqlite_query(path: object) -> object:
    def query(sql: str) -> list:
        with sqlite3.connect(path) as conn:
            return conn.execute(sql).fetchall()

    return query


def _found(sentinel: str, text: str) -> bool:
    """The sentinel as text (JSON, JSONB) or as hex (bytea in a dump)."""
    return sentinel in text or sentinel.encode().hex() in text


# -- nothing readable is stored ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["off", "required"])
def test_sentinel_in_no_table_of_pg_dump(tmp_path, fresh_pg, mode):
    """With encryption off the sentinel is in the dump (the check can fail); required: nowhere, cut and
    summarized messages included (the summaries' texts and batches, the store's copy of the summary)."""
    sentinel = f"SENTINEL-{uuid.uuid4().hex}"
    args = ("--database", fresh_pg, "--encryption", mode, *SERVE, *SUMMARIZE)
    ring = ring_json("k1", k1=new_key()) if mode == "required" else None
    with run_service(tmp_path, *args, env=_env(ring)) as process:
        fill(process.url, KEYS["acme"], "t1", sentinel)
        summaries = _summarized(_pg_query(fresh_pg))
        with RemoteStore(process.url, api_key=KEYS["acme"]) as store:
            running = store.get(("threads", "t1", "summary"), "running").value["text"]
    assert f"turn 0 {sentinel}" in running  # the summary holds a cut message's text
    with psycopg.connect(fresh_pg) as conn:  # every kind of row is there
        tables = ("checkpoints", "checkpoint_blobs", "checkpoint_writes", "store", "reducing_saver_outbox")
        for table in (*tables, "reducing_saver_summaries"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] > 0, table
        memories = conn.execute("SELECT count(*) FROM store WHERE prefix LIKE 'tenants.acme.memories%'")
        assert memories.fetchone()[0] > 0
        summary_copy = conn.execute(
            "SELECT count(*) FROM store WHERE prefix = 'tenants.acme.threads.t1.summary'"
        )
        assert summary_copy.fetchone()[0] == 1
    dump = _dump(fresh_pg)
    if mode == "off":
        for form in (f"meta {sentinel}", f"item {sentinel}", f"write {sentinel}", "notes about turn"):
            assert _found(form, dump), form
        assert any(sentinel in text for text in summaries)
    else:
        assert not _found(sentinel, dump)
        assert "tag" in dump  # metadata keys stay, their values do not


def test_sentinel_not_in_the_sqlite_file(tmp_path):
    sentinel = f"SENTINEL-{uuid.uuid4().hex}"
    database = tmp_path / "db" / "checkpoints.sqlite"
    args = ("--database", f"sqlite:///{database}", "--encryption", "required", *SERVE, *SUMMARIZE)
    with run_service(tmp_path, *args, env=_env(ring_json("k1", k1=new_key()))) as process:
        fill(process.url, KEYS["acme"], "t1", sentinel)
        _summarized(_sqlite_query(database))
        with RemoteStore(process.url, api_key=KEYS["acme"]) as store:
            assert sentinel in store.get(("threads", "t1", "summary"), "running").value["text"]
    files = list(database.parent.iterdir())
    assert any(f.stat().st_size > 0 for f in files)
    for path in files:
        data = path.read_bytes()
        assert sentinel.encode() not in data, path.name


# -- tampering --------------------------------------------------------------------------------------


def _read(url: str, tenant: str, thread_id: str):
    with RemoteReducingSaver(url, api_key=KEYS[tenant], max_retries=0) as saver:
        return saver.get_tuple({"configurable": {"thread_id": thread_id}})


def _assert_integrity_error(url: str, tenant: str, thread_id: str) -> None:
    with pytest.raises(ReducingSaverError) as caught:
        _read(url, tenant, thread_id)
    assert "integrity check failed" in str(caught.value)
    assert f"thread {thread_id!r}" in str(caught.value)  # the agent's own id, not the stored one


def _flip(conn: psycopg.Connection, table: str, column: str, where: str, params: tuple) -> None:
    """Flip one bit of the last byte of a bytea column (inside the GCM tag or the ciphertext)."""
    row = conn.execute(f"SELECT {column} FROM {table} WHERE {where} LIMIT 1", params).fetchone()
    data = bytearray(row[0])
    data[-1] ^= 0x01
    conn.execute(f"UPDATE {table} SET {column} = %s WHERE {where}", (bytes(data), *params))


def test_tampering_fails_with_an_integrity_error(encrypted):
    process, database = encrypted
    url = process.url
    for thread in (
        "flip-blob",
        "flip-write",
        "flip-meta",
        "to-thread-a",
        "to-thread-b",
        "channel",
        "version",
    ):
        _turns(url, "acme", thread)
    _turns(url, "globex", "to-thread-b")
    with psycopg.connect(database, autocommit=True) as conn:
        _flip(
            conn, "checkpoint_blobs", "blob", "thread_id = %s AND channel = 'messages'", ("acme:flip-blob",)
        )
        _flip(conn, "checkpoint_writes", "blob", "thread_id = %s", ("acme:flip-write",))
        # A metadata value: one base64 character of the sealed string changed.
        conn.execute(
            "UPDATE checkpoints SET metadata = jsonb_set(metadata, '{tag}', to_jsonb("
            "overlay(metadata->>'tag' placing CASE WHEN substr(metadata->>'tag', 40, 1) = 'A' THEN 'B' "
            "ELSE 'A' END from 40 for 1))) WHERE thread_id = %s",
            ("acme:flip-meta",),
        )
        # Copies: another thread of the tenant, another tenant, another channel, another version.
        _copy_blob(conn, ("acme:to-thread-a", "messages"), ("acme:flip-meta", "messages"))
        _copy_blob(conn, ("globex:to-thread-b", "messages"), ("acme:to-thread-b", "messages"))
        _copy_blob(conn, ("acme:channel", "messages"), ("acme:channel", "notes"))
        _replay_older_version(conn, "acme:version", "messages")
    _assert_integrity_error(url, "acme", "flip-blob")
    _assert_integrity_error(url, "acme", "flip-write")
    _assert_integrity_error(url, "acme", "flip-meta")
    _assert_integrity_error(url, "acme", "to-thread-a")
    _assert_integrity_error(url, "globex", "to-thread-b")
    _assert_integrity_error(url, "acme", "channel")
    _assert_integrity_error(url, "acme", "version")
    # Nothing else broke: the untouched thread reads, and the service keeps serving writes.
    assert _read(url, "acme", "to-thread-b").checkpoint["channel_values"]["messages"]
    _turns(url, "acme", "after")
    assert len(_read(url, "acme", "after").checkpoint["channel_values"]["messages"]) >= 2


def test_tampered_store_items_fail(encrypted):
    process, database = encrypted
    with RemoteStore(process.url, api_key=KEYS["acme"], max_retries=0) as store:
        store.put(("prefs",), "a", {"text": "a"})
        store.put(("prefs",), "b", {"text": "b"})
        store.put(("prefs",), "c", {"text": "c"})
        with psycopg.connect(database, autocommit=True) as conn:
            # b's value copied onto a (another key); c's sealed string changed.
            conn.execute("UPDATE store SET value = (SELECT value FROM store WHERE key = 'b') WHERE key = 'a'")
            conn.execute(
                "UPDATE store SET value = jsonb_build_object('reducing-saver/aesgcm', overlay("
                "value->>'reducing-saver/aesgcm' placing CASE WHEN substr(value->>'reducing-saver/aesgcm', 30, 1) "
                "= 'A' THEN 'B' ELSE 'A' END from 30 for 1)) WHERE key = 'c'"
            )
        for key in ("a", "c"):
            with pytest.raises(ReducingSaverError, match="integrity check failed"):
                store.get(("prefs",), key)
        assert store.get(("prefs",), "b").value == {"text": "b"}


def _turns(url: str, tenant: str, thread_id: str, turns: int = 2) -> None:
    from langchain_core.messages import HumanMessage

    from tests.support.encrypted_graph import graph

    with RemoteReducingSaver(url, api_key=KEYS[tenant]) as saver:
        app = graph(saver)
        config = {"configurable": {"thread_id": thread_id}, "metadata": {"tag": "a tag value long enough"}}
        for turn in range(turns):
            app.invoke({"messages": [HumanMessage(f"turn {turn}")]}, config)
        head = saver.get_tuple({"configurable": {"thread_id": thread_id}})
        saver.put_writes(head.config, [("notes", "pending")], "task-1")


def _head_version(conn: psycopg.Connection, thread_id: str, channel: str) -> str:
    row = conn.execute(
        "SELECT checkpoint->'channel_versions'->>%s FROM checkpoints WHERE thread_id = %s "
        "ORDER BY checkpoint_id DESC LIMIT 1",
        (channel, thread_id),
    ).fetchone()
    return row[0]


def _copy_blob(conn: psycopg.Connection, target: tuple[str, str], source: tuple[str, str]) -> None:
    """The head blob of ``source`` (thread, channel) written over the head blob of ``target``."""
    (t_thread, t_channel), (s_thread, s_channel) = target, source
    s_version, t_version = _head_version(conn, s_thread, s_channel), _head_version(conn, t_thread, t_channel)
    updated = conn.execute(
        "UPDATE checkpoint_blobs SET blob = (SELECT blob FROM checkpoint_blobs WHERE thread_id = %s "
        "AND channel = %s AND version = %s) WHERE thread_id = %s AND channel = %s AND version = %s",
        (s_thread, s_channel, s_version, t_thread, t_channel, t_version),
    )
    assert updated.rowcount == 1


def _replay_older_version(conn: psycopg.Connection, thread_id: str, channel: str) -> None:
    """An older version's ciphertext of the channel written over the head's (a replay)."""
    head = _head_version(conn, thread_id, channel)
    older = conn.execute(
        "SELECT version FROM checkpoint_blobs WHERE thread_id = %s AND channel = %s AND version < %s "
        "ORDER BY version DESC LIMIT 1",
        (thread_id, channel, head),
    ).fetchone()[0]
    updated = conn.execute(
        "UPDATE checkpoint_blobs SET blob = (SELECT blob FROM checkpoint_blobs WHERE thread_id = %s "
        "AND channel = %s AND version = %s) WHERE thread_id = %s AND channel = %s AND version = %s",
        (thread_id, channel, older, thread_id, channel, head),
    )
    assert updated.rowcount == 1


def test_store_filters_apply_after_decrypting(encrypted):
    process, _ = encrypted
    with RemoteStore(process.url, api_key=KEYS["acme"]) as store:
        for index in range(12):
            store.put(("docs",), f"d{index:02}", {"kind": "even" if index % 2 == 0 else "odd", "n": index})
        found = store.search(("docs",), filter={"kind": "even"}, limit=3, offset=1)
        assert len(found) == 3 and all(item.value["kind"] == "even" for item in found)
        evens = store.search(("docs",), filter={"kind": "even"}, limit=100)
        assert sorted(item.value["n"] for item in evens) == [0, 2, 4, 6, 8, 10]
        assert [i.key for i in found] == [i.key for i in evens][1:4]
        assert {i.value["n"] for i in store.search(("docs",), filter={"n": {"$gt": 9}})} == {10, 11}
        assert len(store.search(("docs",), limit=100)) == 12


def test_delete_with_extraction_reads_the_sealed_window(tmp_path, fresh_pg):
    """--extract-on-delete: the thread's last window is opened, its messages sealed into the outbox, and
    delivered to the store, where the agent reads them back."""
    import time

    from langchain_core.messages import HumanMessage

    from tests.support.encrypted_graph import graph

    args = ("--database", fresh_pg, "--encryption", "required", "--extract-on-delete", "--max-messages", "50")
    with run_service(tmp_path, *args, env=_env(ring_json("k1", k1=new_key()))) as process:
        with RemoteReducingSaver(process.url, api_key=KEYS["acme"]) as saver:
            graph(saver).invoke(
                {"messages": [HumanMessage("remember me")]}, {"configurable": {"thread_id": "gone"}}
            )
            saver.delete_thread("gone")
        with RemoteStore(process.url, api_key=KEYS["acme"]) as store:
            deadline = time.monotonic() + 20
            while len(found := store.search(("memories", "gone"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
        assert "remember me" in str([item.value for item in found])
    with psycopg.connect(fresh_pg) as conn:
        assert "remember me" not in str(
            conn.execute("SELECT message::text FROM reducing_saver_outbox").fetchall()
        )
