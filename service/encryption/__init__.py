"""Encryption at rest (``--encryption``): the key ring, the envelope, and the saver that seals values.

See docs/encryption.md for the modes, the key ring's format, rotation, and what is and is not encrypted.
"""

from reducing_saver.service.encryption.envelope import (
    Cipher,
    IntegrityError,
    PlainTextRefused,
    StoredDataError,
    UnknownKeyError,
)
from reducing_saver.service.encryption.keys import KeyRing, KeyRingError, load_keyring, parse_keyring
from reducing_saver.service.encryption.saver import (
    ENVELOPE_TYPE,
    PLAIN_METADATA_KEYS,
    EncryptingSaver,
    Sealer,
    encrypting,
)

__all__ = [
    "ENVELOPE_TYPE",
    "PLAIN_METADATA_KEYS",
    "Cipher",
    "EncryptingSaver",
    "IntegrityError",
    "KeyRing",
    "KeyRingError",
    "PlainTextRefused",
    "Sealer",
    "StoredDataError",
    "UnknownKeyError",
    "encrypting",
    "load_keyring",
    "parse_keyring",
]
