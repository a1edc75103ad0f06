"""reducing_saver.wire: the protocol RemoteReducingSaver and the service both speak.

Every path (a ``*_PATH`` constant), content type, the encoding of values, ints beyond 64 bits and
metadata, and the optional capabilities (:mod:`.capabilities`). It imports neither the client nor the
service: both sides import it. docs/http-api.md describes the encoding; docs/values.md the serde types
and the escaped metadata.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from typing import Any, cast, overload

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import EXCLUDED_METADATA_KEYS

from reducing_saver.wire.bodies import CheckpointFieldsBody, RunConfigBody
from reducing_saver.wire.capabilities import OPTIONAL_CAPABILITIES, saver_capabilities, with_capabilities

API_PREFIX = "/v1"
#: The per-step routes (one ``get_tuple``, about three ``put`` and two ``put_writes`` a chat turn): they
#: also take ``application/msgpack`` bodies, and the service answers them in front of its web framework.
GET_PATH = API_PREFIX + "/checkpoints/get"
PUT_PATH = API_PREFIX + "/checkpoints/put"
WRITES_PATH = API_PREFIX + "/writes/put"
PER_STEP_PATHS = (GET_PATH, PUT_PATH, WRITES_PATH)
#: A put's request header, ``kept``: every message of the parent checkpoint's messages list (as the client
#: last sent or read it) is in this put's list, so the agent removed none in the step. The service then
#: need not read the parent to find removals; without it, the service reads the parent unless this
#: process stored it. A hint about the caller's own thread only: a false one keeps removed messages from
#: that thread's memory.
PARENT_MESSAGES_HEADER = "Reducing-Saver-Parent-Messages"
PARENT_MESSAGES_KEPT = "kept"
CAPABILITIES_PATH = API_PREFIX + "/capabilities"
LIST_PATH = API_PREFIX + "/checkpoints/list"
DELTA_HISTORY_PATH = API_PREFIX + "/checkpoints/delta-history"
THREAD_DELETE_PATH = API_PREFIX + "/threads/delete"
THREAD_COPY_PATH = API_PREFIX + "/threads/copy"
THREAD_PRUNE_PATH = API_PREFIX + "/threads/prune"
RUNS_DELETE_PATH = API_PREFIX + "/runs/delete"
SWEEPS_STATUS_PATH = API_PREFIX + "/sweeps/status"
EXTRACTION_STATUS_PATH = API_PREFIX + "/extraction/status"
DEAD_LETTERS_PATH = API_PREFIX + "/extraction/dead-letters"
RETRY_DEAD_PATH = API_PREFIX + "/extraction/retry-dead"
#: Running summaries: the batches whose summary failed every attempt, and sending them back.
SUMMARY_DEAD_PATH = API_PREFIX + "/summaries/dead"
SUMMARY_RETRY_DEAD_PATH = API_PREFIX + "/summaries/retry-dead"
#: The store: ``RemoteStore``'s batch route, and LangGraph Agent Server's store routes (``langgraph_sdk``).
STORE_BATCH_PATH = "/store/batch"
STORE_ITEMS_PATH = "/store/items"
STORE_SEARCH_PATH = "/store/items/search"
STORE_NAMESPACES_PATH = "/store/namespaces"
#: Operations: liveness, readiness (both open without a key), Prometheus metrics.
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"
#: What one thread holds (``{thread_id}`` percent-encoded), and the caller's threads added up.
THREAD_STORAGE_PATH = API_PREFIX + "/threads/{thread_id}/storage"
STORAGE_PATH = API_PREFIX + "/storage"
JSON = "application/json"
MSGPACK = "application/msgpack"

#: The ``code`` of a 504 answer: the database cancelled a statement that ran past a limit set on it
#: (``statement_timeout``, ``lock_timeout``). A 504 without it comes from a proxy in front of the service.
DATABASE_TIMEOUT = "database_timeout"
#: Status -> the ``code`` every error answer with that status carries (``bodies.ErrorBody``).
ERROR_CODES = {504: DATABASE_TIMEOUT}
#: The content types the per-step routes accept and answer in.
BODY_FORMATS = (JSON, MSGPACK)
_ID_KEYS = ("thread_id", "checkpoint_ns", "checkpoint_id")
JSON_INLINE_TYPES = (str, bool, int, float)
#: The largest int JSON carries exactly (orjson refuses bigger ones).
_INT64 = (-(2**63), 2**64 - 1)
#: Serde types a client may not use for its own values: the service's (see the module docstring).
RESERVED_TYPE_PREFIX = "reducing-saver/"
#: The serde types LangGraph's ``JsonPlusSerializer`` reads (``loads_typed``), pickle aside.
STOCK_TYPES = frozenset({"null", "bytes", "bytearray", "json", "msgpack"})
#: The typed-value form of an int beyond 64 bits: its decimal digits.
INT_TYPE = RESERVED_TYPE_PREFIX + "int"
#: The escape of a user's metadata object shaped like a typed value: the object under ``"data"``.
LITERAL_TYPE = RESERVED_TYPE_PREFIX + "literal"
#: The most digits an int on the wire may have: Python's own limit for ``int(str)`` and ``str(int)``.
MAX_INT_DIGITS = 4300
_DIGITS = frozenset(b"0123456789")
_TOO_LONG = 10**MAX_INT_DIGITS


class Blob:
    """A value in its serde's form: ``(type, data)``, as ``SerializerProtocol.dumps_typed`` returns it.

    The service stores blobs verbatim; only the client that made one decodes it.
    """

    __slots__ = ("data", "type")

    def __init__(self, type: str, data: bytes) -> None:
        self.type = type
        self.data = data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Blob) and (self.type, self.data) == (other.type, other.data)

    def __hash__(self) -> int:
        return hash((self.type, self.data))

    def __repr__(self) -> str:
        return f"Blob({self.type!r}, <{len(self.data)} bytes>)"


class WireError(ValueError):
    """A body that does not follow the wire format; ``field`` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def is_inline(value: Any) -> bool:
    """True for values that travel (and PostgresSaver stores) inline: None, bool, int, float, str."""
    if value is None:
        return True
    if isinstance(value, int) and not isinstance(value, bool):
        return type(value) is int and _INT64[0] <= value <= _INT64[1]
    if type(value) is float:
        # JSON has no NaN or infinity (orjson would write null), and JSONB cannot store them.
        return math.isfinite(value)
    return type(value) in JSON_INLINE_TYPES


# -- values ---------------------------------------------------------------------------------------


def int_to_wire(value: Any) -> Blob | None:
    """The typed form (``INT_TYPE``) of an int beyond 64 bits; ``None`` for any other value.

    Raises:
        WireError: If the int has more than ``MAX_INT_DIGITS`` digits (Python cannot write it as text).
    """
    if type(value) is not int or _INT64[0] <= value <= _INT64[1]:
        return None
    try:
        return Blob(INT_TYPE, str(value).encode("ascii"))
    except ValueError:  # int_max_str_digits
        raise WireError("value", f"an int of more than {MAX_INT_DIGITS} digits cannot travel") from None


def int_from_wire(blob: Blob, field: str) -> int:
    """The int an ``INT_TYPE`` blob carries: ASCII decimal digits, optionally after a ``-``.

    Raises:
        WireError: Naming ``field``, if the data is not such digits.
    """
    data = bytes(blob.data)
    negative = data[:1] == b"-"
    digits = data[1:] if negative else data
    if not digits or len(digits) > MAX_INT_DIGITS or not _DIGITS.issuperset(digits):
        shown = bytes(data[:40]).decode("ascii", "replace")
        raise WireError(
            f"{field}.data",
            f"{shown!r} is not an integer in decimal digits "
            f"(type {INT_TYPE!r}, at most {MAX_INT_DIGITS} digits)",
        )
    return -int(digits) if negative else int(digits)


def _looks_typed(value: dict[Any, Any]) -> bool:
    """An object the wire would read as one of its own typed values: ``{"type": "reducing-saver/...", "data"}``."""
    if len(value) != 2 or "type" not in value or "data" not in value:
        return False
    type_ = value["type"]
    return type(type_) is str and type_.startswith(RESERVED_TYPE_PREFIX)


def ints_to_wire(value: Any) -> Any:
    """A JSON-like structure (checkpoint metadata) as it travels: every int beyond 64 bits in its typed
    form, every object shaped like a typed value escaped (``LITERAL_TYPE``).

    Returns ``value`` itself when it holds neither, so the common case copies nothing.
    """
    if type(value) is int:
        return int_to_wire(value) or value
    if type(value) is dict:
        converted = {key: ints_to_wire(item) for key, item in value.items()}
        if _looks_typed(value):
            return {"type": LITERAL_TYPE, "data": converted}
        return value if all(converted[key] is item for key, item in value.items()) else converted
    if type(value) is list:
        items = [ints_to_wire(item) for item in value]
        return value if all(new is old for new, old in zip(items, value, strict=True)) else items
    return value


def ints_from_wire(value: Any, field: str) -> Any:
    """A JSON-like structure as :func:`ints_to_wire` sent it: typed ints turned into ints, escaped objects
    (``LITERAL_TYPE``) into the objects they carry.

    Returns ``value`` itself when it holds neither.

    Raises:
        WireError: Naming where, for a typed int whose data is not decimal digits, or an escape whose
            data is not an object.
    """
    if _holds_no_typed(value):  # the common case: walked once, no path of a field named
        return value
    return _ints_from_wire(value, field)


def _holds_no_typed(value: Any) -> bool:
    """No object in ``value`` looks typed (``_looks_typed``): :func:`ints_from_wire` has nothing to do."""
    if type(value) is dict:
        if _looks_typed(value):
            return False
        items: Any = value.values()
    elif type(value) is list:
        items = value
    else:
        return True
    for item in items:
        if (type(item) is dict or type(item) is list) and not _holds_no_typed(item):
            return False
    return True


def _ints_from_wire(value: Any, field: str) -> Any:
    if type(value) is dict:
        if _looks_typed(value):
            if value["type"] == INT_TYPE:
                return int_from_wire(blob_from_wire(value, field), field)
            if value["type"] == LITERAL_TYPE:
                data = value["data"]
                if type(data) is not dict:
                    raise WireError(f"{field}.data", f"must be an object (type {LITERAL_TYPE!r})")
                return {key: _ints_from_wire(item, f"{field}.data.{key}") for key, item in data.items()}
        converted = {key: _ints_from_wire(item, f"{field}.{key}") for key, item in value.items()}
        return value if all(converted[key] is item for key, item in value.items()) else converted
    if type(value) is list:
        items = [_ints_from_wire(item, f"{field}[{index}]") for index, item in enumerate(value)]
        return value if all(new is old for new, old in zip(items, value, strict=True)) else items
    return value


def is_reserved_type(type_: str) -> bool:
    """True for serde types a client may not give its own values (the service's storage formats)."""
    return type_.startswith(RESERVED_TYPE_PREFIX) and type_ != INT_TYPE


def is_stock_type(type_: str) -> bool:
    """True for serde types a stock reader reads: :data:`STOCK_TYPES`, alone or as
    ``EncryptedSerializer`` writes them (``"msgpack+aes"``: the type, ``+``, a cipher name)."""
    base, plus, cipher = type_.partition("+")
    return base in STOCK_TYPES and (not plus or bool(cipher))


def blob_to_wire(type_: str, data: bytes) -> dict[str, str]:
    """A blob in a JSON body: ``{"type", "data": base64}``."""
    return {"type": type_, "data": base64.b64encode(data).decode("ascii")}


def json_default(obj: Any) -> Any:
    """orjson's ``default``: a :class:`Blob` in a JSON body."""
    if isinstance(obj, Blob):
        return blob_to_wire(obj.type, obj.data)
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


#: A run of digits as long as the shortest int orjson reads inexactly (below -2**63: 19 digits).
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def json_dumps(value: Any) -> bytes:
    """``value`` as compact JSON, :class:`Blob` values as ``{"type", "data": base64}``: orjson's bytes, or
    (for a value holding an int beyond 64 bits, which orjson cannot write) the same JSON written by Python's
    ``json``, those ints as exact numbers.

    Raises:
        TypeError: For a value JSON has no form for.
        ValueError: For NaN or an infinity (JSON has none; orjson would write ``null``) when the value also
            holds an int beyond 64 bits, or for an int of more than ``MAX_INT_DIGITS`` digits.
    """
    try:
        return orjson.dumps(value, default=json_default)
    except TypeError as exc:
        if "64-bit" not in str(exc):
            raise
    return json.dumps(
        value, default=json_default, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def json_loads(data: bytes) -> Any:
    """Parse JSON as orjson does, except that an int beyond 64 bits is read exactly, as an ``int``.

    orjson reads such an int as the nearest float; only text with a run of 19 digits can hold one, and only
    then is the text parsed again with Python's ``json``.

    Raises:
        orjson.JSONDecodeError: If ``data`` is not JSON.
    """
    value = orjson.loads(data)
    if _LONG_DIGITS.search(data) is None:
        return value
    return json.loads(data)


def unwritable(value: Any, field: str) -> tuple[str, str] | None:
    """Where a JSON-like value holds a number JSON cannot carry unchanged, and why, or ``None``.

    NaN and infinities have no JSON form (orjson writes them as ``null``, silently), and Python writes no
    int of more than ``MAX_INT_DIGITS`` digits. ``where`` is ``field`` extended with keys and indexes.
    """
    stack = [(value, field)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind is float and not math.isfinite(item):
            return where, f"{item} has no JSON form"
        if kind is int and not -_TOO_LONG < item < _TOO_LONG:
            return where, f"an int of more than {MAX_INT_DIGITS} digits cannot travel"
        if isinstance(item, Mapping):
            stack += [(child, f"{where}.{key}") for key, child in reversed(list(item.items()))]
        elif isinstance(item, (list, tuple)):
            stack += [(child, f"{where}[{index}]") for index, child in reversed(list(enumerate(item)))]
    return None


def msgpack_default(obj: Any) -> Any:
    """ormsgpack's ``default``: a :class:`Blob` in a msgpack body, its bytes a ``bin``."""
    if isinstance(obj, Blob):
        return {"type": obj.type, "data": obj.data}
    raise TypeError(f"Type is not msgpack serializable: {type(obj).__name__}")


def blob_from_wire(value: Any, field: str) -> Blob:
    """Decode ``{"type", "data"}`` (``data`` base64 text, or bytes from a msgpack body); raises
    ``WireError`` naming ``field`` on anything else."""
    if not isinstance(value, Mapping):
        raise WireError(field, f"expected an object with 'type' and 'data', got {type(value).__name__}")
    unknown = set(value) - {"type", "data"}
    if unknown:
        raise WireError(
            field, f"unknown field(s) {sorted(unknown)}; a typed value has only 'type' and 'data'"
        )
    type_, data = value.get("type"), value.get("data")
    if not isinstance(type_, str) or not type_:
        raise WireError(f"{field}.type", "must be a non-empty string")
    if isinstance(data, bytes):
        return Blob(type_, data)
    if not isinstance(data, str):
        raise WireError(f"{field}.data", "must be a base64 string")
    return Blob(type_, base64_from_wire(data, f"{field}.data"))


def base64_from_wire(data: str, field: str) -> bytes:
    """Decode strict base64; raises ``WireError`` naming ``field`` when ``data`` is not."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(field, f"is not valid base64 ({exc})") from None


def channel_value_from_wire(value: Any, field: str) -> Any:
    """An inline JSON primitive stays as it is, an ``INT_TYPE`` value becomes its int; anything else
    must be a typed blob."""
    if is_inline(value):
        return value
    blob = blob_from_wire(value, field)
    return int_from_wire(blob, field) if blob.type == INT_TYPE else blob


# -- configs --------------------------------------------------------------------------------------


@overload
def config_to_wire(config: RunnableConfig, *, namespace_key: str = ...) -> RunConfigBody: ...
@overload
def config_to_wire(config: None, *, namespace_key: str = ...) -> None: ...
def config_to_wire(
    config: RunnableConfig | None, *, namespace_key: str = "memory_namespace"
) -> RunConfigBody | None:
    """The part of a run config the service needs, in JSON.

    ``configurable`` keeps ``thread_id``, ``checkpoint_ns``, ``checkpoint_id``, the memory namespace,
    and the primitive values a saver merges into checkpoint metadata; ``metadata`` keeps its primitive
    values. An int beyond 64 bits among them travels in its typed form (``INT_TYPE``, a :class:`Blob`),
    as it would in checkpoint metadata. LangGraph's internal ``__pregel_*`` entries (callables, stores)
    stay behind.
    """
    if config is None:
        return None
    configurable: dict[str, Any] = {}
    for key, value in (config.get("configurable") or {}).items():
        if key.startswith("__"):
            continue
        if key in _ID_KEYS and value is not None:
            configurable[key] = str(value)
        elif key == namespace_key and isinstance(value, (list, tuple)):
            configurable[key] = [str(label) for label in value]
        elif is_inline(value):
            configurable[key] = value
        elif (typed := int_to_wire(value)) is not None:
            configurable[key] = typed
    wire = RunConfigBody(configurable=configurable)
    # Big ints as Blobs, which the body's encoder writes in their typed form (TypedValueBody).
    metadata: dict[str, Any] = {
        key: value if is_inline(value) else int_to_wire(value)
        for key, value in (config.get("metadata") or {}).items()
        if (is_inline(value) or int_to_wire(value) is not None)
        and not key.startswith("__")
        and key not in EXCLUDED_METADATA_KEYS
    }
    if metadata:
        wire["metadata"] = metadata
    return wire


def checkpoint_config(thread_id: str, checkpoint_ns: str, checkpoint_id: str | None) -> RunnableConfig:
    return {
        "configurable": {
            "thread_id": thread_id,
            "checkpoint_ns": checkpoint_ns,
            "checkpoint_id": checkpoint_id,
        }
    }


# -- checkpoints ----------------------------------------------------------------------------------


def checkpoint_fields(checkpoint: Mapping[str, Any]) -> CheckpointFieldsBody:
    """A checkpoint without its channel values (what travels under ``"checkpoint"``)."""
    return cast(
        CheckpointFieldsBody, {key: value for key, value in checkpoint.items() if key != "channel_values"}
    )


__all__ = [
    "API_PREFIX",
    "CAPABILITIES_PATH",
    "DATABASE_TIMEOUT",
    "DEAD_LETTERS_PATH",
    "DELTA_HISTORY_PATH",
    "ERROR_CODES",
    "EXTRACTION_STATUS_PATH",
    "GET_PATH",
    "HEALTH_PATH",
    "INT_TYPE",
    "LIST_PATH",
    "LITERAL_TYPE",
    "METRICS_PATH",
    "READY_PATH",
    "RETRY_DEAD_PATH",
    "RUNS_DELETE_PATH",
    "STORE_BATCH_PATH",
    "STORE_ITEMS_PATH",
    "STORE_NAMESPACES_PATH",
    "STORE_SEARCH_PATH",
    "SUMMARY_DEAD_PATH",
    "SUMMARY_RETRY_DEAD_PATH",
    "SWEEPS_STATUS_PATH",
    "THREAD_COPY_PATH",
    "THREAD_DELETE_PATH",
    "THREAD_PRUNE_PATH",
    "MAX_INT_DIGITS",
    "OPTIONAL_CAPABILITIES",
    "PER_STEP_PATHS",
    "PARENT_MESSAGES_HEADER",
    "PARENT_MESSAGES_KEPT",
    "PUT_PATH",
    "RESERVED_TYPE_PREFIX",
    "STORAGE_PATH",
    "STOCK_TYPES",
    "THREAD_STORAGE_PATH",
    "WRITES_PATH",
    "BODY_FORMATS",
    "JSON",
    "MSGPACK",
    "Blob",
    "WireError",
    "base64_from_wire",
    "blob_from_wire",
    "blob_to_wire",
    "channel_value_from_wire",
    "checkpoint_config",
    "checkpoint_fields",
    "config_to_wire",
    "int_from_wire",
    "int_to_wire",
    "ints_from_wire",
    "ints_to_wire",
    "is_inline",
    "is_reserved_type",
    "is_stock_type",
    "json_dumps",
    "json_loads",
    "unwritable",
    "json_default",
    "msgpack_default",
    "saver_capabilities",
    "with_capabilities",
]
