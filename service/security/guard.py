"""``BodyGuard``: JSON bodies that are not UTF-8, nest too deep or repeat a key get 422 before anything
parses them for real; msgpack bodies go to the per-step routes only."""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reducing_saver.service.http.asgi import is_msgpack, read_body
from reducing_saver.service.http.errors import send_error
from reducing_saver.service.security.limits import Limits


class BodySizeLimit:
    """Answer 413 to bodies over ``limit`` bytes, before the app parses anything."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await send_error(send, 400, "Content-Length is not a number")
                    return
                if declared > self.limit:
                    await send_error(send, 413, self._too_large())
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await send_error(send, 413, self._too_large())

    def _too_large(self) -> str:
        return f"request body is larger than the limit of {self.limit} bytes (setting max_body_bytes)"



class _BodyTooLarge(Exception):
    pass


class BodyGuard:
    """Refuse JSON bodies that are not UTF-8, nest too deep, or repeat a key, with 422, before parsing.

    Runs inside the body size limit. It parses with orjson (fast, refuses invalid UTF-8), walks the
    containers of the result once for depth, the number of object keys and huge numbers, and counts
    ``":`` in the raw bytes: in compact JSON every key has one, so equal counts prove there is no
    duplicate; only when they differ does an exact check run. The body is then replayed unchanged.

    Ints beyond 64 bits are refused, except on the paths in ``big_int_paths`` (the store's puts, whose values
    PostgreSQL keeps exactly).

    An ``application/msgpack`` body passes untouched to the paths in ``msgpack_paths`` (whose handler
    checks it as it decodes: ``service/http/msgpack_body.py``); any other path answers it 415.
    """


    def __init__(
        self,
        app: ASGIApp,
        limits: Limits,
        msgpack_paths: frozenset[str] = frozenset(),
        big_int_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.limits = limits
        self.msgpack_paths = msgpack_paths
        self.big_int_paths = big_int_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-type":
                if is_msgpack(value):
                    if scope["path"] in self.msgpack_paths:
                        await self.app(scope, receive, send)
                    else:
                        await send_error(send, 415, self._msgpack_elsewhere())
                    return
                break
        body = await read_body(receive)
        if body is None:
            return
        problem = self.problem(body, big_ints=scope["path"] in self.big_int_paths) if body else None
        if problem is not None:
            await send_error(send, 422, [{"type": "body_refused", "loc": ["body"], "msg": problem}])
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def problem(self, body: bytes, *, big_ints: bool = False) -> str | None:
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
                return self._too_deep(">1024")
            return f"the body is not valid JSON: {exc}"
        depth, keys, huge = _shape(value)
        if depth > self.limits.max_nesting_depth:
            return self._too_deep(str(depth))
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

    def _msgpack_elsewhere(self) -> str:
        paths = ", ".join(sorted(self.msgpack_paths)) or "no path"
        return f"application/msgpack bodies are accepted on {paths}; send this request as application/json"

    def _too_deep(self, depth: str) -> str:
        return (
            f"the body nests {depth} levels of arrays and objects, more than the limit of "
            f"{self.limits.max_nesting_depth} (setting max_nesting_depth)"
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
