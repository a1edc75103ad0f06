"""The book of running summaries: the steps of every thread's summary, in ``reducing_saver_summaries``.

A step (``reducer.StepRequest``) is a batch of cut messages to summarize on top of its base step. The put
path reads the book (``steps``, ``children``) and asks it for steps (``request``: idempotent); the
summarizer claims steps whose base is done (per thread and namespace in order), and stores each one's
summary by compare-and-set: ``complete`` succeeds only on a step still pending, so a model call run twice
(two replicas, a lease that ran out, kill -9 mid-call) advances the summary once.

A row's life: ``pending`` (claimable when its base is done, its ``available_at`` has come and no live lease
holds it; the holder ``renew``s its lease while its model call runs) -> ``done`` (``text``, ``model``,
``prompt_hash``, token counts) or, after ``max_attempts`` failures, ``dead`` (``last_error``;
``retry_dead`` sends it back). A thread's steps go with it: ``delete_thread`` and ``copy_thread`` here;
``delete_for_runs``, ``prune`` and TTL sweeps delete the steps of the namespaces they empty themselves
(the savers' ``summaries_table``, the ledgers; in their transaction on PostgreSQL and SQLite); and
``forget_orphans`` catches whatever else lost its checkpoints (a thread deleted by a stock saver, say).

:class:`SqlSummaryBook` holds what both databases do; each one's SQL (:class:`SummarySql`) and connections
are in ``storage/postgres/summaries.py`` and ``storage/sqlite/summaries.py``; the table itself is a
migration of each backend (``storage/<backend>/migrations.py``). ``storage/inmemory/summaries.py``'s
``MemoryBook`` keeps the same contract in one process.

Under ``--encryption`` a SQL book's :attr:`SqlSummaryBook.sealer` (``encryption/summaries.py``'s
``SummarySealer``) seals each step's ``text`` and ``batch`` on the way in and opens them on the way out;
``copy_thread`` seals them again for the target thread. A book without a sealer (``--encryption off``)
sharing its database with sealing processes during a rollout never claims a step whose batch or base
summary is sealed (it waits for a process with the key ring), and refuses to show a sealed summary
(``EncryptedValueRefused``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson

from reducing_saver.reducer import StepInfo, StepRequest
from reducing_saver.service.storage import EncryptedValueRefused, StoredDataError
from reducing_saver.service.storage.outbox import SEALED_KEY, error_text, json_clean

logger = logging.getLogger("reducing_saver.service")

TABLE = "reducing_saver_summaries"
#: A step's base column for the first step of a namespace (NULL would need IS NOT DISTINCT FROM).
ROOT = ""
#: Rows of a thread with no checkpoint are forgotten only this long after they were made: a new thread's
#: first put asks for a step before its checkpoint is stored.
ORPHAN_GRACE_SECONDS = 300.0
#: How a sealed summary text starts (``encryption/summaries.py`` seals it; a plain book refuses it).
SEALED_PREFIX = SEALED_KEY + ":"
#: How a sealed batch starts (a plain batch is JSON, starting with ``[``).
SEALED_BATCH_PREFIX = SEALED_PREFIX.encode()

#: The columns a step's :class:`StepInfo` is read from.
INFO = "step_id, base_step, version, keys, status, covered, text"
#: The columns ``copy_thread`` copies (a copy holds no lease).
COPIED = (
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


class SummarySealer(Protocol):
    """What seals a step's ``text`` and ``batch``, bound to the step's thread, namespace and id
    (``encryption/summaries.py``'s ``SummarySealer``)."""

    def seal_text(self, text: str, thread_id: str, ns: str, step_id: str) -> str: ...
    def open_text(self, stored: str | None, thread_id: str, ns: str, step_id: str) -> str | None: ...
    def seal_batch(self, data: bytes, thread_id: str, ns: str, step_id: str) -> bytes: ...
    def open_batch(self, stored: bytes, thread_id: str, ns: str, step_id: str) -> bytes: ...


@dataclass(frozen=True)
class SummarySql:
    """One database's statements of the book, written with its driver's parameter marker (``mark``).

    ``steps`` takes ``{marks}`` (one marker per step id), ``claim`` takes ``{plain_batch}`` and
    ``{plain_base}`` (``claim_plain_batch`` and ``claim_plain_base`` for a book without a sealer, else
    nothing), ``copy_row`` takes ``{marks}`` (one per copied column and the target thread).
    """

    mark: str
    steps: str
    children: str
    chain: str
    request: str
    claim: str
    claim_plain_batch: str
    claim_plain_base: str
    lease: str
    base_text: str
    renew: str
    complete: str
    retry: str
    dead: str
    release: str
    retry_dead: str
    dead_letters: str
    status: str
    delete_thread: str
    copy_thread: str
    copy_rows: str
    copy_row: str
    forget_orphans: str


class SqlSummaryBook:
    """The book on a SQL database; a subclass supplies :meth:`_tx` (one transaction, dict-like rows) and
    its database's statements (:attr:`sql`).

    Attributes:
        sql: The database's statements.
        sealer: Under ``--encryption``, what seals each step's ``text`` and ``batch``, bound to the step's
            thread, namespace and id (``service/encryption/summaries.py``); ``None`` stores them plain.
    """

    sql: SummarySql
    sealer: SummarySealer | None = None

    def _tx(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _run(self, text: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._tx() as cur:
            cur.execute(text, tuple(params))
            return cur.fetchall() if cur.description else []

    # -- the sealed columns ------------------------------------------------------------------------

    def _text_in(self, text: str, thread_id: str, ns: str, step_id: str) -> str:
        text = text.replace("\x00", "")
        return text if self.sealer is None else self.sealer.seal_text(text, thread_id, ns, step_id)

    def _text_out(self, stored: str | None, thread_id: str, ns: str, step_id: str) -> str | None:
        if self.sealer is not None:
            return self.sealer.open_text(stored, thread_id, ns, step_id)
        if stored is not None and stored.startswith(SEALED_PREFIX):
            raise EncryptedValueRefused(f"the running summary of thread {thread_id!r} (step {step_id!r})")
        return stored

    def _batch_in(self, data: bytes, thread_id: str, ns: str, step_id: str) -> bytes:
        return data if self.sealer is None else self.sealer.seal_batch(data, thread_id, ns, step_id)

    def _batch_out(self, stored: Any, thread_id: str, ns: str, step_id: str) -> bytes:
        stored = bytes(stored)
        if self.sealer is not None:
            return self.sealer.open_batch(stored, thread_id, ns, step_id)
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
        marks = ", ".join(self.sql.mark for _ in step_ids)
        rows = self._run(self.sql.steps.format(marks=marks), (thread_id, checkpoint_ns, *step_ids))
        return {row["step_id"]: self._info(row, thread_id, checkpoint_ns) for row in rows}

    def children(self, thread_id: str, checkpoint_ns: str, base_step: str | None) -> list[StepInfo]:
        rows = self._run(self.sql.children, (thread_id, checkpoint_ns, base_step or ROOT))
        return [self._info(row, thread_id, checkpoint_ns) for row in rows]

    def chain(self, thread_id: str, checkpoint_ns: str, tip: str, base: str | None) -> list[StepInfo]:
        """The steps from ``tip`` back to the one built on ``base`` (excluded), oldest first: one recursive
        query, however long the chain of lagging steps."""
        rows = self._run(
            self.sql.chain, (thread_id, checkpoint_ns, tip, thread_id, checkpoint_ns, base or ROOT)
        )
        return [self._info(row, thread_id, checkpoint_ns) for row in rows]

    def request(self, step: StepRequest) -> None:
        now = time.time()
        self._run(
            self.sql.request,
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
            plain_batch, plain_base = self.sql.claim_plain_batch, self.sql.claim_plain_base
            params = (
                now,
                now,
                len(SEALED_BATCH_PREFIX),
                SEALED_BATCH_PREFIX,
                len(SEALED_PREFIX),
                SEALED_PREFIX,
            )
        with self._tx() as cur:
            cur.execute(self.sql.claim.format(plain_batch=plain_batch, plain_base=plain_base), params)
            row = cur.fetchone()
            if row is None:
                return None
            key = (row["thread_id"], row["checkpoint_ns"], row["step_id"])
            cur.execute(self.sql.lease, (worker_id, now + lease_seconds, *key))
            previous = None
            if row["base_step"] != ROOT:
                cur.execute(self.sql.base_text, (row["thread_id"], row["checkpoint_ns"], row["base_step"]))
                previous = cur.fetchone()["text"]
        return row, previous

    def renew(self, worker_id: str, step: StepRequest, lease_seconds: float) -> bool:
        """Extend ``worker_id``'s lease of a step it holds to ``lease_seconds`` from now; whether it still
        held it (``False``: the lease was lost, to another worker, or the step is no longer pending)."""
        with self._tx() as cur:
            cur.execute(
                self.sql.renew,
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
                self.sql.complete,
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
        statement = self.sql.retry if retry_at is not None else self.sql.dead
        params = (retry_at, error_text(error)) if retry_at is not None else (error_text(error),)
        with self._tx() as cur:
            cur.execute(statement, (*params, step.thread_id, step.checkpoint_ns, step.step_id, worker_id))
            return cur.rowcount == 1

    def release(self, worker_id: str) -> int:
        """Hand back what ``worker_id`` holds (the claim not counted)."""
        with self._tx() as cur:
            cur.execute(self.sql.release, (worker_id,))
            return cur.rowcount

    def retry_dead(self, *, thread_prefix: str = "") -> int:
        """Send dead steps (of threads starting with ``thread_prefix``) back to pending."""
        with self._tx() as cur:
            cur.execute(self.sql.retry_dead, (time.time(), len(thread_prefix), thread_prefix))
            return cur.rowcount

    def dead_letters(self, limit: int = 100, *, thread_prefix: str = "") -> list[DeadStep]:
        rows = self._run(self.sql.dead_letters, (len(thread_prefix), thread_prefix, limit))
        return [
            DeadStep(
                r["thread_id"],
                r["checkpoint_ns"],
                r["step_id"],
                r["attempts"],
                r["last_error"],
                r["batch_size"],
            )
            for r in rows
        ]

    def status(self, *, thread_prefix: str = "") -> dict[str, Any]:
        """Steps and messages awaiting a summary, the oldest one's age, done and dead steps."""
        now = time.time()
        rows = self._run(self.sql.status, (len(thread_prefix), thread_prefix))
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
        self._run(self.sql.delete_thread, (thread_id,))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread's steps to another thread (steps the target has already are kept).

        Under encryption each step's text and batch are opened and sealed again for the target thread (a
        ciphertext bound to the source does not open there), in the same transaction.
        """
        if self.sealer is None:
            self._run(self.sql.copy_thread, (target_thread_id, source_thread_id))
            return
        columns = [c.strip() for c in COPIED.split(",")]
        marks = ", ".join(self.sql.mark for _ in range(len(columns) + 1))
        with self._tx() as cur:
            cur.execute(self.sql.copy_rows, (source_thread_id,))
            rows = [dict(zip(columns, (row[c] for c in columns), strict=True)) for row in cur.fetchall()]
            for row in rows:
                ns, step_id = row["checkpoint_ns"], row["step_id"]
                batch = self._batch_out(row["batch"], source_thread_id, ns, step_id)
                row["batch"] = self._batch_in(batch, target_thread_id, ns, step_id)
                text = self._text_out(row["text"], source_thread_id, ns, step_id)
                row["text"] = None if text is None else self._text_in(text, target_thread_id, ns, step_id)
                cur.execute(
                    self.sql.copy_row.format(marks=marks), (target_thread_id, *(row[c] for c in columns))
                )

    def forget_orphans(self, grace_seconds: float = ORPHAN_GRACE_SECONDS) -> int:
        """Delete the steps of thread namespaces that have no checkpoint left (older than the grace)."""
        with self._tx() as cur:
            cur.execute(self.sql.forget_orphans, (time.time() - grace_seconds,))
            return cur.rowcount

    def close(self) -> None:
        """Nothing by default (a subclass closes its connections)."""
