"""The book of running summaries: the steps of every thread's summary, in ``reducing_saver_summaries``.

The put path reads the book and asks it for steps (``request``: idempotent); the summarizer claims steps
whose base is done and completes each by compare-and-set. :class:`SqlSummaryBook` holds the SQL both
databases run (``storage/<backend>/summaries.py`` give it connections and dialect); :class:`MemoryBook`
keeps the same contract in one process. docs/summaries.md ("Durable, exactly once") describes a step's
life, and docs/encryption.md what is sealed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import orjson

from reducing_saver.reducer import MemorySummaryBook, StepInfo, StepRequest
from reducing_saver.service.encryption import EncryptedValueRefused, Sealer, StoredDataError
from reducing_saver.service.encryption.summaries import (
    SEALED_BATCH_PREFIX,
    SEALED_PREFIX,
    open_batch,
    open_text,
    seal_batch,
    seal_text,
)
from reducing_saver.service.extraction.outbox import error_text, json_clean

logger = logging.getLogger("reducing_saver.service")

TABLE = "reducing_saver_summaries"
#: A step's base column for the first step of a namespace (NULL would need IS NOT DISTINCT FROM).
ROOT = ""
#: Rows of a thread with no checkpoint are forgotten only this long after they were made: a new thread's
#: first put asks for a step before its checkpoint is stored.
ORPHAN_GRACE_SECONDS = 300.0

_INFO = "step_id, base_step, version, keys, status, covered, text"
#: The columns ``copy_thread`` copies (a copy holds no lease).
_COPIED = (
    "checkpoint_ns, step_id, base_step, version, keys, batch, batch_size, covered, status, text, model, "
    "prompt_hash, input_tokens, output_tokens, attempts, available_at, last_error, created_at, done_at"
)


@dataclass(frozen=True)
class ClaimedStep:
    """A step a summarizer holds: what to summarize, on top of which text."""

    request: StepRequest
    previous: str | None
    attempts: int


@dataclass(frozen=True)
class DeadStep:
    thread_id: str
    checkpoint_ns: str
    step_id: str
    attempts: int
    last_error: str | None
    #: Messages in the batch (still in their windows, or cut past the hard limit).
    messages: int = 0


def batch_data(batch: Sequence[Any]) -> bytes:
    """A batch's messages as JSON bytes (``model_dump()`` dicts; bytea/blob, which can hold NUL)."""
    dumps = []
    for message in batch:
        fields = message.model_dump() if hasattr(message, "model_dump") else dict(message)
        dumps.append(json_clean(fields))
    return orjson.dumps(dumps)


class SqlSummaryBook:
    """The book as SQL; a subclass supplies :meth:`_tx` (one transaction, dict-like rows) and the dialect.

    Attributes:
        placeholder: The driver's parameter marker.
        lock_clause: How a claim's ``SELECT`` locks the rows it picks.
        sealer: Under ``--encryption``, what seals each step's ``text`` and ``batch``, bound to the step's
            thread, namespace and id (``service/encryption/summaries.py``); ``None`` stores them plain.
    """

    placeholder = "?"
    lock_clause = ""
    sealer: Sealer | None = None

    def _tx(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _sql(self, text: str) -> str:
        return text if self.placeholder == "?" else text.replace("?", self.placeholder)

    def _run(self, text: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._tx() as cur:
            cur.execute(self._sql(text), tuple(params))
            return cur.fetchall() if cur.description else []

    # -- the sealed columns ------------------------------------------------------------------------

    def _text_in(self, text: str, thread_id: str, ns: str, step_id: str) -> str:
        text = text.replace("\x00", "")
        return text if self.sealer is None else seal_text(self.sealer, text, thread_id, ns, step_id)

    def _text_out(self, stored: str | None, thread_id: str, ns: str, step_id: str) -> str | None:
        if self.sealer is not None:
            return open_text(self.sealer, stored, thread_id, ns, step_id)
        if stored is not None and stored.startswith(SEALED_PREFIX):
            raise EncryptedValueRefused(f"the running summary of thread {thread_id!r} (step {step_id!r})")
        return stored

    def _batch_in(self, data: bytes, thread_id: str, ns: str, step_id: str) -> bytes:
        return data if self.sealer is None else seal_batch(self.sealer, data, thread_id, ns, step_id)

    def _batch_out(self, stored: Any, thread_id: str, ns: str, step_id: str) -> bytes:
        stored = bytes(stored)
        if self.sealer is not None:
            return open_batch(self.sealer, stored, thread_id, ns, step_id)
        if stored.startswith(SEALED_BATCH_PREFIX):
            raise EncryptedValueRefused(f"a summary batch of thread {thread_id!r} (step {step_id!r})")
        return stored

    def _info(self, row: Any, thread_id: str, ns: str) -> StepInfo:
        base = row["base_step"]
        return StepInfo(
            row["step_id"],
            None if base == ROOT else base,
            row["version"],
            tuple(orjson.loads(bytes(row["keys"]))),
            row["status"],
            row["covered"],
            self._text_out(row["text"], thread_id, ns, row["step_id"]),
        )

    # -- the put path's side ---------------------------------------------------------------------

    def steps(self, thread_id: str, checkpoint_ns: str, step_ids: Sequence[str]) -> dict[str, StepInfo]:
        if not step_ids:
            return {}
        marks = ", ".join("?" for _ in step_ids)
        rows = self._run(
            f"SELECT {_INFO} FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND step_id IN ({marks})",
            (thread_id, checkpoint_ns, *step_ids),
        )
        return {row["step_id"]: self._info(row, thread_id, checkpoint_ns) for row in rows}

    def children(self, thread_id: str, checkpoint_ns: str, base_step: str | None) -> list[StepInfo]:
        rows = self._run(
            f"SELECT {_INFO} FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND base_step = ? "
            "ORDER BY created_at",
            (thread_id, checkpoint_ns, base_step or ROOT),
        )
        return [self._info(row, thread_id, checkpoint_ns) for row in rows]

    def chain(self, thread_id: str, checkpoint_ns: str, tip: str, base: str | None) -> list[StepInfo]:
        """The steps from ``tip`` back to the one built on ``base`` (excluded), oldest first: one recursive
        query, however long the chain of lagging steps."""
        cols = "step_id, base_step, version, keys, status, covered, text"
        rows = self._run(
            f"""WITH RECURSIVE chain({cols}, depth) AS (
                SELECT {cols}, 0 FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ?
                UNION ALL
                SELECT {", ".join(f"s.{c}" for c in cols.split(", "))}, c.depth + 1 FROM {TABLE} s
                JOIN chain c ON s.thread_id = ? AND s.checkpoint_ns = ? AND s.step_id = c.base_step
                WHERE c.base_step <> ?)
            SELECT {cols} FROM chain ORDER BY depth DESC""",
            (thread_id, checkpoint_ns, tip, thread_id, checkpoint_ns, base or ROOT),
        )
        return [self._info(row, thread_id, checkpoint_ns) for row in rows]

    def request(self, step: StepRequest) -> None:
        now = time.time()
        self._run(
            f"INSERT INTO {TABLE} (thread_id, checkpoint_ns, step_id, base_step, version, keys, batch, "
            "batch_size, covered, available_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING",
            (
                step.thread_id,
                step.checkpoint_ns,
                step.step_id,
                step.base_step or ROOT,
                step.version,
                orjson.dumps(list(step.keys)),
                self._batch_in(batch_data(step.batch), step.thread_id, step.checkpoint_ns, step.step_id),
                len(step.batch),
                step.covered,
                now,
                now,
            ),
        )

    # -- the summarizer's side -------------------------------------------------------------------

    def claim(self, worker_id: str, lease_seconds: float) -> ClaimedStep | None:
        """The oldest claimable step (its base done), leased to ``worker_id``; ``None`` when there is none.

        A step whose batch or base summary cannot be opened (changed, copied from another thread or step,
        plain under ``--encryption required``, under a key the ring lacks) or read (a batch that is not
        JSON) becomes a dead letter whose error says why, and the next one is claimed: one bad row never
        fails the summarizer's round, which would claim it again and again ahead of every other step.
        """
        while True:
            claimed = self._claim_row(worker_id, lease_seconds)
            if claimed is None:
                return None
            row, previous = claimed
            request = StepRequest(
                thread_id=row["thread_id"],
                checkpoint_ns=row["checkpoint_ns"],
                step_id=row["step_id"],
                base_step=None if row["base_step"] == ROOT else row["base_step"],
                version=row["version"],
                keys=tuple(orjson.loads(bytes(row["keys"]))),
                batch=[],
                covered=row["covered"],
            )
            place = (request.thread_id, request.checkpoint_ns)
            try:
                batch = orjson.loads(self._batch_out(row["batch"], *place, request.step_id))
                if request.base_step is not None:
                    previous = self._text_out(previous, *place, request.base_step)
            except (StoredDataError, ValueError) as exc:  # orjson's JSONDecodeError is a ValueError
                logger.error("summary step %s of thread %r: %s", request.step_id, request.thread_id, exc)
                self.fail(worker_id, request, f"{type(exc).__name__}: {exc}")
                continue
            return ClaimedStep(replace(request, batch=batch), previous, row["attempts"] + 1)

    def _claim_row(self, worker_id: str, lease_seconds: float) -> tuple[Any, str | None] | None:
        """The row of the oldest claimable step, leased, and its base's stored text. Without a sealer, a
        step whose batch or base summary is sealed is not claimable here (a process with the key ring
        takes it)."""
        now = time.time()
        plain_batch = plain_base = ""
        params: tuple[Any, ...] = (now, now)
        if self.sealer is None:
            plain_batch = " AND substr(s.batch, 1, ?) <> ?"
            plain_base = " AND (b.text IS NULL OR substr(b.text, 1, ?) <> ?)"
            params = (
                now, now, len(SEALED_BATCH_PREFIX), SEALED_BATCH_PREFIX, len(SEALED_PREFIX), SEALED_PREFIX
            )
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"SELECT s.* FROM {TABLE} s WHERE s.status = 'pending' AND s.available_at <= ? "
                    f"AND (s.lease_until IS NULL OR s.lease_until <= ?){plain_batch} AND (s.base_step = '' "
                    f"OR EXISTS (SELECT 1 FROM {TABLE} b WHERE b.thread_id = s.thread_id AND b.checkpoint_ns = "
                    f"s.checkpoint_ns AND b.step_id = s.base_step AND b.status = 'done'{plain_base})) "
                    f"ORDER BY s.created_at LIMIT 1{self.lock_clause}"
                ),
                params,
            )
            row = cur.fetchone()
            if row is None:
                return None
            key = (row["thread_id"], row["checkpoint_ns"], row["step_id"])
            cur.execute(
                self._sql(
                    f"UPDATE {TABLE} SET claimed_by = ?, lease_until = ?, attempts = attempts + 1 "
                    "WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ?"
                ),
                (worker_id, now + lease_seconds, *key),
            )
            previous = None
            if row["base_step"] != ROOT:
                cur.execute(
                    self._sql(
                        f"SELECT text FROM {TABLE} WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ?"
                    ),
                    (row["thread_id"], row["checkpoint_ns"], row["base_step"]),
                )
                previous = cur.fetchone()["text"]
        return row, previous

    def renew(self, worker_id: str, step: StepRequest, lease_seconds: float) -> bool:
        """Extend ``worker_id``'s lease of a step it holds to ``lease_seconds`` from now; whether it still
        held it (``False``: the lease was lost, to another worker, or the step is no longer pending)."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"UPDATE {TABLE} SET lease_until = ? WHERE thread_id = ? AND checkpoint_ns = ? "
                    "AND step_id = ? AND status = 'pending' AND claimed_by = ?"
                ),
                (time.time() + lease_seconds, step.thread_id, step.checkpoint_ns, step.step_id, worker_id),
            )
            return cur.rowcount == 1

    def complete(
        self,
        step: StepRequest,
        text: str,
        *,
        model: str | None = None,
        prompt_hash: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> bool:
        """Store a step's summary unless it is done already (compare-and-set); whether this call did."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"UPDATE {TABLE} SET status = 'done', text = ?, model = ?, prompt_hash = ?, input_tokens = ?, "
                    "output_tokens = ?, done_at = ?, claimed_by = NULL, lease_until = NULL "
                    "WHERE thread_id = ? AND checkpoint_ns = ? AND step_id = ? AND status = 'pending'"
                ),
                (
                    self._text_in(text, step.thread_id, step.checkpoint_ns, step.step_id),
                    model,
                    prompt_hash,
                    input_tokens,
                    output_tokens,
                    time.time(),
                    step.thread_id,
                    step.checkpoint_ns,
                    step.step_id,
                ),
            )
            return cur.rowcount == 1

    def fail(self, worker_id: str, step: StepRequest, error: str, *, retry_at: float | None = None) -> bool:
        """A failed attempt: retry at ``retry_at`` (epoch seconds), or a dead letter without it."""
        sets = (
            "available_at = ?, last_error = ?" if retry_at is not None else "status = 'dead', last_error = ?"
        )
        params = (retry_at, error_text(error)) if retry_at is not None else (error_text(error),)
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"UPDATE {TABLE} SET {sets}, claimed_by = NULL, lease_until = NULL WHERE thread_id = ? "
                    "AND checkpoint_ns = ? AND step_id = ? AND status = 'pending' AND claimed_by = ?"
                ),
                (*params, step.thread_id, step.checkpoint_ns, step.step_id, worker_id),
            )
            return cur.rowcount == 1

    def release(self, worker_id: str) -> int:
        """Hand back what ``worker_id`` holds (the claim not counted)."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"UPDATE {TABLE} SET claimed_by = NULL, lease_until = NULL, attempts = attempts - 1 "
                    "WHERE claimed_by = ? AND status = 'pending' AND attempts > 0"
                ),
                (worker_id,),
            )
            return cur.rowcount

    def retry_dead(self, *, thread_prefix: str = "") -> int:
        """Send dead steps (of threads starting with ``thread_prefix``) back to pending."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"UPDATE {TABLE} SET status = 'pending', attempts = 0, available_at = ?, claimed_by = NULL, "
                    "lease_until = NULL WHERE status = 'dead' AND substr(thread_id, 1, ?) = ?"
                ),
                (time.time(), len(thread_prefix), thread_prefix),
            )
            return cur.rowcount

    def dead_letters(self, limit: int = 100, *, thread_prefix: str = "") -> list[DeadStep]:
        rows = self._run(
            f"SELECT thread_id, checkpoint_ns, step_id, attempts, last_error, batch_size FROM {TABLE} "
            "WHERE status = 'dead' AND substr(thread_id, 1, ?) = ? ORDER BY created_at LIMIT ?",
            (len(thread_prefix), thread_prefix, limit),
        )
        return [
            DeadStep(
                r["thread_id"], r["checkpoint_ns"], r["step_id"], r["attempts"], r["last_error"], r["batch_size"]
            )
            for r in rows
        ]

    def status(self, *, thread_prefix: str = "") -> dict[str, Any]:
        """Steps and messages awaiting a summary, the oldest one's age, done and dead steps."""
        now = time.time()
        rows = self._run(
            f"""SELECT
                COALESCE(SUM(CASE WHEN status = 'pending' THEN 1 ELSE 0 END), 0) AS pending,
                COALESCE(SUM(CASE WHEN status = 'pending' THEN batch_size ELSE 0 END), 0) AS messages,
                COALESCE(SUM(CASE WHEN status = 'done' THEN 1 ELSE 0 END), 0) AS done,
                COALESCE(SUM(CASE WHEN status = 'dead' THEN 1 ELSE 0 END), 0) AS dead,
                MIN(CASE WHEN status = 'pending' THEN created_at END) AS oldest
            FROM {TABLE} WHERE substr(thread_id, 1, ?) = ?""",
            (len(thread_prefix), thread_prefix),
        )
        row = rows[0]
        oldest = row["oldest"]
        return {
            "pending_steps": int(row["pending"]),
            "messages_awaiting_summary": int(row["messages"]),
            "done_steps": int(row["done"]),
            "dead_steps": int(row["dead"]),
            "oldest_pending_age_seconds": None if oldest is None else max(0.0, now - float(oldest)),
        }

    # -- a thread's life -------------------------------------------------------------------------

    def delete_thread(self, thread_id: str) -> None:
        self._run(f"DELETE FROM {TABLE} WHERE thread_id = ?", (thread_id,))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread's steps to another thread (steps the target has already are kept).

        Under encryption each step's text and batch are opened and sealed again for the target thread (a
        ciphertext bound to the source does not open there), in the same transaction.
        """
        if self.sealer is None:
            self._run(
                f"INSERT INTO {TABLE} (thread_id, {_COPIED}) SELECT ?, {_COPIED} FROM {TABLE} WHERE thread_id = ? "
                "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING",
                (target_thread_id, source_thread_id),
            )
            return
        columns = [c.strip() for c in _COPIED.split(",")]
        marks = ", ".join("?" for _ in range(len(columns) + 1))
        with self._tx() as cur:
            cur.execute(self._sql(f"SELECT {_COPIED} FROM {TABLE} WHERE thread_id = ?"), (source_thread_id,))
            rows = [dict(zip(columns, (row[c] for c in columns), strict=True)) for row in cur.fetchall()]
            for row in rows:
                ns, step_id = row["checkpoint_ns"], row["step_id"]
                batch = self._batch_out(row["batch"], source_thread_id, ns, step_id)
                row["batch"] = self._batch_in(batch, target_thread_id, ns, step_id)
                text = self._text_out(row["text"], source_thread_id, ns, step_id)
                row["text"] = None if text is None else self._text_in(text, target_thread_id, ns, step_id)
                cur.execute(
                    self._sql(
                        f"INSERT INTO {TABLE} (thread_id, {_COPIED}) VALUES ({marks}) "
                        "ON CONFLICT (thread_id, checkpoint_ns, step_id) DO NOTHING"
                    ),
                    (target_thread_id, *(row[c] for c in columns)),
                )

    def forget_orphans(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> int:
        """Delete the steps of thread namespaces that have no checkpoint left (older than the grace)."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"DELETE FROM {TABLE} WHERE created_at < ? AND NOT EXISTS (SELECT 1 FROM checkpoints c "
                    f"WHERE c.thread_id = {TABLE}.thread_id AND c.checkpoint_ns = {TABLE}.checkpoint_ns)"
                ),
                (time.time() - grace_seconds,),
            )
            return cur.rowcount

    def close(self) -> None:
        """Nothing by default (a subclass closes its connections)."""


class MemoryBook(MemorySummaryBook):
    """The service's book in one process (``memory://``): the reducer's dict, with claims and dead letters.

    Args:
        has_checkpoints: ``has_checkpoints(thread_id, checkpoint_ns)`` for :meth:`forget_orphans`.
    """

    def __init__(self, has_checkpoints: Any = None) -> None:
        super().__init__()
        self._has_checkpoints = has_checkpoints
        self._meta: dict[tuple[str, str, str], dict[str, Any]] = {}

    def _meta_of(self, key: tuple[str, str, str]) -> dict[str, Any]:
        return self._meta.setdefault(
            key,
            {
                "attempts": 0,
                "available_at": 0.0,
                "lease_until": None,
                "claimed_by": None,
                "last_error": None,
                "created_at": time.time(),
            },
        )

    def request(self, step: StepRequest) -> None:
        super().request(step)
        with self._lock:
            self._meta_of((step.thread_id, step.checkpoint_ns, step.step_id))

    def claim(self, worker_id: str, lease_seconds: float) -> ClaimedStep | None:
        now = time.time()
        with self._lock:
            for key in self._order:
                row, meta = self._steps[key], self._meta_of(key)
                if row["status"] != "pending" or meta["available_at"] > now:
                    continue
                if meta["lease_until"] is not None and meta["lease_until"] > now:
                    continue
                previous = None
                if row["base_step"] is not None:
                    base = self._steps.get((key[0], key[1], row["base_step"]))
                    if base is None or base["status"] != "done":
                        continue
                    previous = base["text"]
                meta.update(
                    claimed_by=worker_id, lease_until=now + lease_seconds, attempts=meta["attempts"] + 1
                )
                request = StepRequest(
                    key[0],
                    key[1],
                    row["step_id"],
                    row["base_step"],
                    row["version"],
                    tuple(row["keys"]),
                    orjson.loads(batch_data(row["batch"])),
                    row["covered"],
                )
                return ClaimedStep(request, previous, meta["attempts"])
        return None

    def renew(self, worker_id: str, step: StepRequest, lease_seconds: float) -> bool:
        key = (step.thread_id, step.checkpoint_ns, step.step_id)
        with self._lock:
            row, meta = self._steps.get(key), self._meta.get(key)
            if row is None or meta is None or row["status"] != "pending" or meta["claimed_by"] != worker_id:
                return False
            meta["lease_until"] = time.time() + lease_seconds
            return True

    def complete(self, step: StepRequest, text: str, **details: Any) -> bool:
        done = super().complete(step, text)
        if done:
            with self._lock:
                self._meta_of((step.thread_id, step.checkpoint_ns, step.step_id)).update(
                    claimed_by=None, lease_until=None, **details
                )
        return done

    def fail(self, worker_id: str, step: StepRequest, error: str, *, retry_at: float | None = None) -> bool:
        key = (step.thread_id, step.checkpoint_ns, step.step_id)
        with self._lock:
            row, meta = self._steps.get(key), self._meta_of(key)
            if row is None or row["status"] != "pending" or meta["claimed_by"] != worker_id:
                return False
            meta.update(claimed_by=None, lease_until=None, last_error=error_text(error))
            if retry_at is None:
                row["status"] = "dead"
            else:
                meta["available_at"] = retry_at
            return True

    def release(self, worker_id: str) -> int:
        with self._lock:
            held = [m for m in self._meta.values() if m["claimed_by"] == worker_id]
            for meta in held:
                meta.update(claimed_by=None, lease_until=None, attempts=max(meta["attempts"] - 1, 0))
            return len(held)

    def retry_dead(self, *, thread_prefix: str = "") -> int:
        with self._lock:
            count = 0
            for key, row in self._steps.items():
                if row["status"] == "dead" and key[0].startswith(thread_prefix):
                    row["status"] = "pending"
                    self._meta_of(key).update(attempts=0, available_at=0.0)
                    count += 1
            return count

    def dead_letters(self, limit: int = 100, *, thread_prefix: str = "") -> list[DeadStep]:
        with self._lock:
            return [
                DeadStep(
                    *key,
                    self._meta_of(key)["attempts"],
                    self._meta_of(key)["last_error"],
                    len(self._steps[key]["keys"]),
                )
                for key in self._order
                if self._steps[key]["status"] == "dead" and key[0].startswith(thread_prefix)
            ][:limit]

    def status(self, *, thread_prefix: str = "") -> dict[str, Any]:
        now = time.time()
        with self._lock:
            rows = [(k, r) for k, r in self._steps.items() if k[0].startswith(thread_prefix)]
            pending = [(k, r) for k, r in rows if r["status"] == "pending"]
            oldest = min((self._meta_of(k)["created_at"] for k, _ in pending), default=None)
            return {
                "pending_steps": len(pending),
                "messages_awaiting_summary": sum(len(r["keys"]) for _, r in pending),
                "done_steps": sum(r["status"] == "done" for _, r in rows),
                "dead_steps": sum(r["status"] == "dead" for _, r in rows),
                "oldest_pending_age_seconds": None if oldest is None else max(0.0, now - oldest),
            }

    def _drop(self, keys: Sequence[tuple[str, str, str]]) -> None:
        super()._drop(keys)
        for key in keys:
            self._meta.pop(key, None)

    def _copy(self, key: tuple[str, str, str], target: tuple[str, str, str]) -> None:
        super()._copy(key, target)
        self._meta[target] = dict(self._meta_of(key))

    def forget_namespaces(self, namespaces: Sequence[tuple[str, str]]) -> int:
        """Delete the steps of these ``(thread_id, checkpoint_ns)`` (their checkpoints are gone)."""
        wanted = set(namespaces)
        with self._lock:
            gone = [k for k in self._order if (k[0], k[1]) in wanted]
            self._drop(gone)
            return len(gone)

    def forget_gone(self, thread_ids: Sequence[str]) -> int:
        """Delete the steps of these threads' namespaces that have no checkpoint left (no grace)."""
        if self._has_checkpoints is None:
            return 0
        wanted = set(thread_ids)
        with self._lock:
            candidates = [k for k in self._order if k[0] in wanted]
        return self.forget_namespaces(
            [(k[0], k[1]) for k in candidates if not self._has_checkpoints(k[0], k[1])]
        )

    def forget_orphans(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> int:
        if self._has_checkpoints is None:
            return 0
        cutoff = time.time() - grace_seconds
        with self._lock:
            gone = [
                k
                for k in self._order
                if self._meta_of(k)["created_at"] < cutoff and not self._has_checkpoints(k[0], k[1])
            ]
            self._drop(gone)
            return len(gone)

    def close(self) -> None:
        pass
