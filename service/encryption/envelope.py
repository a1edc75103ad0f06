"""The envelope: AES-256-GCM over one stored value, bound to where the value belongs.

An envelope is ``version (1 byte) | key id length (1 byte) | key id | nonce (12 bytes) | ciphertext+tag``.
The nonce is random per value (``os.urandom``). The associated data is the header (version and key id)
followed by the value's *context*: a JSON array naming what the value is and where it lives (tenant,
thread, namespace, channel, version for a checkpoint value; checkpoint, task and index for a pending
write; ...). Opening it under any other context, or after any byte changed, fails the tag check.

Each tenant gets keys of its own, derived from the ring's keys with HKDF-SHA256 (the tenant's name in
the info), so one tenant's ciphertext never opens under another's context even before the context check.

A :class:`Cipher` remembers the plaintexts of the envelopes it opened, and of those it sealed to be
read back soon (``remember=True``: channel values, outbox messages), most recently first
(:data:`REMEMBERED_BYTES`), by context: opening an envelope it remembers, byte for byte under the same
context, returns the plaintext without decrypting. A request's AES call costs little for its bytes but
much for its first touch of the cipher's code and tables (about 20 µs cold, against 2 µs warm), and
most reads are of what the same process wrote moments before (the latest checkpoint, outbox rows the
deliverer claims). Any other envelope, a changed byte included, is decrypted and checked as usual.

Nonces come from ``os.urandom`` a few hundred at a time (one system call for many values, measured in
the service: 3-9 µs less per sealing request), per thread; a forked child drops what its parent read.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from reducing_saver.service.encryption.keys import KeyRing

FORMAT_VERSION = 1
NONCE_BYTES = 12
_SALT = b"reducing-saver encryption v1"
#: The plaintexts (and their envelopes) a :class:`Cipher` remembers, at most, in bytes.
REMEMBERED_BYTES = 32 << 20
_NONCES_READ = 256  # nonces per os.urandom call


class _Nonces(threading.local):
    """Random nonces, read from ``os.urandom`` :data:`_NONCES_READ` at a time, per thread."""

    def __init__(self) -> None:
        self.pool = b""
        self.used = 0

    def take(self) -> bytes:
        if self.used >= len(self.pool):
            self.pool, self.used = os.urandom(NONCE_BYTES * _NONCES_READ), 0
        nonce = self.pool[self.used : self.used + NONCE_BYTES]
        self.used += NONCE_BYTES
        return nonce


_nonces = _Nonces()


def _forget_nonces() -> None:  # a forked child must not use the nonces its parent read
    global _nonces
    _nonces = _Nonces()


os.register_at_fork(after_in_child=_forget_nonces)


class StoredDataError(Exception):
    """A stored value cannot be read as the encryption mode demands; the message names where it lives."""


class IntegrityError(StoredDataError):
    """A ciphertext failed authentication: changed, truncated, or moved from another place or tenant."""


class UnknownKeyError(StoredDataError):
    """A ciphertext names a key id the ring no longer has."""


class PlainTextRefused(StoredDataError):
    """``--encryption required`` met a value stored in plain text."""


def key_id_of(envelope: bytes) -> str | None:
    """The key id an envelope names, or ``None`` when it is not a well-formed envelope header."""
    if len(envelope) < 2 or envelope[0] != FORMAT_VERSION or len(envelope) < 2 + envelope[1] + NONCE_BYTES:
        return None
    try:
        return envelope[2 : 2 + envelope[1]].decode("ascii")
    except UnicodeDecodeError:
        return None


class _Remembered:
    """Envelope and plaintext by context, least recently used first out past ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, context: bytes, envelope: bytes) -> bytes | None:
        with self._lock:
            entry = self._entries.get(context)
            if entry is None or entry[0] != envelope:
                return None
            self._entries.move_to_end(context)
            return entry[1]

    def put(self, context: bytes, envelope: bytes, plaintext: bytes) -> None:
        size = len(context) + len(envelope) + len(plaintext)
        if size > self.limit:
            return
        with self._lock:
            old = self._entries.pop(context, None)
            if old is not None:
                self._bytes -= len(context) + len(old[0]) + len(old[1])
            self._entries[context] = (envelope, plaintext)
            self._bytes += size
            while self._bytes > self.limit:
                key, (sealed, plain) = self._entries.popitem(last=False)
                self._bytes -= len(key) + len(sealed) + len(plain)


class Cipher:
    """Seals and opens values with a key ring, per tenant, each bound to its context.

    Args:
        ring: The key ring; new envelopes use its primary key.
        remember_bytes: How many bytes of recent envelopes and plaintexts to remember (0: none).
    """

    def __init__(self, ring: KeyRing, *, remember_bytes: int = REMEMBERED_BYTES) -> None:
        self.ring = ring
        self._aead = functools.lru_cache(maxsize=4096)(self._derive)
        self._remembered = _Remembered(remember_bytes)

    def __repr__(self) -> str:
        return f"Cipher({self.ring!r})"

    def _derive(self, key_id: str, tenant: str) -> AESGCM:
        key = self.ring.key(key_id)
        assert key is not None
        info = b"tenant:" + tenant.encode()
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(key)
        return AESGCM(derived)

    @staticmethod
    def _context(tenant: str, context: Sequence[object]) -> bytes:
        return orjson.dumps([tenant, *context])

    def seal(self, plaintext: bytes, tenant: str, context: Sequence[object], *, remember: bool = False) -> bytes:
        """An envelope of ``plaintext`` under the primary key, bound to ``tenant`` and ``context``.

        Args:
            remember: Keep the plaintext for opening this envelope without decrypting (a value this
                process will likely read back soon).
        """
        key_id = self.ring.primary
        header = bytes((FORMAT_VERSION, len(key_id))) + key_id.encode("ascii")
        nonce = _nonces.take()
        bound = self._context(tenant, context)
        envelope = header + nonce + self._aead(key_id, tenant).encrypt(nonce, plaintext, header + bound)
        if remember:
            self._remembered.put(bound, envelope, plaintext)
        return envelope

    def open(self, envelope: bytes, tenant: str, context: Sequence[object], where: str) -> bytes:
        """The plaintext of an envelope sealed under ``tenant`` and ``context``.

        Args:
            where: What the value is, for errors (e.g. ``"thread 'a' channel 'x'"``).

        Raises:
            IntegrityError: If the envelope is malformed, changed, or sealed for another context.
            UnknownKeyError: If it names a key id the ring does not hold.
        """
        bound = self._context(tenant, context)
        remembered = self._remembered.get(bound, envelope)
        if remembered is not None:
            return remembered
        key_id = key_id_of(envelope)
        if key_id is None:
            raise IntegrityError(f"{where}: integrity check failed: the stored ciphertext is malformed")
        if self.ring.key(key_id) is None:
            raise UnknownKeyError(
                f"{where}: encrypted under key id {key_id!r}, which the key ring does not hold "
                f"(it holds {', '.join(self.ring.key_ids)})"
            )
        start = 2 + len(key_id)
        header, nonce, sealed = envelope[:start], envelope[start : start + NONCE_BYTES], envelope[start + NONCE_BYTES :]
        try:
            plaintext = self._aead(key_id, tenant).decrypt(nonce, sealed, header + bound)
        except InvalidTag:
            raise IntegrityError(
                f"{where}: integrity check failed: the stored ciphertext was changed, or copied from "
                "another place"
            ) from None
        self._remembered.put(bound, bytes(envelope), plaintext)
        return plaintext
