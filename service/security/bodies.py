"""What a JSON body may look like before anything parses it for real: UTF-8, nested no deeper than
``max_nesting_depth``, each key once per object, integers within 64 bits (``http/guard.py``'s
``BodyGuard`` answers 422 with the reason)."""

from __future__ import annotations

import json
from typing import Any

import orjson


def json_body_problem(body: bytes, max_nesting_depth: int, *, big_ints: bool = False) -> str | None:
    """Why ``body`` is refused, or ``None`` (``big_ints``: the route takes ints beyond 64 bits)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if b"\x00" not in body:
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as err:
                return f"the body is not UTF-8 (invalid byte at {err.start}); JSON bodies must be UTF-8"
        if "recursion" in str(exc).lower() or "depth limit" in str(exc).lower():
            return _too_deep(max_nesting_depth, ">1024")
        return f"the body is not valid JSON: {exc}"
    depth, keys, huge = _shape(value)
    if depth > max_nesting_depth:
        return _too_deep(max_nesting_depth, str(depth))
    # Compact JSON (what clients send) has one `":` per key, plus any inside string values: equal
    # counts prove there is no duplicate. Otherwise (a duplicate, `"a" : 1` spacing, a string holding
    # `":`) the exact check decides.
    if keys and body.count(b'":') != keys:
        duplicate = _first_duplicate_key(body)
        if duplicate is not None:
            return f"the body repeats the key {duplicate[:100]!r} in one object; send each key once"
    # orjson reads an integer beyond 64 bits as a float, pydantic as an exact int that msgpack and
    # orjson then fail to write (a 500): only a float that large can be one, so only then look exactly.
    if huge and not big_ints and (number := _out_of_range_int(body)) is not None:
        return f"the body holds the integer {number[:40]}, outside the 64-bit range"
    return None


def _too_deep(limit: int, depth: str) -> str:
    return (
        f"the body nests {depth} levels of arrays and objects, more than the limit of "
        f"{limit} (setting max_nesting_depth)"
    )


def nesting_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON or msgpack) nests lists and dicts (a scalar: 0)."""
    return _shape(value)[0]


def _shape(value: Any) -> tuple[int, int, bool]:
    """``(nesting depth, number of object keys, holds a float of 64-bit magnitude)`` of parsed JSON."""
    if type(value) is not dict and type(value) is not list:
        return 0, 0, type(value) is float and abs(value) >= _BIG
    depth = keys = 0
    huge = False
    stack: list[tuple[Any, int]] = [(value, 1)]
    push, pop = stack.append, stack.pop
    while stack:
        item, level = pop()
        depth = max(depth, level)
        if type(item) is dict:
            keys += len(item)
            item = item.values()
        for child in item:
            kind = type(child)
            if kind is dict or kind is list:
                push((child, level + 1))
            elif kind is float and (child >= _BIG or child <= -_BIG):
                huge = True
    return depth, keys, huge


_BIG = float(2**63)


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


class _BigInt(Exception):
    def __init__(self, text: str) -> None:
        self.text = text


def _checked_int(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise _BigInt(text)
    return value


def _out_of_range_int(body: bytes) -> str | None:
    try:
        json.loads(body, parse_int=_checked_int)
    except _BigInt as big:
        return big.text
    except (ValueError, RecursionError):
        return None
    return None


def _first_duplicate_key(body: bytes) -> str | None:
    try:
        json.loads(body, object_pairs_hook=_no_duplicates)
    except _Duplicate as dup:
        return dup.key
    except (ValueError, RecursionError):
        return None
    return None
