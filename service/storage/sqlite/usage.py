"""What threads hold in SQLite: ``length()`` of every column of every row, per thread, in one read
transaction on a connection of its own (the saver keeps serving meanwhile: WAL readers do not block it).

SqliteSaver keeps the whole state in each checkpoint row, so the messages bytes are read from the rows
themselves (decoded by the service's serde, which imports nothing). See
:mod:`reducing_saver.service.storage.usage` for the figures and the plain estimate.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import closing
from typing import Any

from reducing_saver.service.msgpack_headers import array_length
from reducing_saver.service.storage.outbox import TABLE as OUTBOX_TABLE
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.service.storage.sqlite.connections import connect
from reducing_saver.service.storage.usage import (
    Head,
    Selection,
    ThreadStorage,
    assemble,
    checkpoints_had,
    tenant_of_namespace,
)
from reducing_saver.wire import Blob


def _size(*columns: str) -> str:
    """The bytes of ``columns`` (text counted in UTF-8 bytes, not characters)."""
    return " + ".join(f"COALESCE(length(CAST({c} AS BLOB)), 0)" for c in columns)


_CHECKPOINT_ROW = _size(
    "thread_id", "checkpoint_ns", "checkpoint_id", "parent_checkpoint_id", "type", "checkpoint", "metadata"
)
_WRITE_ROW = _size(
    "thread_id",
    "checkpoint_ns",
    "checkpoint_id",
    "task_id",
    "task_path",
    "CAST(idx AS TEXT)",
    "channel",
    "type",
    "value",
)
_OUTBOX_ROW = _size(
    "namespace",
    "key",
    "thread_id",
    "checkpoint_id",
    "message",
    "message_class",
    "status",
    "claimed_by",
    "last_error",
    "fingerprint",
)
_STORE_ROW = _size("prefix", "key", "value")

_CHECKPOINTS = f"""
SELECT thread_id, checkpoint_ns, type, checkpoint, {_CHECKPOINT_ROW} AS bytes,
       json_extract(CAST(metadata AS TEXT), '$.step') AS step
FROM checkpoints WHERE {{where}} ORDER BY thread_id, checkpoint_ns, checkpoint_id
"""
# The channels the thread's checkpoints count steps for since their last snapshot: its DeltaChannels.
_DELTA = """
SELECT DISTINCT thread_id, counted.key AS channel
FROM checkpoints, json_each(CAST(metadata AS TEXT), '$.counters_since_delta_snapshot') AS counted
WHERE json_type(CAST(metadata AS TEXT), '$.counters_since_delta_snapshot') = 'object' AND {where}
ORDER BY thread_id, channel
"""
_WRITES = f"SELECT thread_id, sum({_WRITE_ROW}) AS bytes FROM writes WHERE {{where}} GROUP BY thread_id"
_OUTBOX = f"""
SELECT namespace, thread_id, count(*) AS n, sum({_OUTBOX_ROW}) AS bytes FROM {OUTBOX_TABLE}
WHERE {{where}} GROUP BY namespace, thread_id
"""
# The default extractor's items name their thread in the value (``StoreExtractor.value``).
_STORE = f"""
SELECT prefix, json_extract(value, '$.thread_id') AS thread_id, count(*) AS n, sum({_STORE_ROW}) AS bytes
FROM store WHERE json_valid(value) AND json_type(value, '$.thread_id') = 'text' AND {{where}}
GROUP BY prefix, json_extract(value, '$.thread_id')
"""
_SERDE = VerbatimSerde()


def _thread_where(selection: Selection) -> str:
    if selection.thread is not None:
        return "thread_id = :thread"
    if selection.tenant is not None:
        return "substr(thread_id, 1, length(:prefix)) = :prefix"
    return "1"


def measure(path: str, selection: Selection, *, messages_key: str) -> list[ThreadStorage]:
    """Every thread of ``selection`` with its figures, largest first.

    Args:
        path: The SQLite file.
        selection: Which threads.
        messages_key: The messages channel.
    """
    params = {
        "thread": selection.thread,
        "prefix": selection.thread_prefix,
        "agent": selection.agent_thread(),
    }
    where = _thread_where(selection)
    threads: dict[str, ThreadStorage] = {}
    with closing(connect(path, create=False)) as conn:
        conn.row_factory = _dict_row
        conn.execute("BEGIN")  # one snapshot for every read below
        try:
            for row in conn.execute(_CHECKPOINTS.format(where=where), params):
                thread = threads.get(row["thread_id"])
                if thread is None:
                    thread = threads[row["thread_id"]] = ThreadStorage(row["thread_id"])
                thread.checkpoints += 1
                thread.checkpoint_bytes += row["bytes"]
                # Rows come oldest first per namespace: the last one read is the head.
                thread.heads[row["checkpoint_ns"]] = head = _head(row, messages_key)
                thread.messages_bytes += head.window_bytes
            for row in conn.execute(_WRITES.format(where=where), params):
                if (thread := threads.get(row["thread_id"])) is not None:
                    thread.write_bytes = row["bytes"]
            for row in conn.execute(_DELTA.format(where=where), params):
                if (thread := threads.get(row["thread_id"])) is not None:
                    thread.delta_channels.append(row["channel"])
            agent = "thread_id = :agent" if selection.thread is not None else "1"
            outbox = _grouped(conn, _OUTBOX, agent, params, OUTBOX_TABLE, selection, _outbox_tenant)
            agent = "json_extract(value, '$.thread_id') = :agent" if selection.thread is not None else "1"
            store = _grouped(conn, _STORE, agent, params, "store", selection, _store_tenant)
        finally:
            conn.execute("COMMIT")
    return assemble(threads, outbox, store, selection.tenant_mode)


def _head(row: dict[str, Any], messages_key: str) -> Head:
    """The messages of one checkpoint row, as :class:`Head` (copies: every checkpoint so far, step + 2)."""
    checkpoint = _SERDE.loads_typed((row["type"], row["checkpoint"]))
    value = (checkpoint.get("channel_values") or {}).get(messages_key)
    had = checkpoints_had(row["step"])
    head = Head(copies=had if had is not None else 1, checkpoints_had=had)
    if isinstance(value, Blob):
        head.window_bytes, head.window_messages = len(value.data), array_length(value.data)
    return head


def _outbox_tenant(row: dict[str, Any], tenant_mode: bool) -> str | None:
    return tenant_of_namespace(json.loads(row["namespace"]), tenant_mode)


def _store_tenant(row: dict[str, Any], tenant_mode: bool) -> str | None:
    return tenant_of_namespace(row["prefix"].split("."), tenant_mode)


def _grouped(
    conn: Any, sql: str, where: str, params: dict[str, Any], table: str, selection: Selection, tenant_of: Any
) -> dict[tuple[str | None, str], tuple[int, int]]:
    """``(tenant, agent thread id) -> (rows, bytes)`` of the selection's tenant; empty without ``table``."""
    exists = conn.execute(
        "SELECT 1 AS found FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
    ).fetchone()
    if exists is None:
        return {}
    wanted = selection.thread_tenant()
    figures: dict[tuple[str | None, str], list[int]] = defaultdict(lambda: [0, 0])
    for row in conn.execute(sql.format(where=where), params):
        tenant = tenant_of(row, selection.tenant_mode)
        if tenant is None or (wanted is not None and tenant != wanted):
            continue
        figure = figures[(tenant, row["thread_id"])]
        figure[0] += row["n"]
        figure[1] += row["bytes"]
    return {key: (n, size) for key, (n, size) in figures.items()}


def _dict_row(cursor: Any, row: tuple[Any, ...]) -> dict[str, Any]:
    return {column[0]: value for column, value in zip(cursor.description, row, strict=True)}
