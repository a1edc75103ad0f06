"""Reading an ``application/msgpack`` request body without trusting it.

The per-step routes take msgpack bodies of the same structure as their JSON ones, except that a typed
value's ``data`` is a ``bin`` (the serde's bytes) instead of base64 text. The body is decoded once, by
msgpack's C unpacker, into plain dicts, lists, strings, numbers and bytes; the hooks below refuse, with
the reason the 422 names:

* any extension type: extension codes are how LangGraph's serde names classes to import, and the body's
  own structure never needs one (the serde bytes inside a ``bin`` are the codec's business);
* a map key that is not a string, or a key repeated in one map;
* bytes anywhere but as the ``data`` of a ``{"type", "data"}`` map;
* a NaN or infinite float (JSON has none, and PostgreSQL's JSONB cannot store them).

Truncated input, trailing bytes, invalid UTF-8 and nesting deeper than ``max_nesting_depth`` are
refused too. The result then goes through the same checks as a JSON body (``schemas.validated``).
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from reducing_saver.service import security


class MsgpackBodyError(ValueError):
    """The body was refused; the message says why."""


def decode(body: bytes, limits: security.Limits) -> Any:
    """The body's value, or :class:`MsgpackBodyError` naming what is wrong with it."""
    hooks = _Hooks()
    try:
        value = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=hooks.map,
            list_hook=hooks.list,
            ext_hook=_extension,
        )
    except MsgpackBodyError:
        raise
    except msgpack.StackError:
        raise MsgpackBodyError(_too_deep(">1024", limits)) from None
    except msgpack.ExtraData:
        raise MsgpackBodyError("the body holds bytes after its msgpack value; send one value") from None
    except UnicodeDecodeError as exc:
        raise MsgpackBodyError(f"the body holds a string that is not UTF-8 ({exc.reason})") from None
    except ValueError as exc:
        raise MsgpackBodyError(f"the body is not valid msgpack: {exc or type(exc).__name__}") from None
    # Nesting never exceeds the number of arrays and maps: only a body holding more than the limit is walked.
    if hooks.containers > limits.max_nesting_depth:
        depth = security.nesting_depth(value)
        if depth > limits.max_nesting_depth:
            raise MsgpackBodyError(_too_deep(str(depth), limits))
    return value


def _too_deep(depth: str, limits: security.Limits) -> str:
    return (
        f"the body nests {depth} levels of arrays and maps, more than the limit of "
        f"{limits.max_nesting_depth} (setting max_nesting_depth)"
    )


def _extension(code: int, data: bytes) -> Any:
    raise MsgpackBodyError(
        f"the body holds a msgpack extension (code {code}); the body's structure has none: send the "
        "serde's bytes as the bin 'data' of a typed value"
    )


class _Hooks:
    """One decode's map and array hooks; they count the containers they see."""

    __slots__ = ("containers",)

    def __init__(self) -> None:
        self.containers = 0

    def map(self, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
        self.containers += 1
        result: dict[str, Any] = {}
        for key, value in pairs:
            if type(key) is not str:
                raise MsgpackBodyError(
                    f"the body has a map key of type {type(key).__name__}; keys must be strings"
                )
            if key in result:
                raise MsgpackBodyError(
                    f"the body repeats the key {key[:100]!r} in one map; send each key once"
                )
            kind = type(value)
            if kind is bytes and key != "data":
                raise MsgpackBodyError(
                    f"the body holds bytes under {key[:100]!r}; bytes are only a typed value's 'data'"
                )
            if kind is float and not math.isfinite(value):
                raise MsgpackBodyError(f"the body holds {value} under {key[:100]!r}; floats must be finite")
            result[key] = value
        if type(result.get("data")) is bytes and result.keys() != {"type", "data"}:
            raise MsgpackBodyError("bytes are only the 'data' of a map with exactly 'type' and 'data'")
        return result

    def list(self, items: list[Any]) -> list[Any]:
        self.containers += 1
        for item in items:
            kind = type(item)
            if kind is bytes:
                raise MsgpackBodyError(
                    "the body holds bytes in an array; bytes are only a typed value's 'data'"
                )
            if kind is float and not math.isfinite(item):
                raise MsgpackBodyError(f"the body holds {item} in an array; floats must be finite")
        return items
