"""The book of running summaries in one process (``memory://``): the reducer's dict, with claims and dead
letters; the same contract as the SQL books (``storage/summaries.py``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from reducing_saver.reducer import MemorySummaryBook, StepRequest
from reducing_saver.service.storage.outbox import error_text
from reducing_saver.service.storage.summaries import ORPHAN_GRACE_SECONDS, ClaimedStep, DeadStep, batch_data


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
