"""``reducing-saver encrypt-sweep``: rewrite plain rows, and rows under a key other than the primary,
as envelopes under the primary key (PostgreSQL and SQLite).

Every row is rewritten by compare-and-set: the ``UPDATE`` names the row's old content, so a row that a
put, a write or another replica's sweep changed meanwhile is left as that writer made it (the next pass
looks at it again). A sweep killed at any point leaves each row either as it was or rewritten, never
half: each row is one statement (on PostgreSQL, an inline channel value, which moves from the checkpoint
row into a blob row, one transaction). Repeat until :attr:`SweepReport.remaining` is zero.

What it covers: channel values (PostgreSQL: checkpoint blobs and the values a stock PostgresSaver inlines
in the checkpoint row; SQLite: the values inside each checkpoint row), pending writes, checkpoint
metadata (all keys but ``PLAIN_METADATA_KEYS``), outbox messages, store values, and the running
summaries' texts and batches. The report counts the rows per key id after the sweep (``"plain"`` for
plain rows).

:class:`EncryptSweep` holds all of it but the SQL dialect and the channel values;
:class:`PostgresEncryptSweep` and :class:`SqliteEncryptSweep` give those.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

from psycopg.types.json import Jsonb

from reducing_saver.service.encryption.records import open_record, record_key_id, seal_record
from reducing_saver.service.encryption.saver import PLAIN_METADATA_KEYS, Sealer, sealed_key_id
from reducing_saver.service.encryption.summaries import (
    batch_key_id,
    open_batch,
    open_text,
    seal_batch,
    seal_text,
    text_key_id,
)
from reducing_saver.service.storage import StoredDataError
from reducing_saver.service.storage.serde import VerbatimSerde
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


class EncryptSweep:
    """One pass over a database's tables (see the module docstring): the backend-independent part.

    A subclass gives :meth:`_connect`, :meth:`_fetch`, :meth:`_update`, its tables' SQL and
    :meth:`_channel_values`.

    Args:
        sealer: Seals under the ring's primary key; opens under any key of the ring (mode ``migrate``:
            plain rows are read as they are).
    """

    #: The driver's parameter marker.
    placeholder = "?"
    #: Equality that holds for two NULLs.
    same = "IS"
    #: ``(table, value column)`` of pending writes.
    writes_table = ("writes", "value")
    #: How a select reads an outbox message and a store value as text.
    outbox_text = "message"
    store_text = "value"
    #: How an update stores JSON text and compares the stored one.
    outbox_set, outbox_old = "?", "message"
    store_set, store_old = "?", "value"

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer
        self.primary = sealer.cipher.ring.primary

    def run(self) -> SweepReport:
        report = SweepReport()
        with self._connect() as conn:
            for step in (
                self._channel_values,
                self._writes,
                self._metadata,
                self._outbox,
                self._store,
                self._summaries,
            ):
                step(conn, report)
        return report

    # -- the dialect -------------------------------------------------------------------------------

    def _connect(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _fetch(self, conn: Any, sql: str, params: tuple) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _update(self, conn: Any, sql: str, params: tuple) -> bool:
        """Run one compare-and-set statement; whether it changed the row."""
        raise NotImplementedError

    def _sql(self, text: str) -> str:
        return text if self.placeholder == "?" else text.replace("?", self.placeholder)

    def _channel_values(self, conn: Any, report: SweepReport) -> None:
        raise NotImplementedError

    def _metadata_of(self, stored: Any) -> dict[str, Any]:
        """A checkpoint's stored metadata as a dict."""
        raise NotImplementedError

    def _metadata_param(self, metadata: dict[str, Any]) -> Any:
        """Metadata as the update's parameter."""
        raise NotImplementedError

    def _stored_param(self, stored: Any) -> Any:
        """A stored metadata value as the compare-and-set parameter naming it."""
        return stored

    # -- the loop every table shares ---------------------------------------------------------------

    def _pages(self, conn: Any, sql: str, order: str) -> Iterator[dict[str, Any]]:
        """Every row of ``sql`` in pages (keyset on the ``order`` columns), so no long transaction is held."""
        last: tuple | None = None
        columns = [c.strip() for c in order.split(",")]
        while True:
            where = "" if last is None else f"WHERE ({order}) > ({', '.join(['?'] * len(columns))})"
            rows = self._fetch(
                conn, self._sql(f"SELECT * FROM ({sql}) s {where} ORDER BY {order} LIMIT {_PAGE}"), last or ()
            )
            yield from rows
            if len(rows) < _PAGE:
                return
            last = tuple(rows[-1][c] for c in columns)

    def _sweep(
        self,
        report: SweepReport,
        table: str,
        rows: Iterable[Any],
        key_id: Callable[[Any], str | None],
        rewrite: Callable[[Any], bool],
    ) -> None:
        """Each row whose key id (``key_id(row)``) is not the primary's rewritten (``rewrite(row)``: whether
        the compare-and-set changed it); counted per key id. A row that cannot be read is reported."""
        for row in rows:
            current = None
            try:
                current = key_id(row)
                if current == self.primary:
                    self._count(report, current, True)
                    continue
                done = rewrite(row)
            except StoredDataError as exc:
                report.errors.append(f"{table}: {exc}")
                done = False
            report.rewritten[table] += done
            self._count(report, self.primary if done else current, done)

    def _count(self, report: SweepReport, key_id: str | None, done: bool) -> None:
        report.by_key[key_id or PLAIN] += 1
        if not done and key_id != self.primary:
            report.remaining += 1

    # -- pending writes ----------------------------------------------------------------------------

    def _writes(self, conn: Any, report: SweepReport) -> None:
        table, column = self.writes_table
        sql = (
            f"SELECT thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel, type, {column} AS blob "
            f"FROM {table} WHERE {column} IS NOT NULL"
        )
        update = self._sql(
            f"UPDATE {table} SET type = ?, {column} = ? WHERE thread_id = ? AND checkpoint_ns = ? "
            f"AND checkpoint_id = ? AND task_id = ? AND idx = ? AND type = ? AND {column} = ?"
        )

        def rewrite(row: dict) -> bool:
            ids = (row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"], row["task_id"])
            _, value = self.sealer.open_write(_blob(row), *ids, row["channel"])
            sealed = self.sealer.seal_write(value, *ids, row["idx"], row["channel"])
            return self._update(
                conn, update, (sealed.type, sealed.data, *ids, row["idx"], row["type"], row["blob"])
            )

        rows = self._pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id, task_id, idx")
        self._sweep(report, table, rows, lambda row: sealed_key_id(_blob(row), write=True), rewrite)

    # -- checkpoint metadata -----------------------------------------------------------------------

    def _metadata(self, conn: Any, report: SweepReport) -> None:
        sql = "SELECT thread_id, checkpoint_ns, checkpoint_id, metadata FROM checkpoints"
        update = self._sql(
            "UPDATE checkpoints SET metadata = ? WHERE thread_id = ? AND checkpoint_ns = ? "
            "AND checkpoint_id = ? AND metadata = ?"
        )

        def key_id(row: dict) -> str | None:
            metadata = self._metadata_of(row["metadata"])
            stale = [
                v
                for k, v in metadata.items()
                if k not in PLAIN_METADATA_KEYS and sealed_key_id(v) != self.primary
            ]
            return sealed_key_id(stale[0]) if stale else self.primary

        def rewrite(row: dict) -> bool:
            ids = (row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"])
            opened = self.sealer.open_metadata(self._metadata_of(row["metadata"]), *ids)
            sealed = self.sealer.seal_metadata(opened, *ids)
            return self._update(
                conn, update, (self._metadata_param(sealed), *ids, self._stored_param(row["metadata"]))
            )

        rows = self._pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id")
        self._sweep(report, "checkpoints.metadata", rows, key_id, rewrite)

    # -- outbox and store --------------------------------------------------------------------------

    def _records(self, conn: Any, report: SweepReport, table: str, kind: str, sql: str, update: str) -> None:
        def rewrite(row: dict) -> bool:
            namespace = _namespace(row["namespace"])
            opened = open_record(self.sealer, kind, json.loads(row["text"]), namespace, row["key"])
            sealed = seal_record(self.sealer, kind, opened, namespace, row["key"])
            return self._update(
                conn, self._sql(update), (json.dumps(sealed), row["namespace"], row["key"], row["text"])
            )

        rows = self._pages(conn, sql, "namespace, key")
        self._sweep(report, table, rows, lambda row: record_key_id(json.loads(row["text"])), rewrite)

    def _outbox(self, conn: Any, report: SweepReport) -> None:
        self._records(
            conn,
            report,
            "reducing_saver_outbox",
            "outbox",
            f"SELECT namespace, key, {self.outbox_text} AS text FROM reducing_saver_outbox",
            f"UPDATE reducing_saver_outbox SET message = {self.outbox_set} WHERE namespace = ? AND key = ? "
            f"AND {self.outbox_old} = ?",
        )

    def _store(self, conn: Any, report: SweepReport) -> None:
        self._records(
            conn,
            report,
            "store",
            "store",
            f"SELECT prefix AS namespace, key, {self.store_text} AS text FROM store",
            f"UPDATE store SET value = {self.store_set} WHERE prefix = ? AND key = ? AND {self.store_old} = ?",
        )

    # -- running summaries -------------------------------------------------------------------------

    def _summaries(self, conn: Any, report: SweepReport) -> None:
        sql = "SELECT thread_id, checkpoint_ns, step_id, batch, text FROM reducing_saver_summaries"
        update = self._sql(
            "UPDATE reducing_saver_summaries SET batch = ?, text = ? WHERE thread_id = ? AND checkpoint_ns = ? "
            f"AND step_id = ? AND batch = ? AND text {self.same} ?"
        )

        def key_id(row: dict) -> str | None:
            batch = batch_key_id(row["batch"])
            if batch != self.primary or row["text"] is None:
                return batch
            return text_key_id(row["text"])

        def rewrite(row: dict) -> bool:
            place = (row["thread_id"], row["checkpoint_ns"], row["step_id"])
            batch = seal_batch(self.sealer, open_batch(self.sealer, row["batch"], *place), *place)
            text = open_text(self.sealer, row["text"], *place)
            text = None if text is None else seal_text(self.sealer, text, *place)
            return self._update(conn, update, (batch, text, *place, row["batch"], row["text"]))

        rows = self._pages(conn, sql, "thread_id, checkpoint_ns, step_id")
        self._sweep(report, "reducing_saver_summaries", rows, key_id, rewrite)


def _blob(row: dict[str, Any]) -> Blob:
    return Blob(row["type"], bytes(row["blob"]))


def _namespace(stored: Any) -> list[str]:
    return stored if isinstance(stored, list) else stored.split(".")


class PostgresEncryptSweep(EncryptSweep):
    """The sweep on PostgreSQL (see :class:`EncryptSweep`).

    Args:
        pool: The backend's connection pool (``dict_row`` connections).
        sealer: As :class:`EncryptSweep`'s.
    """

    placeholder = "%s"
    same = "IS NOT DISTINCT FROM"
    writes_table = ("checkpoint_writes", "blob")
    outbox_text, outbox_set, outbox_old = "message::text", "?::json", "message::text"
    store_text, store_set, store_old = "value::text", "?::jsonb", "value::text"

    def __init__(self, pool: Any, sealer: Sealer) -> None:
        super().__init__(sealer)
        self.pool = pool

    @contextmanager
    def _connect(self) -> Iterator[Any]:
        with self.pool.connection() as conn:
            conn.autocommit = True
            yield conn

    def _fetch(self, conn: Any, sql: str, params: tuple) -> list[dict[str, Any]]:
        return conn.execute(sql, params).fetchall()

    def _update(self, conn: Any, sql: str, params: tuple) -> bool:
        return conn.execute(sql, params).rowcount == 1

    def _metadata_of(self, stored: Any) -> dict[str, Any]:
        return dict(stored or {})

    def _metadata_param(self, metadata: dict[str, Any]) -> Any:
        return Jsonb(metadata)

    def _stored_param(self, stored: Any) -> Any:
        return Jsonb(stored)

    def _channel_values(self, conn: Any, report: SweepReport) -> None:
        self._blobs(conn, report)
        self._inline_values(conn, report)

    # checkpoint_blobs -----------------------------------------------------------------------------
    def _blobs(self, conn: Any, report: SweepReport) -> None:
        sql = "SELECT thread_id, checkpoint_ns, channel, version, type, blob FROM checkpoint_blobs WHERE type <> 'empty'"

        def rewrite(row: dict) -> bool:
            place = (row["thread_id"], row["checkpoint_ns"], row["channel"], row["version"])
            sealed = self.sealer.seal_value(self.sealer.open_value(_blob(row), *place), *place)
            return self._update(
                conn,
                "UPDATE checkpoint_blobs SET type = %s, blob = %s WHERE thread_id = %s AND checkpoint_ns = %s "
                "AND channel = %s AND version = %s AND type = %s AND blob = %s",
                (sealed.type, sealed.data, *place, row["type"], row["blob"]),
            )

        rows = self._pages(conn, sql, "thread_id, checkpoint_ns, channel, version")
        self._sweep(report, "checkpoint_blobs", rows, lambda row: sealed_key_id(_blob(row)), rewrite)

    # inline channel values in checkpoints ----------------------------------------------------------
    def _inline_values(self, conn: Any, report: SweepReport) -> None:
        sql = (
            "SELECT thread_id, checkpoint_ns, checkpoint_id, checkpoint FROM checkpoints "
            "WHERE checkpoint->'channel_values' IS NOT NULL AND checkpoint->'channel_values' <> '{}'::jsonb"
        )
        for row in self._pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id"):
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


class SqliteEncryptSweep(EncryptSweep):
    """The sweep on SQLite (see :class:`EncryptSweep`). SqliteSaver keeps a checkpoint's channel values
    inside its row: a checkpoint row is rewritten whole (its values sealed), compared on its old bytes.

    Args:
        path: The SQLite file.
        sealer: As :class:`EncryptSweep`'s.
    """

    def __init__(self, path: str, sealer: Sealer) -> None:
        super().__init__(sealer)
        self.path = str(path)
        self.serde = VerbatimSerde()

    @contextmanager
    def _connect(self) -> Iterator[Any]:
        from reducing_saver.service.storage.sqlite.connections import connect

        with closing(connect(self.path, create=False)) as conn:
            conn.row_factory = sqlite3.Row
            yield conn

    def _fetch(self, conn: Any, sql: str, params: tuple) -> list[dict[str, Any]]:
        return [dict(row) for row in conn.execute(sql, params).fetchall()]

    def _update(self, conn: Any, sql: str, params: tuple) -> bool:
        return conn.execute(sql, params).rowcount == 1

    def _metadata_of(self, stored: Any) -> dict[str, Any]:
        return json.loads(stored) if stored is not None else {}

    def _metadata_param(self, metadata: dict[str, Any]) -> Any:
        return json.dumps(metadata, ensure_ascii=False).encode()  # as SqliteSaver writes it

    def _channel_values(self, conn: Any, report: SweepReport) -> None:
        sql = "SELECT thread_id, checkpoint_ns, checkpoint_id, type, checkpoint FROM checkpoints"
        update = (
            "UPDATE checkpoints SET type = ?, checkpoint = ? WHERE thread_id = ? AND checkpoint_ns = ? "
            "AND checkpoint_id = ? AND type = ? AND checkpoint = ?"
        )

        def key_id(row: dict) -> str | None:
            values = (self._checkpoint_of(row).get("channel_values") or {}).values()
            stale = [v for v in values if sealed_key_id(v) != self.primary]
            return sealed_key_id(stale[0]) if stale else self.primary

        def rewrite(row: dict) -> bool:
            checkpoint = self._checkpoint_of(row)
            place = (row["thread_id"], row["checkpoint_ns"])
            versions = checkpoint.get("channel_versions") or {}
            values = {}
            for channel, value in (checkpoint.get("channel_values") or {}).items():
                version = versions.get(channel)
                values[channel] = self.sealer.seal_value(
                    self.sealer.open_value(value, *place, channel, version), *place, channel, version
                )
            type_, data = self.serde.dumps_typed({**checkpoint, "channel_values": values})
            ids = (*place, row["checkpoint_id"])
            return self._update(conn, update, (type_, data, *ids, row["type"], row["checkpoint"]))

        rows = self._pages(conn, sql, "thread_id, checkpoint_ns, checkpoint_id")
        self._sweep(report, "checkpoints.channel_values", rows, key_id, rewrite)

    def _checkpoint_of(self, row: dict[str, Any]) -> dict[str, Any]:
        checkpoint = self.serde.loads_typed((row["type"], bytes(row["checkpoint"])))
        if not isinstance(checkpoint, dict):
            raise StoredDataError(
                f"thread {row['thread_id']!r} checkpoint {row['checkpoint_id']!r}: stored as "
                f"{row['type']!r}, which this service did not write"
            )
        return checkpoint


def encrypt_sweep_of(backend: Any, sealer: Sealer) -> EncryptSweep:
    """The sweep of an open PostgreSQL or SQLite backend.

    Raises:
        ValueError: For any other backend (``memory://`` keeps nothing beyond its process).
    """
    if backend.kind == "postgres":
        return PostgresEncryptSweep(backend.pool, sealer)
    if backend.kind == "sqlite":
        return SqliteEncryptSweep(backend.path, sealer)
    raise ValueError(f"the encryption sweep rewrites PostgreSQL and SQLite databases, not {backend.kind}")


class SweepStep:
    """The encryption sweep as a step of the TTL sweeper (``--encryption migrate``): one pass
    per TTL sweep, its rows per key id exported as ``reducing_saver_encrypted_rows{key_id=...}``."""

    def __init__(self, sweep: EncryptSweep, registry: Any = None) -> None:
        self.sweep = sweep
        self.gauge = None
        if registry is not None:
            from prometheus_client import Gauge

            self.gauge = Gauge(
                "reducing_saver_encrypted_rows",
                'Rows of conversation content per encryption key id (key_id="plain": not encrypted yet), as '
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
