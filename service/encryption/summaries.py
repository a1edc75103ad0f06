"""Sealing the book of running summaries (``reducing_saver_summaries``): each step's summary ``text`` and
its ``batch`` (the cut messages it summarizes).

Both are bound to (tenant, thread, namespace, step id) and to which column they are, so a row copied to
another thread or step, or one column copied over the other, fails to open with an integrity error. A
sealed text is the string :data:`SEALED_PREFIX` + base64 (the column is text); a sealed batch is the bytes
:data:`SEALED_BATCH_PREFIX` + the envelope (a plain batch is JSON, starting with ``[``). The other columns
(ids, message ids, statuses, counts, the model's name, the prompt's hash, errors) stay plain: the book
and its claims read them in the database.
"""

from __future__ import annotations

import base64
import binascii

from reducing_saver.service.encryption.envelope import IntegrityError, key_id_of
from reducing_saver.service.encryption.saver import Sealer

# The book (storage/summaries.py) tells sealed values by these prefixes: ENVELOPE_TYPE's, with a colon.
from reducing_saver.service.storage.summaries import SEALED_BATCH_PREFIX, SEALED_PREFIX


def _context(column: str, thread_id: str, ns: str, step_id: str) -> list[str]:
    return ["summary", column, thread_id, ns, step_id]


def _where(column: str, thread_id: str, ns: str, step_id: str) -> str:
    return f"thread {thread_id!r} namespace {ns!r} summary step {step_id!r} ({column})"


def text_key_id(stored: str | None) -> str | None:
    """The key id of a sealed summary text (``None`` for a plain one, or none)."""
    if not isinstance(stored, str) or not stored.startswith(SEALED_PREFIX):
        return None
    try:
        return key_id_of(base64.b64decode(stored[len(SEALED_PREFIX) :]))
    except (binascii.Error, ValueError):
        return None


def batch_key_id(stored: bytes) -> str | None:
    """The key id of a sealed batch (``None`` for a plain one)."""
    stored = bytes(stored)
    return key_id_of(stored[len(SEALED_BATCH_PREFIX) :]) if stored.startswith(SEALED_BATCH_PREFIX) else None


def seal_text(sealer: Sealer, text: str, thread_id: str, ns: str, step_id: str) -> str:
    """A step's summary text sealed for its place."""
    envelope = sealer.cipher.seal(
        text.encode(), sealer.tenant(thread_id), _context("text", thread_id, ns, step_id)
    )
    return SEALED_PREFIX + base64.b64encode(envelope).decode()


def open_text(sealer: Sealer, stored: str | None, thread_id: str, ns: str, step_id: str) -> str | None:
    """A stored summary text opened; a plain one as it is (``migrate``) or refused (``required``).

    Raises:
        IntegrityError, UnknownKeyError, PlainTextRefused: Naming the thread and the step.
    """
    if stored is None:
        return None
    where = _where("text", thread_id, ns, step_id)
    if not stored.startswith(SEALED_PREFIX):
        return sealer.plain(stored, where)
    try:
        envelope = base64.b64decode(stored[len(SEALED_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise IntegrityError(f"{where}: integrity check failed: the stored ciphertext is malformed") from None
    context = _context("text", thread_id, ns, step_id)
    return sealer.cipher.open(envelope, sealer.tenant(thread_id), context, where).decode()


def seal_batch(sealer: Sealer, data: bytes, thread_id: str, ns: str, step_id: str) -> bytes:
    """A step's batch (JSON bytes) sealed for its place."""
    context = _context("batch", thread_id, ns, step_id)
    return SEALED_BATCH_PREFIX + sealer.cipher.seal(bytes(data), sealer.tenant(thread_id), context)


def open_batch(sealer: Sealer, stored: bytes, thread_id: str, ns: str, step_id: str) -> bytes:
    """A stored batch opened (JSON bytes); a plain one as it is (``migrate``) or refused (``required``).

    Raises:
        IntegrityError, UnknownKeyError, PlainTextRefused: Naming the thread and the step.
    """
    stored = bytes(stored)
    where = _where("batch", thread_id, ns, step_id)
    if not stored.startswith(SEALED_BATCH_PREFIX):
        return sealer.plain(stored, where)
    context = _context("batch", thread_id, ns, step_id)
    return sealer.cipher.open(stored[len(SEALED_BATCH_PREFIX) :], sealer.tenant(thread_id), context, where)


class SummarySealer:
    """What a SQL book of summaries (``storage/summaries.py``: its ``sealer``) seals and opens each step's
    ``text`` and ``batch`` with, under ``--encryption``: the functions above, bound to one ``Sealer``."""

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer

    def seal_text(self, text: str, thread_id: str, ns: str, step_id: str) -> str:
        return seal_text(self.sealer, text, thread_id, ns, step_id)

    def open_text(self, stored: str | None, thread_id: str, ns: str, step_id: str) -> str | None:
        return open_text(self.sealer, stored, thread_id, ns, step_id)

    def seal_batch(self, data: bytes, thread_id: str, ns: str, step_id: str) -> bytes:
        return seal_batch(self.sealer, data, thread_id, ns, step_id)

    def open_batch(self, stored: bytes, thread_id: str, ns: str, step_id: str) -> bytes:
        return open_batch(self.sealer, stored, thread_id, ns, step_id)
