"""The encryption key ring: key ids and 256-bit keys, one primary for writing, the others for reading.

``REDUCING_SAVER_ENCRYPTION_KEYS`` holds the ring as JSON, or the path of a file holding the same JSON::

    {"primary": "2026-01", "keys": {"2026-01": "<base64 of 32 bytes>", "2025-07": "<base64 ...>"}}

A key is never printed: :class:`KeyRing`'s ``repr`` names only the key ids, and every error names the
key id or the field that is wrong, never a key's value.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Mapping
from typing import Any

#: Key ids: short, printable, safe in a header and a metric label.
KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_BYTES = 32


class KeyRingError(ValueError):
    """The key ring is malformed; the message names what is wrong and never a key."""


class KeyRing:
    """Key ids -> 32-byte keys, and the primary key id (the one new ciphertext is written under)."""

    def __init__(self, primary: str, keys: Mapping[str, bytes]) -> None:
        if primary not in keys:
            raise KeyRingError(f"encryption keys: the primary key id {primary!r} is not among the keys")
        self.primary = primary
        self._keys = dict(keys)

    def __repr__(self) -> str:
        return f"KeyRing(primary={self.primary!r}, key_ids={sorted(self._keys)!r})"

    __str__ = __repr__

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def key(self, key_id: str) -> bytes | None:
        """The key of ``key_id``, or ``None`` when the ring lacks it."""
        return self._keys.get(key_id)


def _decode_key(key_id: str, value: Any) -> bytes:
    if not isinstance(value, str):
        raise KeyRingError(f"encryption keys: key {key_id!r} must be a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise KeyRingError(f"encryption keys: key {key_id!r} is not valid base64") from None
    if len(raw) != KEY_BYTES:
        raise KeyRingError(
            f"encryption keys: key {key_id!r} is {len(raw)} bytes; AES-256 needs {KEY_BYTES} "
            "(generate one with: openssl rand -base64 32)"
        )
    return raw


def parse_keyring(document: Any) -> KeyRing:
    """A :class:`KeyRing` from the parsed JSON document.

    Raises:
        KeyRingError: Naming the field or key id that is wrong.
    """
    if not isinstance(document, dict) or set(document) != {"primary", "keys"}:
        raise KeyRingError('encryption keys: expected a JSON object {"primary": "<key id>", "keys": {...}}')
    primary, keys = document["primary"], document["keys"]
    if not isinstance(keys, dict) or not keys:
        raise KeyRingError('encryption keys: "keys" must be a non-empty object of key id -> base64 key')
    if not isinstance(primary, str):
        raise KeyRingError('encryption keys: "primary" must be a key id (a string)')
    decoded = {}
    for key_id, value in keys.items():
        if not KEY_ID.fullmatch(key_id):
            raise KeyRingError(
                f"encryption keys: key id {key_id[:70]!r} must be 1-64 characters of letters, digits, _ . -"
            )
        decoded[key_id] = _decode_key(key_id, value)
    return KeyRing(primary, decoded)


def load_keyring(source: str) -> KeyRing:
    """The key ring from JSON text, or from the file at the path ``source`` names.

    Raises:
        KeyRingError: For a missing file, text that is not JSON, or a malformed ring (never quoting it).
    """
    text = source.strip()
    if not text.startswith("{"):
        try:
            with open(os.path.expanduser(text), encoding="utf-8") as file:
                text = file.read()
        except OSError as exc:
            raise KeyRingError(f"encryption keys: cannot read the key file: {exc.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        # The position only: the message of a JSON error may quote the text, keys included.
        raise KeyRingError(
            f"encryption keys: not valid JSON (line {exc.lineno}, column {exc.colno})"
        ) from None
    return parse_keyring(document)
