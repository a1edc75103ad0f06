"""How a long-term memory item holds a message whose text contains the NUL character (U+0000).

Tool output does contain NUL, and PostgreSQL's ``jsonb`` (``PostgresStore``'s value column) and ``text``
cannot hold it. The service's default extractor therefore stores the value of such a message escaped,
losslessly, and says so in the item; every other item is stored as it is:

* every string of the value, keys included, has ``\\`` written as ``\\\\`` and U+0000 as ``\\0``;
* the value gets the key ``"nul_escaped": true``.

:func:`decode_memory_value` gives the original value back (and any other value unchanged), so readers
call it on every item they read. The escape is applied on every backend, so an item looks the same
whatever the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast

#: The key marking a value whose strings are escaped.
NUL_ESCAPED = "nul_escaped"

_UNESCAPE = re.compile(r"\\(\\|0)")


def holds_nul(value: Any) -> bool:
    """Whether a JSON-like value has U+0000 in any string or key."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(holds_nul(item) for item in value)
    return False


def _map_strings(value: Any, text: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {
            text(key) if isinstance(key, str) else key: _map_strings(item, text)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, text) for item in value]
    return value


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\x00", "\\0")


def _unescape(text: str) -> str:
    return _UNESCAPE.sub(lambda match: "\\" if match.group(1) == "\\" else "\x00", text)


def encode_memory_value(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` as a store can hold it: unchanged without NUL, else escaped and marked.

    Args:
        value: A store item's value (a JSON object).

    Returns:
        ``value`` itself, or an escaped copy with ``"nul_escaped": True``.
    """
    if not holds_nul(value):
        return value
    return {**_map_strings(value, _escape), NUL_ESCAPED: True}


def decode_memory_value(value: dict[str, Any]) -> dict[str, Any]:
    """The original value of a long-term memory item the service stored (any store item is safe).

    Args:
        value: ``item.value`` as read from the store.

    Returns:
        The value with its strings unescaped and without the marker when it is marked
        ``"nul_escaped": True``; otherwise ``value`` unchanged.
    """
    if value.get(NUL_ESCAPED) is not True:
        return value
    unmarked = {key: item for key, item in value.items() if key != NUL_ESCAPED}
    return cast(dict[str, Any], _map_strings(unmarked, _unescape))  # a dict maps to a dict


__all__ = ["NUL_ESCAPED", "decode_memory_value", "encode_memory_value", "holds_nul"]
