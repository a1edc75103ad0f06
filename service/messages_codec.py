"""Read a client's serialized messages channel without importing or calling anything it names.

``SafeMessagesCodec`` decodes the msgpack of a messages list with its own ``ext_hook``: code 5 naming an
allowed message class becomes an ``EncodedMessage`` (its ``model_dump()`` dict and the untouched payload,
which is what gets written back, byte-identical); inside a message, only the standard types of
``SAFE_VALUE_TYPES``, built from this module's own table; anything else raises ``UnsafeMessagesError``.
A DeltaChannel snapshot, or a value it cannot read, comes back as ``None`` (stored unreduced).
docs/http-api.md describes what is accepted.
"""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import ipaddress
import logging
import pathlib
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ormsgpack
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ChatMessageChunk,
    FunctionMessage,
    FunctionMessageChunk,
    HumanMessage,
    HumanMessageChunk,
    RemoveMessage,
    SystemMessage,
    SystemMessageChunk,
    ToolMessage,
    ToolMessageChunk,
)
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from reducing_saver.service.msgpack_headers import array_length
from reducing_saver.wire import Blob

#: Serializes the messages the service writes itself (never reads anything).
_WRITER = JsonPlusSerializer()

__all__ = [
    "DEFAULT_MESSAGE_CLASSES",
    "MAX_NESTED_MESSAGES",
    "MAX_NESTED_VALUES",
    "SAFE_VALUE_TYPES",
    "EncodedMessage",
    "SafeMessagesCodec",
    "UnsafeMessagesError",
    "to_message",
]

logger = logging.getLogger(__name__)

# LangGraph's extension codes (langgraph.checkpoint.serde.jsonplus).
EXT_PYDANTIC_V2 = 5
EXT_NUMPY_ARRAY = 6
EXT_DELTA_SNAPSHOT = 7
_CALLING_CODES = {
    0: "constructor call",
    1: "constructor call",
    2: "constructor call",
    3: "method call",
    4: "pydantic v1 model",
}
_OTHER_CODES = {EXT_NUMPY_ARRAY: "numpy array", EXT_DELTA_SNAPSHOT: "DeltaChannel snapshot"}

#: How deep messages may nest inside a message's fields before the value counts as unreadable. JsonPlus
#: never nests them (``model_dump()`` turns nested models into dicts). The bound is about the C stack:
#: ormsgpack allows 1024 levels per ``unpackb`` call, ~550 bytes each, and every nested payload is one
#: more call, so the worst value this codec walks needs about 2.5 MB of stack (a thread's default is 8 MB
#: on glibc; musl's 128 KB cannot even hold one ormsgpack call at full depth).
MAX_NESTED_MESSAGES = 2

# (module, class name) as they appear in payloads, mapped to our own classes. The module names are those
# of langgraph.checkpoint.serde._msgpack.SAFE_MSGPACK_TYPES; to_message never imports what a payload names.
_MESSAGE_CLASSES: dict[tuple[str, str], type[BaseMessage]] = {
    ("langchain_core.messages.system", "SystemMessage"): SystemMessage,
    ("langchain_core.messages.system", "SystemMessageChunk"): SystemMessageChunk,
    ("langchain_core.messages.human", "HumanMessage"): HumanMessage,
    ("langchain_core.messages.human", "HumanMessageChunk"): HumanMessageChunk,
    ("langchain_core.messages.ai", "AIMessage"): AIMessage,
    ("langchain_core.messages.ai", "AIMessageChunk"): AIMessageChunk,
    ("langchain_core.messages.tool", "ToolMessage"): ToolMessage,
    ("langchain_core.messages.tool", "ToolMessageChunk"): ToolMessageChunk,
    ("langchain_core.messages.chat", "ChatMessage"): ChatMessage,
    ("langchain_core.messages.chat", "ChatMessageChunk"): ChatMessageChunk,
    ("langchain_core.messages.function", "FunctionMessage"): FunctionMessage,
    ("langchain_core.messages.function", "FunctionMessageChunk"): FunctionMessageChunk,
    ("langchain_core.messages.modifier", "RemoveMessage"): RemoveMessage,
}

#: The LangChain message classes every codec accepts, as ``(module, class name)`` pairs of the payloads.
DEFAULT_MESSAGE_CLASSES: frozenset[tuple[str, str]] = frozenset(_MESSAGE_CLASSES)


def _args(build: Callable[..., Any]) -> Callable[[Any], Any]:
    """A builder taking the payload's argument list as positional arguments (codes 1)."""

    def run(arg: Any) -> Any:
        if type(arg) is not list:
            raise TypeError("positional arguments must be an array")
        return build(*arg)

    return run


def _kwargs(build: Callable[..., Any]) -> Callable[[Any], Any]:
    """A builder taking the payload's argument map as keyword arguments (code 2)."""

    def run(arg: Any) -> Any:
        if type(arg) is not dict or not all(type(key) is str for key in arg):
            raise TypeError("keyword arguments must be a map of strings")
        return build(**arg)

    return run


def _one(build: Callable[[Any], Any], *types: type) -> Callable[[Any], Any]:
    """A builder taking the payload's single argument (codes 0 and 3), of one of ``types``."""

    def run(arg: Any) -> Any:
        if type(arg) not in types:
            raise TypeError(f"the argument must be a {' or '.join(t.__name__ for t in types)}")
        return build(arg)

    return run


def _ip(cls: Callable[[str], Any]) -> Callable[[Any], Any]:
    return _one(cls, str)


def _collection(build: Callable[[list], Any]) -> Callable[[Any], Any]:
    """A set, frozenset or deque of the payload's array; a set whose items msgpack turned into
    unhashable arrays (a set of tuples) stays the array: the value only has to be read, never written."""

    def run(arg: Any) -> Any:
        if type(arg) is not list:
            raise TypeError("the argument must be an array")
        try:
            return build(arg)
        except TypeError:
            return arg

    return run


# (extension code, module, class name[, method]) as JsonPlus writes these values, mapped to how this
# module builds them: never by importing or looking up what the payload names. The keys are those of
# langgraph.checkpoint.serde._msgpack.SAFE_MSGPACK_TYPES that have a fixed, harmless constructor
# (``re.compile`` and ``zoneinfo.ZoneInfo``, which compile patterns or read files, stay refused).
_SAFE_VALUES: dict[tuple[Any, ...], Callable[[Any], Any]] = {
    (3, "datetime", "datetime", "fromisoformat"): _one(dt.datetime.fromisoformat, str),
    (1, "datetime", "date"): _args(dt.date),
    (2, "datetime", "time"): _kwargs(dt.time),
    (1, "datetime", "timedelta"): _args(dt.timedelta),
    (1, "datetime", "timezone"): _args(dt.timezone),
    (0, "uuid", "UUID"): _one(uuid.UUID, str),
    (0, "decimal", "Decimal"): _one(decimal.Decimal, str),
    (0, "builtins", "set"): _collection(set),
    (0, "builtins", "frozenset"): _collection(frozenset),
    (0, "collections", "deque"): _collection(collections.deque),
    (0, "ipaddress", "IPv4Address"): _ip(ipaddress.IPv4Address),
    (0, "ipaddress", "IPv4Interface"): _ip(ipaddress.IPv4Interface),
    (0, "ipaddress", "IPv4Network"): _ip(ipaddress.IPv4Network),
    (0, "ipaddress", "IPv6Address"): _ip(ipaddress.IPv6Address),
    (0, "ipaddress", "IPv6Interface"): _ip(ipaddress.IPv6Interface),
    (0, "ipaddress", "IPv6Network"): _ip(ipaddress.IPv6Network),
    # Read as pure paths: nothing touches the file system. (Python 3.13 names the module pathlib._local.)
    (1, "pathlib", "Path"): _args(pathlib.PurePosixPath),
    (1, "pathlib", "PosixPath"): _args(pathlib.PurePosixPath),
    (1, "pathlib._local", "Path"): _args(pathlib.PurePosixPath),
    (1, "pathlib._local", "PosixPath"): _args(pathlib.PurePosixPath),
}

#: The standard types accepted inside messages, as ``(module, class name)`` of the payloads.
SAFE_VALUE_TYPES: frozenset[tuple[str, str]] = frozenset((key[1], key[2]) for key in _SAFE_VALUES)

#: How deep standard values may nest in one another (a time's timezone's timedelta is 3).
MAX_NESTED_VALUES = 4

_ALLOW_HINT = "allow more with REDUCING_SAVER_ALLOWED_MESSAGE_CLASSES=module:Class"


class UnsafeMessagesError(ValueError):
    """A messages channel value holds an extension the service refuses to decode.

    Attributes:
        code: The msgpack extension code.
        module: The module the extension names (codes 0–5), else ``None``.
        name: The class or callable the extension names (codes 0–5), else ``None``.
        path: Where in the value, e.g. ``"messages[3].additional_kwargs.x"`` (``"messages"`` when the
            place cannot be told).
    """

    def __init__(
        self, code: int, module: str | None, name: str | None, path: str, *, detail: str = ""
    ) -> None:
        self.code = code
        self.module = module
        self.name = name
        self.path = path
        if module is not None and name is not None:
            what = f" naming {module}.{name}"
        elif code == EXT_PYDANTIC_V2:
            what = " with a malformed payload"
        elif code in _OTHER_CODES:
            what = f" ({_OTHER_CODES[code]})"
        elif code in _CALLING_CODES:
            what = f" ({_CALLING_CODES[code]})"
        else:
            what = " (unknown to LangGraph)"
        if detail:
            what += f" ({detail})"
        if code == EXT_PYDANTIC_V2 and module is not None:
            tail = f"only LangChain message classes are accepted ({_ALLOW_HINT})"
        else:
            tail = (
                "only LangChain message classes (extension code 5) are accepted, and the service never "
                "imports or calls what an extension names"
            )
        super().__init__(
            f"messages channel: msgpack extension code {code}{what} at {path} is refused; {tail}"
        )


class EncodedMessage(dict):
    """One message as the service reads it: its ``model_dump()`` dict, plus how it was serialized.

    Reads like the dict (``m["type"]``, ``m.get("tool_calls")``); ``ext`` is the raw extension payload,
    written back untouched by ``SafeMessagesCodec.encode``.
    """

    __slots__ = ("_ext", "_module", "_name")

    def __init__(self, fields: Mapping[str, Any], ext: bytes, module: str, name: str) -> None:
        dict.__init__(self, fields)
        self._ext = ext
        self._module = module
        self._name = name

    @property
    def ext(self) -> bytes:
        """The msgpack extension (code 5) payload exactly as the client sent it."""
        return self._ext

    @property
    def module(self) -> str:
        """The module of the message class, as named in the payload."""
        return self._module

    @property
    def name(self) -> str:
        """The message class name, as named in the payload."""
        return self._name

    def __repr__(self) -> str:
        return f"EncodedMessage({dict.__repr__(self)}, class={self._module}:{self._name})"


class WrittenMessage(EncodedMessage):
    """A message the service wrote itself (:meth:`SafeMessagesCodec.wrap`), not one a client sent."""

    __slots__ = ()


def to_message(m: EncodedMessage) -> BaseMessage | dict[str, Any]:
    """The LangChain message ``m`` encodes, for the default classes; a plain dict for any other class.

    The class comes from this module's own table, never from importing what the payload names. Like
    LangGraph's decoder, a dump the constructor rejects is built with ``model_construct``.
    """
    cls = _MESSAGE_CLASSES.get((m.module, m.name))
    if cls is None:
        return dict(m)
    try:
        return cls(**m)
    except Exception:
        return cls.model_construct(**m)


class SafeMessagesCodec:
    """The service's ``MessagesCodec``: messages channel blobs in, ``EncodedMessage`` lists out.

    Args:
        extra_classes: Message classes to accept besides ``DEFAULT_MESSAGE_CLASSES``, as ``"module:Class"``
            strings or ``(module, class name)`` pairs, with the module as it appears in payloads (the
            class's ``__module__``). Nothing is imported.

    Attributes:
        unreadable: How many values could not be read (another serde, not msgpack, not a list of
            messages) and were left unreduced.

    Raises:
        ValueError: If an extra class is not ``module:Class``.
    """

    def __init__(self, extra_classes: Iterable[str | tuple[str, str]] = ()) -> None:
        extra = set()
        for entry in extra_classes:
            if isinstance(entry, str):
                module, _, name = entry.partition(":")
            elif isinstance(entry, tuple) and len(entry) == 2:
                module, name = entry
            else:
                module = name = None
            if not (module and name and isinstance(module, str) and isinstance(name, str)):
                raise ValueError(f"{entry!r} is not a message class as module:Class")
            extra.add((module, name))
        self._allowed = DEFAULT_MESSAGE_CLASSES | frozenset(extra)
        self.unreadable = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        extra = sorted(f"{m}:{n}" for m, n in self._allowed - DEFAULT_MESSAGE_CLASSES)
        return f"SafeMessagesCodec({extra!r})"

    @property
    def allowed(self) -> frozenset[tuple[str, str]]:
        """Every accepted ``(module, class name)``."""
        return self._allowed

    def decode(self, value: Any) -> list[EncodedMessage] | None:
        """The messages in a stored channel value, or ``None`` to store it as it is.

        Args:
            value: The channel value as received: a ``Blob``, or an inline primitive.

        Returns:
            One ``EncodedMessage`` per element when ``value`` is msgpack of a list of allowed messages;
            ``None`` for anything else that is safe (not a blob, a DeltaChannel snapshot, another serde,
            bytes that are not such a list; all but the first two count in ``unreadable``).

        Raises:
            UnsafeMessagesError: If any extension other than an allowed message appears anywhere.
        """
        return self._decode(value, self._unreadable)

    def decode_write(self, value: Any) -> list[EncodedMessage] | None:
        """The messages of a pending write to the messages channel (a list, or one message) or of a stored
        list, read as :meth:`decode` reads a put's, but not counted: ``None`` when it holds none."""
        if (
            isinstance(value, Blob)
            and value.type == "msgpack"
            and _top_ext_code(value.data) == EXT_PYDANTIC_V2
        ):
            value = Blob("msgpack", b"\x91" + value.data)  # one message: read it as a list of one
        return self._decode(value, _quiet)

    def decode_seed(self, value: Any) -> list[EncodedMessage] | None:
        """The messages of a DeltaChannel's seed: a snapshot (extension 7 around the list), or a list."""
        if (
            isinstance(value, Blob)
            and value.type == "msgpack"
            and _top_ext_code(value.data) == EXT_DELTA_SNAPSHOT
        ):
            # The hook returns the extension's bytes untouched: nothing inside is decoded but the list.
            wrapped = ormsgpack.unpackb(value.data, ext_hook=lambda code, data: data)
            value = Blob("msgpack", wrapped)
        return self._decode(value, _quiet)

    def is_snapshot(self, value: Any) -> bool:
        """Whether a stored value is a DeltaChannel snapshot (msgpack extension 7 as the whole value)."""
        return (
            isinstance(value, Blob)
            and value.type == "msgpack"
            and _top_ext_code(value.data) == EXT_DELTA_SNAPSHOT
        )

    def _decode(self, value: Any, unreadable: Any) -> list[EncodedMessage] | None:
        if not isinstance(value, Blob):
            return None
        if value.type != "msgpack":
            return unreadable(f"serde type {value.type!r} is not msgpack")
        data = value.data
        if _top_ext_code(data) == EXT_DELTA_SNAPSHOT:
            return None
        decoder = _Decoder(self._allowed)
        try:
            top = ormsgpack.unpackb(data, ext_hook=decoder.hook, option=ormsgpack.OPT_NON_STR_KEYS)
        except Exception as exc:
            if decoder.refusal is not None:
                raise _locate(data, self._allowed, decoder.refusal) from None
            return unreadable(decoder.unreadable or f"not valid msgpack ({exc})")
        if type(top) is not list:
            return unreadable(f"the value is a {type(top).__name__}, not a list")
        for element in top:
            if type(element) is not EncodedMessage:
                return unreadable(f"the list holds a {type(element).__name__}, not a message")
        return top

    def encode(self, kept: list[EncodedMessage], original: Any) -> Blob:
        """The blob of ``kept``, byte for byte what the client's serializer makes of those messages.

        Args:
            kept: Messages returned by ``decode(original)`` (any sublist, in order), and messages made
                by :meth:`wrap`.
            original: The value they were decoded from; returned as is when nothing was dropped or added.
        """
        if (
            isinstance(original, Blob)
            and array_length(original.data) == len(kept)
            and not any(type(m) is WrittenMessage for m in kept)
        ):
            return original
        return Blob("msgpack", ormsgpack.packb([ormsgpack.Ext(EXT_PYDANTIC_V2, m.ext) for m in kept]))

    def wrap(self, message: BaseMessage) -> EncodedMessage:
        """A message the service writes itself (a running summary), as an element of a decoded list:
        serialized by LangGraph's own serializer, exactly as a client's would be."""
        data = _WRITER.dumps_typed([message])[1]
        (decoded,) = ormsgpack.unpackb(
            data, ext_hook=_Decoder(self._allowed).hook, option=ormsgpack.OPT_NON_STR_KEYS
        )
        return WrittenMessage(decoded, decoded.ext, decoded.module, decoded.name)

    def _unreadable(self, reason: str) -> None:
        with self._lock:
            self.unreadable += 1
        logger.debug("messages channel left unreduced: %s", reason)


# -- decoding ----------------------------------------------------------------------------------------


class _Refusal:
    __slots__ = ("code", "detail", "module", "name")

    def __init__(self, code: int, module: str | None, name: str | None, detail: str = "") -> None:
        self.code, self.module, self.name, self.detail = code, module, name, detail

    def error(self, path: str) -> UnsafeMessagesError:
        return UnsafeMessagesError(self.code, self.module, self.name, path, detail=self.detail)


class _Refused(Exception):
    """Raised inside the ext_hook; ormsgpack turns it into ValueError("ext_hook failed")."""


class _Marker:
    """Stands where a refused extension was, when decoding again to find its path."""

    __slots__ = ("refusal",)

    def __init__(self, refusal: _Refusal) -> None:
        self.refusal = refusal


class _Decoder:
    """One decode's ext_hook and what it saw (ormsgpack drops the hook's exceptions, so they are kept here).

    With ``mark`` the hook never raises for a refused extension: it returns a ``_Marker``, so a second
    pass can find where the first pass stopped.
    """

    __slots__ = ("allowed", "depth", "mark", "refusal", "unreadable", "value_depth")

    def __init__(self, allowed: frozenset[tuple[str, str]], mark: bool = False) -> None:
        self.allowed = allowed
        self.mark = mark
        self.depth = 0
        self.value_depth = 0
        self.refusal: _Refusal | None = None
        self.unreadable: str | None = None

    def hook(self, code: int, data: bytes) -> Any:
        if code != EXT_PYDANTIC_V2:
            refusal = _describe(code, data)
            if self.depth > 0 and (build := _safe_builder(code, refusal, data)) is not None:
                return self._safe_value(code, data, refusal, build)
            return self._refuse(refusal)
        if self.depth > MAX_NESTED_MESSAGES:
            if self.mark:
                return None
            self.unreadable = f"messages nested more than {MAX_NESTED_MESSAGES} deep"
            raise _Refused
        self.depth += 1
        try:
            # Nested extensions go through this hook too; nothing in the payload is imported or called.
            tup = ormsgpack.unpackb(data, ext_hook=self.hook, option=ormsgpack.OPT_NON_STR_KEYS)
        except Exception as exc:
            if self.refusal is None and self.unreadable is None:
                self.unreadable = f"a message payload is not valid msgpack ({exc})"
            raise
        finally:
            self.depth -= 1
        if type(tup) is list and 3 <= len(tup) <= 4 and type(tup[0]) is str and type(tup[1]) is str:
            key = (tup[0], tup[1])
            if key not in self.allowed:
                return self._refuse(_Refusal(code, *key))
            if isinstance(tup[2], dict):
                return EncodedMessage(tup[2], data, *key)
        # Not (module, name, dump[, method]): LangGraph's decoder would still index tup[0], tup[1].
        module, name = _names(tup)
        return self._refuse(_Refusal(code, module, name, detail="malformed payload" if module else ""))

    def _safe_value(self, code: int, data: bytes, refusal: _Refusal, build: Callable[[Any], Any]) -> Any:
        """A standard value inside a message, built from the module's table; nested extensions go
        through this hook too. A malformed one is refused like an unknown extension."""
        if self.value_depth >= MAX_NESTED_VALUES:
            return self._refuse(_Refusal(code, refusal.module, refusal.name, detail="nested too deep"))
        self.value_depth += 1
        try:
            tup = ormsgpack.unpackb(data, ext_hook=self.hook, option=ormsgpack.OPT_NON_STR_KEYS)
        finally:
            self.value_depth -= 1
        if self.mark and _holds_marker(tup[2]):  # locating a refusal inside: the walk must reach it
            return tup[2]
        try:
            return build(tup[2])
        except (TypeError, ValueError, OverflowError, ArithmeticError) as exc:  # what JsonPlus never writes
            detail = f"malformed payload: {type(exc).__name__}: {str(exc)[:100]}"
            return self._refuse(_Refusal(code, refusal.module, refusal.name, detail=detail))

    def _refuse(self, refusal: _Refusal) -> Any:
        if self.mark:
            return _Marker(refusal)
        if self.refusal is None:
            self.refusal = refusal
        raise _Refused


def _describe(code: int, data: bytes) -> _Refusal:
    """What a refused non-message extension names, read without decoding anything it nests."""
    if code not in _CALLING_CODES:
        return _Refusal(code, None, None)
    try:
        tup = ormsgpack.unpackb(data, ext_hook=_ignore, option=ormsgpack.OPT_NON_STR_KEYS)
    except Exception:
        return _Refusal(code, None, None)
    module, name = _names(tup)
    detail = ""
    if code == 3 and module is not None:
        method = _item(tup, 3)
        detail = f"method {method}" if isinstance(method, str) else ""
    return _Refusal(code, module, name, detail)


def _holds_marker(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is _Marker:
            return True
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _safe_builder(code: int, refusal: _Refusal, data: bytes) -> Callable[[Any], Any] | None:
    """The table's builder for a standard value, when the extension is exactly one JsonPlus writes."""
    if refusal.module is None or refusal.name is None:
        return None
    key: tuple[Any, ...] = (code, refusal.module, refusal.name)
    if code == 3:  # method calls: the method is part of what must match
        try:
            tup = ormsgpack.unpackb(data, ext_hook=_ignore, option=ormsgpack.OPT_NON_STR_KEYS)
        except ValueError:  # not msgpack (ormsgpack's decode error is a ValueError)
            return None
        if type(tup) is not list or len(tup) != 4:
            return None
        key = (*key, tup[3])
    elif code in (0, 1, 2):
        try:
            tup = ormsgpack.unpackb(data, ext_hook=_ignore, option=ormsgpack.OPT_NON_STR_KEYS)
        except ValueError:  # not msgpack (ormsgpack's decode error is a ValueError)
            return None
        if type(tup) is not list or len(tup) != 3:
            return None
    return _SAFE_VALUES.get(key)


def _names(tup: Any) -> tuple[str | None, str | None]:
    """``tup[0], tup[1]`` when both are strings, as LangGraph's decoder reads them (list or int-keyed map)."""
    module, name = _item(tup, 0), _item(tup, 1)
    if isinstance(module, str) and isinstance(name, str):
        return module, name
    return None, None


def _item(tup: Any, index: int) -> Any:
    try:
        return tup[index]
    except Exception:
        return None


def _ignore(code: int, data: bytes) -> None:
    return None


def _locate(data: bytes, allowed: frozenset[tuple[str, str]], refusal: _Refusal) -> UnsafeMessagesError:
    """The error for the first refused extension, with its path (found by decoding again, marking)."""
    try:
        marking = _Decoder(allowed, mark=True)
        top = ormsgpack.unpackb(data, ext_hook=marking.hook, option=ormsgpack.OPT_NON_STR_KEYS)
    except Exception:
        return refusal.error("messages")
    # Iterative pre-order walk: document order, and no recursion limit on deep values.
    stack: list[tuple[Any, str]] = [(top, "messages")]
    while stack:
        node, path = stack.pop()
        if type(node) is _Marker:
            return node.refusal.error(path)
        if isinstance(node, dict):
            children = []
            for key, child in node.items():
                if type(key) is _Marker:
                    children.append((key, f"{path}[<a key>]"))
                    continue
                if isinstance(key, str) and key.isidentifier():
                    children.append((child, f"{path}.{key}"))
                else:
                    children.append((child, f"{path}[{key!r}]"))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend((node[i], f"{path}[{i}]") for i in range(len(node) - 1, -1, -1))
    return refusal.error("messages")


# -- msgpack headers ---------------------------------------------------------------------------------


# Where the type byte of an extension sits, by its first byte: fixext 1/2/4/8/16, ext 8/16/32.
_EXT_TYPE_OFFSET = {0xD4: 1, 0xD5: 1, 0xD6: 1, 0xD7: 1, 0xD8: 1, 0xC7: 2, 0xC8: 3, 0xC9: 5}


def _quiet(reason: str) -> None:
    return None


def _top_ext_code(data: bytes) -> int | None:
    """The extension code when the whole value is one extension, else ``None``."""
    if not data:
        return None
    offset = _EXT_TYPE_OFFSET.get(data[0])
    if offset is None or len(data) <= offset:
        return None
    code = data[offset]
    return code - 256 if code > 127 else code
