"""Key rings for the encryption tests: fresh random keys, as JSON, as the service reads them."""

from __future__ import annotations

import base64
import json
import os


def new_key() -> str:
    """A fresh random 256-bit key, base64."""
    return base64.b64encode(os.urandom(32)).decode()


def ring_json(primary: str, **keys: str) -> str:
    """``{"primary": ..., "keys": {...}}`` as REDUCING_SAVER_ENCRYPTION_KEYS holds it."""
    return json.dumps({"primary": primary, "keys": keys})
