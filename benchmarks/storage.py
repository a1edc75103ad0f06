"""Storage: one long chat through the service vs a plain PostgresSaver, in the same database.

After every turn it reads, for each thread, the newest messages blob, the head checkpoint (its row, the
blobs it points at and its writes) and the thread's total. Sizes are logical bytes: ``octet_length`` of
blobs and of the JSONB rows as text, before PostgreSQL's own compression. Then it prunes both threads
with ``keep_latest`` and reads the totals again.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
from langgraph.checkpoint.postgres import PostgresSaver

from benchmarks._common import chat_graph, ratio, thread_config, user_input
from reducing_saver.client import RemoteReducingSaver

NEWEST_MESSAGES_BLOB = """
    SELECT octet_length(b.blob)
    FROM checkpoints c
    JOIN checkpoint_blobs b ON b.thread_id = c.thread_id AND b.checkpoint_ns = c.checkpoint_ns
        AND b.channel = 'messages' AND b.version = c.checkpoint -> 'channel_versions' ->> 'messages'
    WHERE c.thread_id = %(t)s AND c.checkpoint_ns = ''
    ORDER BY c.checkpoint_id DESC LIMIT 1
"""

HEAD_CHECKPOINT = """
    WITH head AS (
        SELECT * FROM checkpoints WHERE thread_id = %(t)s AND checkpoint_ns = ''
        ORDER BY checkpoint_id DESC LIMIT 1
    )
    SELECT octet_length(h.checkpoint::text) + octet_length(h.metadata::text)
        + COALESCE((SELECT sum(octet_length(b.blob)) FROM checkpoint_blobs b,
                        jsonb_each_text(h.checkpoint -> 'channel_versions') v
                    WHERE b.thread_id = h.thread_id AND b.checkpoint_ns = h.checkpoint_ns
                      AND b.channel = v.key AND b.version = v.value), 0)
        + COALESCE((SELECT sum(octet_length(w.blob)) FROM checkpoint_writes w
                    WHERE w.thread_id = h.thread_id AND w.checkpoint_ns = h.checkpoint_ns
                      AND w.checkpoint_id = h.checkpoint_id), 0)
    FROM head h
"""

THREAD_TOTALS = """
    SELECT
        (SELECT COALESCE(sum(octet_length(checkpoint::text) + octet_length(metadata::text)), 0)
         FROM checkpoints WHERE thread_id = %(t)s) AS checkpoints_bytes,
        (SELECT COALESCE(sum(octet_length(blob)), 0) FROM checkpoint_blobs WHERE thread_id = %(t)s) AS blobs_bytes,
        (SELECT COALESCE(sum(octet_length(blob)), 0) FROM checkpoint_writes WHERE thread_id = %(t)s) AS writes_bytes,
        (SELECT COALESCE(sum(pg_column_size(c.*)), 0) FROM checkpoints c WHERE thread_id = %(t)s)
        + (SELECT COALESCE(sum(pg_column_size(b.*)), 0) FROM checkpoint_blobs b WHERE thread_id = %(t)s)
        + (SELECT COALESCE(sum(pg_column_size(w.*)), 0) FROM checkpoint_writes w WHERE thread_id = %(t)s)
            AS stored_bytes,
        (SELECT count(*) FROM checkpoints WHERE thread_id = %(t)s) AS checkpoints,
        (SELECT count(*) FROM checkpoint_blobs WHERE thread_id = %(t)s) AS blobs,
        (SELECT count(*) FROM checkpoint_writes WHERE thread_id = %(t)s) AS writes
"""


def _scalar(conn: psycopg.Connection, sql: str, thread_id: str) -> int:
    row = conn.execute(sql, {"t": thread_id}).fetchone()
    return int(row[0] or 0) if row else 0


def _totals(conn: psycopg.Connection, thread_id: str) -> dict[str, int]:
    cur = conn.execute(THREAD_TOTALS, {"t": thread_id})
    names = [column.name for column in cur.description]
    values = dict(zip(names, (int(v) for v in cur.fetchone()), strict=True))
    values["thread_bytes"] = values["checkpoints_bytes"] + values["blobs_bytes"] + values["writes_bytes"]
    return values


def _memory_bytes(conn: psycopg.Connection, thread_id: str) -> dict[str, int]:
    """What long-term memory holds for the thread: its outbox rows and the store items of its namespace."""
    out = {}
    for name, sql in (
        (
            "outbox_bytes",
            "SELECT COALESCE(sum(pg_column_size(o.*)), 0) FROM reducing_saver_outbox o WHERE thread_id = %(t)s",
        ),
        ("store_bytes", "SELECT COALESCE(sum(pg_column_size(s.*)), 0) FROM store s WHERE prefix = %(p)s"),
        ("store_items", "SELECT count(*) FROM store WHERE prefix = %(p)s"),
    ):
        try:
            row = conn.execute(sql, {"t": thread_id, "p": f"memories.{thread_id}"}).fetchone()
            out[name] = int(row[0])
        except psycopg.Error:  # a service version without these tables
            out[name] = 0
    return out


def wait_extraction_drained(url: str, timeout: float) -> dict[str, Any]:
    """Wait until the service's outbox has nothing pending or in flight; returns the last status."""
    import httpx

    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{url}/v1/extraction/status", timeout=5.0).json()
        except httpx.HTTPError:
            return {}
        if not status.get("pending") and not status.get("in_flight"):
            break
        time.sleep(0.2)
    return status


def run(service_url: str, database: str, *, turns: int, window: int) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    threads = {"service": f"storage-service-{run_id}", "plain": f"storage-plain-{run_id}"}
    per_turn: dict[str, dict[str, list[int]]] = {
        kind: {"messages_blob_bytes": [], "head_checkpoint_bytes": [], "thread_bytes": []} for kind in threads
    }
    with (
        psycopg.connect(database, autocommit=True) as conn,
        RemoteReducingSaver(service_url) as remote,
        PostgresSaver.from_conn_string(database) as plain,
    ):
        plain.setup()
        graphs = {"service": chat_graph(remote), "plain": chat_graph(plain)}
        for turn in range(1, turns + 1):
            for kind, graph in graphs.items():
                graph.invoke(user_input(turn), thread_config(threads[kind]))
                series = per_turn[kind]
                series["messages_blob_bytes"].append(_scalar(conn, NEWEST_MESSAGES_BLOB, threads[kind]))
                series["head_checkpoint_bytes"].append(_scalar(conn, HEAD_CHECKPOINT, threads[kind]))
                series["thread_bytes"].append(_totals(conn, threads[kind])["thread_bytes"])
        before = {kind: _totals(conn, thread_id) for kind, thread_id in threads.items()}
        remote.prune([threads["service"]], strategy="keep_latest")
        plain.prune([threads["plain"]], strategy="keep_latest")
        after = {kind: _totals(conn, thread_id) for kind, thread_id in threads.items()}
        wait_extraction_drained(service_url, timeout=30.0)
        memory = _memory_bytes(conn, threads["service"])

    # The window fills at the first turn whose checkpoint holds `window` messages (2 per turn).
    fill = min(max(1, (window + 1) // 2), turns)
    service = per_turn["service"]
    plain_series = per_turn["plain"]
    window_checkpoint = service["head_checkpoint_bytes"][fill - 1]
    return {
        "turns": turns,
        "window": window,
        "window_fill_turn": fill,
        "per_turn": {"turn": list(range(1, turns + 1)), **per_turn},
        "totals": {
            kind: {
                **before[kind],
                "newest_messages_blob_bytes": per_turn[kind]["messages_blob_bytes"][-1],
                "messages_blob_bytes_at_window_fill": per_turn[kind]["messages_blob_bytes"][fill - 1],
                "head_checkpoint_bytes": per_turn[kind]["head_checkpoint_bytes"][-1],
                "after_prune_bytes": after[kind]["thread_bytes"],
                "after_prune_stored_bytes": after[kind]["stored_bytes"],
                "after_prune_checkpoints": after[kind]["checkpoints"],
            }
            for kind in threads
        },
        "window_checkpoint_bytes": window_checkpoint,
        "long_term_memory": memory,
        "ratios": {
            # ~1.0: the reduced blob stops growing once the window is full.
            "service_blob_final_vs_window_fill": ratio(
                service["messages_blob_bytes"][-1], service["messages_blob_bytes"][fill - 1]
            ),
            "plain_blob_final_vs_window_fill": ratio(
                plain_series["messages_blob_bytes"][-1], plain_series["messages_blob_bytes"][fill - 1]
            ),
            "plain_vs_service_newest_blob": ratio(
                plain_series["messages_blob_bytes"][-1], service["messages_blob_bytes"][-1]
            ),
            "plain_vs_service_thread_bytes": ratio(
                before["plain"]["thread_bytes"], before["service"]["thread_bytes"]
            ),
            # ~1.0: after keep_latest a reduced thread is one window's checkpoint.
            "service_after_prune_vs_window_checkpoint": ratio(
                after["service"]["thread_bytes"], window_checkpoint
            ),
            "plain_vs_service_after_prune": ratio(
                after["plain"]["thread_bytes"], after["service"]["thread_bytes"]
            ),
        },
    }
