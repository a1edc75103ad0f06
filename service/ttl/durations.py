"""Durations as people write them: ``90``, ``90s``, ``15m``, ``2h``, ``7d``, ``1h30m``.

Used by the TTL settings (``--default-ttl``, ``--sweep-interval``) and by a put's
``config["configurable"]["checkpoint_ttl"]``. Kept apart from ``sweeper`` so that ``settings`` can import
it without importing the service.
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_SECONDS", "format_duration", "parse_duration"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd])")
_WHOLE = re.compile(r"(?:\s*(?:\d+(?:\.\d*)?|\.\d+)\s*[smhd])+\s*")
_HINT = "a duration such as 90s, 15m, 2h, 7d or 1h30m (a bare number is seconds)"
#: The longest duration accepted: 100 years (PostgreSQL intervals overflow long before a float does).
MAX_SECONDS = 36500 * 86400.0


def parse_duration(value: object, *, name: str = "duration") -> float:
    """Seconds in ``value``: a positive number of seconds, or a string of numbers with ``s``, ``m``, ``h``
    or ``d`` suffixes (``"1h30m"``); a string without a suffix is seconds. At most 100 years.

    Args:
        value: What was given.
        name: What the value is for, named in the error.

    Raises:
        ValueError: If ``value`` is not a positive, finite duration; the message names ``name``.
    """
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            if _WHOLE.fullmatch(text):
                seconds = sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(text))
    if seconds is None:
        raise ValueError(f"{name} must be {_HINT}, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive duration, got {value!r}")
    if seconds > MAX_SECONDS:
        raise ValueError(f"{name} must be at most 36500d (100 years), got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that divides it: ``604800`` -> ``"7d"``, ``90`` -> ``"90s"``."""
    for unit in ("d", "h", "m"):
        size = _UNITS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
