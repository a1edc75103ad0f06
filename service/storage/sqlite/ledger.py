"""The TTL ledger and sweep log as tables of the service's SQLite file, used through the saver's own
connection and lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson

from reducing_saver.reducer import thread_namespace
from reducing_saver.service.storage.ledger import (
    LOG_TABLE,
    TABLE,
    Outcome,
    Policy,
    Recorder,
    Window,
    database_figures,
    from_epoch,
    iso_time,
    namespace_json,
    row_namespace,
    uuid6_time,
)
from reducing_saver.service.storage.lifecycle import PRUNED_TABLE
from reducing_saver.service.storage.sqlite import migrations
from reducing_saver.service.storage.summaries import TABLE as SUMMARIES_TABLE

logger = logging.getLogger(__name__)

_SQ_TOUCH = f"""
INSERT INTO {TABLE} (thread_id, last_write_at, ttl_seconds, expires_at, namespace, swept_at)
VALUES (:thread, :now, :ttl, :now + :ttl, :namespace, NULL)
ON CONFLICT (thread_id) DO UPDATE SET
    last_write_at = excluded.last_write_at,
    ttl_seconds = COALESCE(excluded.ttl_seconds, ttl_seconds),
    expires_at = excluded.last_write_at + COALESCE(excluded.ttl_seconds, ttl_seconds),
    namespace = COALESCE(excluded.namespace, namespace),
    swept_at = NULL
"""

_SQ_EXPIRED = "(expires_at < :now OR (ttl_seconds IS NULL AND :default IS NOT NULL AND last_write_at < :now - :default))"

_SQ_THREAD_BYTES = """
SELECT (SELECT COALESCE(SUM(LENGTH(checkpoint) + COALESCE(LENGTH(metadata), 0)), 0)
        FROM checkpoints WHERE thread_id = :thread)
     + (SELECT COALESCE(SUM(COALESCE(LENGTH(value), 0)), 0) FROM writes WHERE thread_id = :thread)
"""

_SQ_HEAD_BYTES = """
WITH heads AS (
    SELECT checkpoint_ns, MAX(checkpoint_id) AS checkpoint_id FROM checkpoints
    WHERE thread_id = :thread GROUP BY checkpoint_ns
)
SELECT (SELECT COALESCE(SUM(LENGTH(c.checkpoint) + COALESCE(LENGTH(c.metadata), 0)), 0) FROM checkpoints c
        JOIN heads h ON c.checkpoint_ns = h.checkpoint_ns AND c.checkpoint_id = h.checkpoint_id
        WHERE c.thread_id = :thread)
     + (SELECT COALESCE(SUM(COALESCE(LENGTH(w.value), 0)), 0) FROM writes w
        JOIN heads h ON w.checkpoint_ns = h.checkpoint_ns AND w.checkpoint_id = h.checkpoint_id
        WHERE w.thread_id = :thread)
"""


class SqliteLedger:
    """The ledger as a table in the service's SQLite file, used through the saver's own connection and
    lock, so a sweep's check and change are one ``BEGIN IMMEDIATE`` transaction with the checkpoints.

    Args:
        saver: The backend's ``SqliteLifecycleSaver`` (or one of the ``sweep`` command's own).
        window: Reads the messages in a thread's head, as outbox entries.
        recorder: The outbox a ``delete`` records windows in.
        worker_id: Written in the sweep log.
    """

    kind = "sqlite"
    #: The memory namespace of a thread whose puts named none (tenant mode: open_sweeper's).
    fallback_namespace = staticmethod(thread_namespace)

    def __init__(self, saver: Any, *, window: Window, recorder: Recorder | None, worker_id: str) -> None:
        self.saver = saver
        self.window = window
        self.recorder = recorder
        self.worker_id = worker_id

    def setup(self) -> None:
        """Bring the service's tables up to date (``migrations.apply``, under the file's write lock)."""
        with self.saver._transaction() as cur:
            migrations.apply(cur)

    def close(self) -> None:
        """The connection is the saver's: nothing to close."""

    @contextmanager
    def _read(self) -> Iterator[Any]:
        with self.saver.lock:
            yield self.saver.conn

    def touch(self, thread_id: str, ttl: float | None, namespace: tuple[str, ...] | None) -> None:
        with self._read() as conn:
            conn.execute(
                _SQ_TOUCH,
                {"thread": thread_id, "now": time.time(), "ttl": ttl, "namespace": namespace_json(namespace)},
            )

    def copy(self, source: str, target: str) -> None:
        with self._read() as conn:
            found = conn.execute(f"SELECT ttl_seconds FROM {TABLE} WHERE thread_id = ?", (source,)).fetchone()
            conn.execute(
                _SQ_TOUCH,
                {"thread": target, "now": time.time(), "ttl": found[0] if found else None, "namespace": None},
            )

    def discover(self, session: Any = None) -> int:
        with self._read() as conn:
            heads = conn.execute(
                f"SELECT c.thread_id, MAX(c.checkpoint_id) FROM checkpoints c "
                f"WHERE NOT EXISTS (SELECT 1 FROM {TABLE} t WHERE t.thread_id = c.thread_id) "
                "GROUP BY c.thread_id"
            ).fetchall()
        rows = []
        for thread_id, head in heads:
            when = uuid6_time(head)
            if when is None:
                found = self.saver.get_tuple(
                    {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": head}}
                )
                when = iso_time(found.checkpoint.get("ts") if found else None)
            rows.append((thread_id, when or time.time()))
        if rows:
            with self._read() as conn:
                conn.executemany(
                    f"INSERT INTO {TABLE} (thread_id, last_write_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                    rows,
                )
        return len(rows)

    def candidates(
        self, policy: Policy, limit: int | None, skip: Sequence[str], session: Any = None
    ) -> list[str]:
        swept = "AND swept_at IS NULL" if policy.strategy == "keep_latest" else ""
        params = {
            "now": time.time(),
            "default": policy.default_ttl,
            "skip": orjson.dumps(list(skip)).decode(),
        }
        limit_sql = f"LIMIT {int(limit)}" if limit is not None else ""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT thread_id FROM {TABLE} WHERE {_SQ_EXPIRED} {swept} "
                f"AND thread_id NOT IN (SELECT value FROM json_each(:skip)) ORDER BY last_write_at {limit_sql}",
                params,
            ).fetchall()
        return [r[0] for r in rows]

    @contextmanager
    def session(self, policy: Policy) -> Iterator[_SqliteSession]:
        yield _SqliteSession(self, policy)

    def delete_extracting(self, thread_id: str, recorder: Recorder | None) -> None:
        with self._read() as conn:
            row = conn.execute(f"SELECT namespace FROM {TABLE} WHERE thread_id = ?", (thread_id,)).fetchone()
        entries = self.window(self.saver, thread_id, row_namespace(self, thread_id, row[0] if row else None))
        if entries and recorder is not None:
            recorder.record(entries)
        with self.saver._transaction() as cur:  # its running-summary steps with it, in one transaction
            for table in ("writes", "checkpoints", SUMMARIES_TABLE, PRUNED_TABLE):
                cur.execute(f"DELETE FROM {table} WHERE thread_id = ?", (thread_id,))

    def database_status(self, policy: Policy, *, thread_prefix: str = "") -> dict[str, Any]:
        swept = "AND swept_at IS NULL" if policy.strategy == "keep_latest" else ""
        # substr, not LIKE: a tenant name may hold "_", LIKE's one-character wildcard.
        mine = "substr(thread_id, 1, length(:prefix)) = :prefix"
        with self._read() as conn:
            tracked, expired = conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM({_SQ_EXPIRED} {swept}), 0) FROM {TABLE} WHERE {mine}",
                {"now": time.time(), "default": policy.default_ttl, "prefix": thread_prefix},
            ).fetchone()
            pruned, deleted, total, last = conn.execute(
                f"SELECT COALESCE(SUM(action = 'pruned'), 0), COALESCE(SUM(action = 'deleted'), 0), "
                f"COALESCE(SUM(bytes), 0), MAX(swept_at) FROM {LOG_TABLE} WHERE {mine}",
                {"prefix": thread_prefix},
            ).fetchone()
        log = {"pruned": pruned, "deleted": deleted, "bytes": total, "last": from_epoch(last)}
        return database_figures(tracked, expired, log)

    def forget_log(self, older_than_days: int, session: Any = None) -> int:
        with self._read() as conn:
            cur = conn.execute(
                f"DELETE FROM {LOG_TABLE} WHERE swept_at < ?", (time.time() - older_than_days * 86400,)
            )
            return cur.rowcount


class _SqliteSession:
    def __init__(self, ledger: SqliteLedger, policy: Policy) -> None:
        self.ledger = ledger
        self.policy = policy

    def _lock_row(self, cur: Any, thread_id: str) -> Any:
        swept = "AND swept_at IS NULL" if self.policy.strategy == "keep_latest" else ""
        return cur.execute(
            f"SELECT namespace FROM {TABLE} WHERE thread_id = :thread AND {_SQ_EXPIRED} {swept}",
            {"thread": thread_id, "now": time.time(), "default": self.policy.default_ttl},
        ).fetchone()

    def measure(self, thread_id: str) -> int:
        with self.ledger._read() as conn:
            total = conn.execute(_SQ_THREAD_BYTES, {"thread": thread_id}).fetchone()[0]
            if self.policy.strategy == "delete":
                return int(total)
            kept = conn.execute(_SQ_HEAD_BYTES, {"thread": thread_id}).fetchone()[0]
        return max(0, int(total) - int(kept))

    def handle(self, thread_id: str) -> Outcome | None:
        saver, ledger = self.ledger.saver, self.ledger
        if self.policy.strategy == "delete":
            # The outbox has a connection of its own, which cannot write while this one holds the write
            # lock: the window is recorded first (idempotent; if the thread turns out to be young again,
            # its messages merely reach memory early), then checked and deleted in one transaction.
            with ledger._read() as conn:
                row = self._lock_row(conn, thread_id)
            if row is None:
                return None
            entries = ledger.window(saver, thread_id, row_namespace(ledger, thread_id, row[0]))
            if entries and ledger.recorder is not None:
                ledger.recorder.record(entries)
        with saver._transaction() as cur:
            row = self._lock_row(cur, thread_id)
            if row is None:
                return None
            before = int(cur.execute(_SQ_THREAD_BYTES, {"thread": thread_id}).fetchone()[0])
            if before == 0:
                cur.execute(f"DELETE FROM {TABLE} WHERE thread_id = ?", (thread_id,))
                return None
            if self.policy.strategy == "delete":
                for table in ("writes", "checkpoints", SUMMARIES_TABLE, PRUNED_TABLE, TABLE):
                    cur.execute(f"DELETE FROM {table} WHERE thread_id = ?", (thread_id,))
                self._log(cur, thread_id, "deleted", before)
                return Outcome(thread_id, "deleted", before)
            if saver._delta_threads(cur, [thread_id]):
                cur.execute(f"UPDATE {TABLE} SET swept_at = ? WHERE thread_id = ?", (time.time(), thread_id))
                logger.warning("TTL sweep left thread %r as it is: it uses a DeltaChannel", thread_id)
                return Outcome(thread_id, "refused", 0)
            saver._keep_latest(cur, thread_id)
            cur.execute(
                f"DELETE FROM {SUMMARIES_TABLE} WHERE thread_id = ? AND NOT EXISTS (SELECT 1 FROM checkpoints c "
                f"WHERE c.thread_id = ? AND c.checkpoint_ns = {SUMMARIES_TABLE}.checkpoint_ns)",
                (thread_id, thread_id),
            )
            freed = max(0, before - int(cur.execute(_SQ_THREAD_BYTES, {"thread": thread_id}).fetchone()[0]))
            cur.execute(f"UPDATE {TABLE} SET swept_at = ? WHERE thread_id = ?", (time.time(), thread_id))
            self._log(cur, thread_id, "pruned", freed)
            return Outcome(thread_id, "pruned", freed)

    def _log(self, cur: Any, thread_id: str, action: str, freed: int) -> None:
        cur.execute(
            f"INSERT INTO {LOG_TABLE} (thread_id, action, bytes, swept_at, swept_by) VALUES (?, ?, ?, ?, ?)",
            (thread_id, action, freed, time.time(), self.ledger.worker_id),
        )
