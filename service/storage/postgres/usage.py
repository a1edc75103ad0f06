"""What threads hold in PostgreSQL: ``pg_column_size`` of every row, per thread, in one snapshot.

See :mod:`reducing_saver.service.storage.usage` for the figures and the plain estimate.
"""

from __future__ import annotations

from typing import Any

from reducing_saver.service.msgpack_headers import array_length
from reducing_saver.service.storage.outbox import TABLE as OUTBOX_TABLE
from reducing_saver.service.storage.usage import (
    Head,
    Selection,
    ThreadStorage,
    assemble,
    checkpoints_had,
)

_CHECKPOINTS = """
SELECT thread_id, count(*) AS n, sum(pg_column_size(c.*)) AS bytes FROM checkpoints c
WHERE {where} GROUP BY thread_id
"""
_BLOBS = """
SELECT thread_id, sum(pg_column_size(b.*)) AS bytes,
       COALESCE(sum(pg_column_size(b.*)) FILTER (WHERE channel = %(key)s), 0) AS messages
FROM checkpoint_blobs b WHERE {where} GROUP BY thread_id
"""
_WRITES = """
SELECT thread_id, sum(pg_column_size(w.*)) AS bytes FROM checkpoint_writes w WHERE {where} GROUP BY thread_id
"""
# Each namespace's head, its messages version and step, and the messages blob that version names. Its size is
# read uncompressed: a plain saver's long histories would be compressed (TOAST) at another ratio than
# this short window, and prose compresses little.
_HEADS = """
SELECT h.thread_id, h.checkpoint_ns, h.step, length(b.blob) AS window_bytes,
       substring(b.blob FROM 1 FOR 5) AS header
FROM (
    SELECT DISTINCT ON (thread_id, checkpoint_ns) thread_id, checkpoint_ns,
           checkpoint -> 'channel_versions' ->> %(key)s AS version, metadata -> 'step' AS step
    FROM checkpoints WHERE {where} ORDER BY thread_id, checkpoint_ns, checkpoint_id DESC
) AS h
LEFT JOIN checkpoint_blobs b ON b.thread_id = h.thread_id AND b.checkpoint_ns = h.checkpoint_ns
    AND b.channel = %(key)s AND b.version = h.version
"""
# The channels the thread's checkpoints count steps for since their last snapshot: its DeltaChannels.
_DELTA = """
SELECT thread_id, array_agg(DISTINCT channel ORDER BY channel) AS channels
FROM checkpoints CROSS JOIN LATERAL jsonb_object_keys(
    CASE WHEN jsonb_typeof(metadata -> 'counters_since_delta_snapshot') = 'object'
         THEN metadata -> 'counters_since_delta_snapshot' ELSE '{{}}'::jsonb END) AS channel
WHERE {where} GROUP BY thread_id
"""
_OUTBOX = f"""
SELECT {{tenant}} AS tenant, thread_id, count(*) AS n, sum(pg_column_size(o.*)) AS bytes
FROM {OUTBOX_TABLE} o WHERE {{where}} GROUP BY 1, 2
"""
# The default extractor's items name their thread in the value (``StoreExtractor.value``).
_STORE = """
SELECT {tenant} AS tenant, value ->> 'thread_id' AS thread_id, count(*) AS n,
       sum(pg_column_size(s.*)) AS bytes
FROM store s WHERE jsonb_typeof(value -> 'thread_id') = 'string' AND {where} GROUP BY 1, 2
"""


def _thread_where(selection: Selection) -> str:
    if selection.thread is not None:
        return "thread_id = %(thread)s"
    if selection.tenant is not None:
        return "starts_with(thread_id, %(prefix)s)"
    return "TRUE"


def _outbox_where(selection: Selection) -> tuple[str, str]:
    """``(tenant expression, condition)`` for the outbox rows of the selection."""
    if not selection.tenant_mode:
        return "''", "thread_id = %(agent)s" if selection.thread is not None else "TRUE"
    conditions = ["namespace[1] = 'tenants'"]
    if selection.thread_tenant() is not None:
        conditions.append("namespace[2] = %(tenant)s")
    if selection.thread is not None:
        conditions.append("thread_id = %(agent)s")
    return "namespace[2]", " AND ".join(conditions)


def _store_where(selection: Selection) -> tuple[str, str]:
    if not selection.tenant_mode:
        return "''", "value ->> 'thread_id' = %(agent)s" if selection.thread is not None else "TRUE"
    conditions = ["starts_with(prefix, 'tenants.')"]
    if selection.thread_tenant() is not None:
        conditions.append("starts_with(prefix, 'tenants.' || %(tenant)s || '.')")
    if selection.thread is not None:
        conditions.append("value ->> 'thread_id' = %(agent)s")
    return "split_part(prefix, '.', 2)", " AND ".join(conditions)


def measure(pool: Any, selection: Selection, *, messages_key: str) -> list[ThreadStorage]:
    """Every thread of ``selection`` with its figures, largest first (one REPEATABLE READ snapshot).

    Args:
        pool: The backend's connection pool.
        selection: Which threads.
        messages_key: The messages channel.
    """
    params = {
        "thread": selection.thread,
        "prefix": selection.thread_prefix,
        "agent": selection.agent_thread(),
        "tenant": selection.thread_tenant(),
        "key": messages_key,
    }
    where = _thread_where(selection)
    threads: dict[str, ThreadStorage] = {}
    with pool.connection() as conn, conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        for row in conn.execute(_CHECKPOINTS.format(where=where), params):
            threads[row["thread_id"]] = ThreadStorage(
                row["thread_id"], checkpoints=row["n"], checkpoint_bytes=int(row["bytes"])
            )
        for row in conn.execute(_BLOBS.format(where=where), params):
            if (thread := threads.get(row["thread_id"])) is not None:
                thread.blob_bytes, thread.messages_bytes = int(row["bytes"]), int(row["messages"])
        for row in conn.execute(_WRITES.format(where=where), params):
            if (thread := threads.get(row["thread_id"])) is not None:
                thread.write_bytes = int(row["bytes"])
        for row in conn.execute(_HEADS.format(where=where), params):
            if (thread := threads.get(row["thread_id"])) is not None:
                thread.heads[row["checkpoint_ns"]] = Head(
                    window_bytes=row["window_bytes"] or 0,
                    window_messages=array_length(row["header"]),
                    checkpoints_had=checkpoints_had(row["step"]),
                )
        for row in conn.execute(_DELTA.format(where=where), params):
            if (thread := threads.get(row["thread_id"])) is not None:
                thread.delta_channels = list(row["channels"])
        outbox = _grouped(conn, _OUTBOX, _outbox_where(selection), params, OUTBOX_TABLE)
        store = _grouped(conn, _STORE, _store_where(selection), params, "store")
    return assemble(threads, outbox, store, selection.tenant_mode)


def _grouped(
    conn: Any, sql: str, parts: tuple[str, str], params: dict[str, Any], table: str
) -> dict[Any, tuple[int, int]]:
    """``(tenant, agent thread id) -> (rows, bytes)``; empty when ``table`` does not exist (yet)."""
    if conn.execute("SELECT to_regclass(%s) AS t", (table,)).fetchone()["t"] is None:
        return {}
    tenant, where = parts
    rows = conn.execute(sql.format(tenant=tenant, where=where), params)
    return {(row["tenant"], row["thread_id"]): (row["n"], int(row["bytes"])) for row in rows}
