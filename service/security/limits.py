"""Input caps: the numbers (settings), the checks the request bodies run, and the request's caps.

The caps are read by the request bodies' validators (``service/http/schemas.py``) through a contextvar the
auth middleware sets, so the per-step hot path and the FastAPI routes enforce the same numbers, and the
OpenAPI document shows them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import ormsgpack
from pydantic import BaseModel, Field

from reducing_saver.service.msgpack_headers import array_length

#: Characters a thread id may not hold: C0/C1 control characters (NUL included), DEL, and the path
#: separators, since thread ids end up in URL paths (``/threads/{thread_id}`` in LangGraph tooling),
#: file names of exports and log lines.
_BAD_THREAD_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f/\\]")
#: The same rule as a JSON schema pattern, for the OpenAPI document.
THREAD_ID_SCHEMA_PATTERN = r"^[^\x00-\x1f\x7f-\x9f/\\]+$"
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
UUID_SCHEMA_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
#: Filter keys (checkpoint metadata filters and store search filters), on every backend: the rule
#: langgraph's SQLite saver and store apply since CVE-2025-67644, so one backend never refuses what
#: another serves.
_FILTER_KEY = re.compile(r"[A-Za-z0-9_.-]+")
#: Longest filter key, in characters.
MAX_FILTER_KEY_LENGTH = 256


# -- limits -----------------------------------------------------------------------------------------


class Limits(BaseModel):
    """The input caps of one app, each a setting of the same name, checked before anything is stored."""

    max_writes_per_call: int = Field(1000, ge=1, description="Most pending writes in one writes/put call.")
    max_ids_per_call: int = Field(
        1000, ge=1, description="Most thread ids (threads/prune) or run ids (runs/delete) in one call."
    )
    max_list_limit: int = Field(
        1000, ge=1, description="Largest `limit` a checkpoints/list call may ask for."
    )
    max_nesting_depth: int = Field(
        32, ge=4, description="Deepest nesting of arrays and objects in a JSON body."
    )
    max_thread_id_length: int = Field(256, ge=1, description="Longest thread id, in characters.")
    max_channels: int = Field(
        1000, ge=1, description="Most channels in a checkpoint's values, versions or a delta-history call."
    )
    max_messages_per_put: int = Field(
        10000, ge=1, description="Most entries in the messages channel list of one checkpoint put."
    )


# Nothing assigns to a Limits' fields: the shared default is read-only.
_limits: ContextVar[Limits] = ContextVar("reducing_saver_limits", default=Limits())  # noqa: B039


def current_limits() -> Limits:
    """The caps of the app handling the current request (the defaults outside a request)."""
    return _limits.get()


class LimitError(ValueError):
    """An input is over a cap; the message names the field, the cap and its setting."""


def over_cap(field: str, what: str, count: int, setting: str) -> LimitError:
    cap = getattr(current_limits(), setting)
    return LimitError(f"{field}: {count} {what} is more than the limit of {cap} (setting {setting})")


def check_count(value: Any, field: str, what: str, setting: str) -> Any:
    """``value`` when it is not a list/dict longer than the cap ``setting``; for BeforeValidators."""
    if isinstance(value, (list, dict)) and len(value) > getattr(current_limits(), setting):
        raise over_cap(field, what, len(value), setting)
    return value


def check_thread_id(value: str, field: str = "thread_id") -> str:
    """Refuse thread ids that are too long, hold control characters or path separators, or are ``.``/``..``."""
    cap = current_limits().max_thread_id_length
    if len(value) > cap:
        raise LimitError(
            f"{field}: {len(value)} characters is more than the limit of {cap} (setting max_thread_id_length)"
        )
    if match := _BAD_THREAD_CHARS.search(value):
        raise ValueError(
            f"{field}: character {match.group()!r} at index {match.start()} is not allowed in a thread id "
            "(no control characters, NUL, '/' or '\\')"
        )
    if value in (".", ".."):
        raise ValueError(f"{field}: {value!r} is not a thread id")
    return value


def check_checkpoint_id(value: str, field: str = "checkpoint_id") -> str:
    if not _UUID.fullmatch(value):
        raise ValueError(
            f"{field}: {value[:64]!r} is not a UUID (checkpoint ids are LangGraph's uuid6 strings)"
        )
    return value


def check_limit(value: int | None) -> int | None:
    cap = current_limits().max_list_limit
    if value is not None and value > cap:
        raise LimitError(f"limit: {value} is more than the limit of {cap} (setting max_list_limit)")
    return value


def check_configurable(configurable: dict[str, Any]) -> dict[str, Any]:
    """The ids of a run config's ``configurable``: thread id rules, checkpoint id a UUID."""
    for key in configurable:
        if key.startswith("__"):
            first = min(key for key in configurable if key.startswith("__"))
            raise ValueError(f"configurable.{first[:64]}: keys starting with '__' are reserved")
    thread_id = configurable.get("thread_id")
    if isinstance(thread_id, str) and thread_id:
        check_thread_id(thread_id, "configurable.thread_id")
    checkpoint_id = configurable.get("checkpoint_id")
    if checkpoint_id is not None and checkpoint_id != "":
        if not isinstance(checkpoint_id, str):
            raise ValueError("configurable.checkpoint_id: must be a string (a UUID)")
        check_checkpoint_id(checkpoint_id, "configurable.checkpoint_id")
    return configurable


def check_filter_keys(filter: dict[str, Any] | None, field: str) -> dict[str, Any] | None:
    """``filter`` when every key is 1 to 256 letters, digits, ``_``, ``.`` or ``-`` (ASCII); else a
    ``ValueError`` naming ``field`` and the key."""
    for key in filter or ():
        if not isinstance(key, str) or len(key) > MAX_FILTER_KEY_LENGTH or not _FILTER_KEY.fullmatch(key):
            shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
            nul = " (it holds a NUL character, U+0000)" if isinstance(key, str) and "\x00" in key else ""
            raise ValueError(
                f"{field}: key {shown} is refused{nul}; a filter key is 1 to {MAX_FILTER_KEY_LENGTH} ASCII "
                "letters, digits, '_', '.' and '-'"
            )
    return filter


def documented(**keywords: str) -> Callable[[dict[str, Any]], None]:
    """A ``json_schema_extra`` that writes the current caps into a schema: ``maxItems="max_channels"``."""

    def extra(schema: dict[str, Any]) -> None:
        limits = current_limits()
        for keyword, setting in keywords.items():
            schema[keyword] = getattr(limits, setting)

    return extra


def check_messages_value(type_: str, raw: bytes, field: str) -> None:
    """Refuse a messages channel blob the service would have to store broken or oversized.

    Only ``msgpack`` blobs are looked at (another serde's bytes, e.g. encrypted ones, are stored as sent;
    so is a DeltaChannel snapshot, ext 7 as the whole value). The bytes must be well-formed msgpack, and a
    top-level list may hold at most ``max_messages_per_put`` entries. Extension payloads are not opened
    here: :class:`~reducing_saver.service.messages_codec.SafeMessagesCodec` does that without importing
    anything.
    """
    if type_ != "msgpack":
        return
    if raw[:1] and raw[0] in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8, 0xC7, 0xC8, 0xC9):
        return  # a top-level extension: the codec decides (snapshots are stored as sent)
    count = array_length(raw)
    cap = current_limits().max_messages_per_put
    if count is not None and count > cap:
        raise over_cap(field, "messages", count, "max_messages_per_put")
    try:
        ormsgpack.unpackb(raw, ext_hook=_skip_ext)
    except Exception as exc:
        raise ValueError(f"{field}: the data is not valid msgpack ({exc})") from None


def _skip_ext(code: int, data: bytes) -> None:
    return None
