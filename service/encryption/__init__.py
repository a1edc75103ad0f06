"""Encryption at rest (``--encryption``): the key ring, the envelope, and the saver that seals values.

See docs/encryption.md for the modes, the key ring's format, rotation, and what is and is not encrypted.
"""

import functools
from typing import Any

from reducing_saver.service.encryption.envelope import (
    Cipher,
    IntegrityError,
    PlainTextRefused,
    UnknownKeyError,
)
from reducing_saver.service.encryption.keyless import KeylessSaver, keyless
from reducing_saver.service.encryption.keys import KeyRing, KeyRingError, load_keyring, parse_keyring
from reducing_saver.service.encryption.saver import (
    ENVELOPE_TYPE,
    PLAIN_METADATA_KEYS,
    EncryptingSaver,
    Sealer,
    encrypting,
)
from reducing_saver.service.storage import EncryptedValueRefused, StoredDataError


@functools.lru_cache(maxsize=8)
def _sealer(ring: KeyRing, mode: str, tenant_mode: bool) -> Sealer:
    return Sealer(Cipher(ring), mode, tenant_mode=tenant_mode)  # type: ignore[arg-type]


def sealer_for(settings: Any, *, tenant_mode: bool) -> Sealer | None:
    """The sealer of ``settings`` (``--encryption`` and its key ring), or ``None`` when it is off.

    One per key ring and mode in a process, so its derived keys are computed once.
    """
    if getattr(settings, "encryption", "off") == "off":
        return None
    return _sealer(settings.keyring, settings.encryption, tenant_mode)


__all__ = [
    "ENVELOPE_TYPE",
    "PLAIN_METADATA_KEYS",
    "Cipher",
    "EncryptedValueRefused",
    "EncryptingSaver",
    "IntegrityError",
    "KeyRing",
    "KeyRingError",
    "KeylessSaver",
    "PlainTextRefused",
    "Sealer",
    "StoredDataError",
    "UnknownKeyError",
    "encrypting",
    "keyless",
    "load_keyring",
    "parse_keyring",
    "sealer_for",
]
