"""``reducing-saver encrypt-sweep``: rewrite plain rows, and rows under a key other than the primary,
as envelopes under the primary key (PostgreSQL).

Every row is rewritten by compare-and-set: the ``UPDATE`` names the row's old content, so a row that a
put, a write or another replica's sweep changed meanwhile is left as that writer made it (the next pass
looks at it again). A sweep killed at any point leaves each row either as it was or rewritten, never
half: each row is one statement (an inline channel value, which moves from the checkpoint row into a
blob row, one transaction). Repeat until :attr:`SweepReport.remaining` is zero.

What it covers: checkpoint blobs and the values a stock PostgresSaver inlines in the checkpoint row,
pending writes, checkpoint metadata (all keys but ``PLAIN_METADATA_KEYS``), outbox messages, and store
values. The report counts the rows per key id after the sweep (``"plain"`` for plain rows).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from psycopg.types.json import Jsonb

from reducing_saver.service.encryption.envelope import StoredDataError
from reducing_saver.service.encryption.records import open_record, record_key_id, seal_record
from reducing_saver.service.encryption.saver import (
    ENVELOPE_TYPE,
    PLAIN_METADATA_KEYS,
    Sealer,
    is_sealed,
    sealed_key_id,
)
from reducing_saver.wire import Blob

PLAIN = "plain"
_PAGE = 500


@dataclass
class SweepReport:
    """What one sweep did: rows rewritten per table, rows per key id afterwards, rows it could not read."""

    rewritten: Counter = field(default_factory=Counter)
    by_key: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    #: Rows left plain or under another key (changed concurrently, or unreadable).
    remaining: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rewritten": dict(self.rewritten),
            "rows_by_key_id": dict(self.by_key),
            "remaining": self.remaining,
            "errors": self.errors[:20],
        }


def _pages(conn: Any, sql: str, order: str) -> Iterator[dict[str, Any]]:
    """Every row of ``sql`` in pages (keyset on the ``order`` columns), so no long transaction is held."""
    last: tuple | None = None
    columns = [c.strip() for c in order.split(",")]
    while True:
        where = "" if last is None else f"WHERE ({order}) > ({', '.join(['%s'] * len(columns))})"
        rows = conn.execute(f"SELECT * FROM ({sql}) s {where} ORDER BY {order} LIMIT {_PAGE}", last or ()).fetchall()
        yield from rows
        if len(rows) < _PAGE:
            return
        last = tuple(rows[-1][c] for c in columns)


class PostgresEncryptSweep:
    """One pass over a PostgreSQL database's tables (see the module docstring).

    Args:
        pool: The backend's connection pool (``dict_row`` connections).
        sealer: Seals under the ring's primary key; opens under any key of the ring.
    """

    def __init__(self, pool: Any, sealer: Sealer) -> None:
        self.pool = pool
        self.sealer = sealer
        self.primary = sealer.cipher.ring.primary

    def run(self) -> SweepReport:
        report = SweepReport()
        with self.pool.connection() as conn:
            conn.autocommit = True
            for step in (self._blobs, self._inline_values, self._writes, self._metadata, self._outbox, self._store):
                step(conn, report)
        return report

    def _count(self, report: SweepReport, key_id: str | None, done: bool) -> None:
        report.by_key[key_id or PLAIN] += 1
        if not done and key_id != self.primary:
            report.remaining += 1

    def _attempt(self, report: SweepReport, table: str, fn: Any) -> tuple[bool, str | None]:
        """Run one rewrite; ``(rewritten, key id now)``. A row that cannot be read is reported, not fatal."""
        try:
            return fn()
        except StoredDataError as exc:
            report.errors.append(f"{table}: {exc}")
            return False, None

    # checkpoint_blobs -----------------------------------------------------------------------------
    def _blobs(self, conn: Any, report: SweepReport) -> None:
        sql = "SELECT thread_id, checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs WHERE type <> 'empty'"
        for row in _pages(conn, sql, "thread_id, checkpoint_ns, channel, version"):
            value = Blob(row["type"], bytes(row["blob"]))
            key_id = sealed_key_id(value)
            if key_id == self.primary:
                self._count(report, key_id, True)
                continue

            def rewrite(row: dict = row, value: Blob = value) -> tuple[bool, str | None]:
                place = (row["thread_id"], row["checkpoint_ns"], row["channel"], row["version"])
                if is_sealed(value):
                    value = self.sealer.open_value(value, *place)  # a sealed value: opened under its key
                sealed = self.sealer.seal_value(value, *place)
                updated = conn.execute(
                    "UPDATE checkpoint_blobs SET type = %s, blob = %s WHERE thread_id = %s AND checkpoint_ns = %s "
                    "AND channel = %s AND version = %s AND type = %s AND blob = %s",
                    (sealed.type, sealed.data, *place, row["type"], row["blob"]),
                )
                return updated.rowcount == 1, self.primary

            done, now = self._attempt(report, "checkpoint_blobs", rewrite)
            report.rewritten["checkpoint_blobs"] += done
            self._count(report, now if done else key_id, done)

    # inline channel values in checkpoints ----------------------------------------------------------
    def _inline_values(self, conn: Any, report: SweepReport) -> None:
        sql = (
            "SELECT thread_id, checkpoint_ns, checkpoint_id, checkpoint FROM checkpoints "
            "WHERE checkpoint->'channel_values' IS NOT NULL AND checkpoint->'channel_values' <> '{}'::jsonb"
        )
        for row in _pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id"):
            versions = row["checkpoint"].get("channel_versions") or {}
            for channel, value in (row["checkpoint"].get("channel_values") or {}).items():
                place = (row["thread_id"], row["checkpoint_ns"])
                sealed = self.sealer.seal_value(value, *place, channel, versions.get(channel))
                with conn.transaction():
                    # A blob already stored at that version wins over the inline value when read: keep it.
                    conn.execute(
                        "INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob) "
                        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                        (*place, channel, str(versions.get(channel)), sealed.type, sealed.data),
                    )
                    updated = conn.execute(
                        "UPDATE checkpoints SET checkpoint = checkpoint #- ARRAY['channel_values', %s] "
                        "WHERE thread_id = %s AND checkpoint_ns = %s AND checkpoint_id = %s "
                        "AND checkpoint->'channel_values'->%s = %s",
                        (channel, *place, row["checkpoint_id"], channel, Jsonb(value)),
                    )
                done = updated.rowcount == 1
                report.rewritten["checkpoints.channel_values"] += done
                self._count(report, self.primary if done else None, done)

    # checkpoint_writes ----------------------------------------------------------------------------
    def _writes(self, conn: Any, report: SweepReport) -> None:
        sql = (
            "SELECT thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, blob "
            "FROM checkpoint_writes"
        )
        for row in _pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id, task_id, idx"):
            value = Blob(row["type"], bytes(row["blob"])) if row["blob"] is not None else None
            key_id = sealed_key_id(value, write=True)
            if key_id == self.primary or value is None:
                self._count(report, key_id, True)
                continue

            def rewrite(row: dict = row, value: Blob = value) -> tuple[bool, str | None]:
                ids = (row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"], row["task_id"])
                if is_sealed(value):
                    _, value = self.sealer.open_write(value, *ids, row["channel"])
                sealed = self.sealer.seal_write(value, *ids, row["idx"], row["channel"])
                updated = conn.execute(
                    "UPDATE checkpoint_writes SET type = %s, blob = %s WHERE thread_id = %s AND checkpoint_ns = %s "
                    "AND checkpoint_id = %s AND task_id = %s AND idx = %s AND type = %s AND blob = %s",
                    (sealed.type, sealed.data, *ids, row["idx"], row["type"], row["blob"]),
                )
                return updated.rowcount == 1, self.primary

            done, now = self._attempt(report, "checkpoint_writes", rewrite)
            report.rewritten["checkpoint_writes"] += done
            self._count(report, now if done else key_id, done)

    # checkpoint metadata --------------------------------------------------------------------------
    def _metadata(self, conn: Any, report: SweepReport) -> None:
        sql = "SELECT thread_id, checkpoint_ns, checkpoint_id, metadata FROM checkpoints"
        for row in _pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id"):
            metadata = row["metadata"] or {}
            stale = [
                k for k, v in metadata.items()
                if k not in PLAIN_METADATA_KEYS and sealed_key_id(v) != self.primary
            ]
            if not stale:
                self._count(report, self.primary, True)
                continue
            ids = (row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"])

            def rewrite(metadata: dict = metadata, ids: tuple = ids) -> tuple[bool, str | None]:
                opened = self.sealer.open_metadata(dict(metadata), *ids)
                sealed = self.sealer.seal_metadata(opened, *ids)
                updated = conn.execute(
                    "UPDATE checkpoints SET metadata = %s WHERE thread_id = %s AND checkpoint_ns = %s "
                    "AND checkpoint_id = %s AND metadata = %s",
                    (Jsonb(sealed), *ids, Jsonb(metadata)),
                )
                return updated.rowcount == 1, self.primary

            done, now = self._attempt(report, "checkpoints.metadata", rewrite)
            report.rewritten["checkpoints.metadata"] += done
            self._count(report, now if done else sealed_key_id(metadata[stale[0]]), done)

    # outbox and store -----------------------------------------------------------------------------
    def _records(self, conn: Any, report: SweepReport, table: str, kind: str, sql: str, order: str, update: str) -> None:
        for row in _pages(conn, sql, order):
            value = json.loads(row["text"])
            key_id = record_key_id(value)
            if key_id == self.primary:
                self._count(report, key_id, True)
                continue
            namespace = row["namespace"] if isinstance(row["namespace"], list) else row["namespace"].split(".")

            def rewrite(
                row: dict = row, value: Any = value, namespace: list = namespace, sealed: bool = key_id is not None
            ) -> tuple[bool, str | None]:
                opened = open_record(self.sealer, kind, value, namespace, row["key"]) if sealed else value
                sealed = seal_record(self.sealer, kind, opened, namespace, row["key"])
                updated = conn.execute(update, (json.dumps(sealed), row["namespace"], row["key"], row["text"]))
                return updated.rowcount == 1, self.primary

            done, now = self._attempt(report, table, rewrite)
            report.rewritten[table] += done
            self._count(report, now if done else key_id, done)

    def _outbox(self, conn: Any, report: SweepReport) -> None:
        self._records(
            conn, report, "reducing_saver_outbox", "outbox",
            "SELECT namespace, key, message::text AS text FROM reducing_saver_outbox",
            "namespace, key",
            "UPDATE reducing_saver_outbox SET message = %s::json WHERE namespace = %s AND key = %s "
            "AND message::text = %s",
        )

    def _store(self, conn: Any, report: SweepReport) -> None:
        self._records(
            conn, report, "store", "store",
            "SELECT prefix AS namespace, key, value::text AS text FROM store",
            "namespace, key",
            "UPDATE store SET value = %s::jsonb WHERE prefix = %s AND key = %s AND value::text = %s",
        )


class SweepStep:
    """The encryption sweep as a step of the TTL sweeper (``--encryption migrate`` on PostgreSQL): one pass
    per TTL sweep, its rows per key id exported as ``reducing_saver_encrypted_rows{key_id=...}``."""

    def __init__(self, sweep: PostgresEncryptSweep, registry: Any = None) -> None:
        self.sweep = sweep
        self.gauge = None
        if registry is not None:
            from prometheus_client import Gauge

            self.gauge = Gauge(
                "reducing_saver_encrypted_rows",
                "Rows of conversation content per encryption key id (key_id=\"plain\": not encrypted yet), as "
                "the last encryption sweep counted them.",
                ["key_id"],
                registry=registry,
            )

    def __call__(self) -> SweepReport:
        report = self.sweep.run()
        if self.gauge is not None:
            self.gauge.clear()
            for key_id, rows in report.by_key.items():
                self.gauge.labels(key_id=key_id).set(rows)
        return report
