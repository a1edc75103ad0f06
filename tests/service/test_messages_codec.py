"""SafeMessagesCodec: the client's serialized messages read without importing or calling anything named."""

from __future__ import annotations

import copy
import importlib
import pickle
import subprocess
import sys
import threading
import uuid
from collections import deque
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from ipaddress import IPv4Address, IPv6Network
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import ormsgpack
import pytest
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
from langgraph.checkpoint.serde import _msgpack as lg_msgpack
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.service.messages_codec import (
    DEFAULT_MESSAGE_CLASSES,
    MAX_NESTED_MESSAGES,
    EncodedMessage,
    SafeMessagesCodec,
    UnsafeMessagesError,
    to_message,
)
from reducing_saver.wire import Blob

SERDE = JsonPlusSerializer()
HUMAN = ("langchain_core.messages.human", "HumanMessage")
AI = ("langchain_core.messages.ai", "AIMessage")
ALL_CLASSES = (
    SystemMessage,
    SystemMessageChunk,
    HumanMessage,
    HumanMessageChunk,
    AIMessage,
    AIMessageChunk,
    ToolMessage,
    ToolMessageChunk,
    ChatMessage,
    ChatMessageChunk,
    FunctionMessage,
    FunctionMessageChunk,
    RemoveMessage,
)


def dumps(obj: Any) -> Blob:
    return Blob(*SERDE.dumps_typed(obj))


def conversation() -> list[BaseMessage]:
    """A chat with a tool call, a removal, a chunk, unicode and one message large enough for ext32."""
    return [
        SystemMessage("You are a terse assistant.", id="sys"),
        HumanMessage("What's the weather in Paris?", id="h1"),
        AIMessage(
            "",
            id="a1",
            tool_calls=[{"name": "weather", "args": {"city": "Paris", "units": ["c", "f"]}, "id": "call_1"}],
            usage_metadata={"input_tokens": 12, "output_tokens": 7, "total_tokens": 19},
            response_metadata={"model_name": "m", "finish_reason": "tool_calls"},
        ),
        ToolMessage("18°C, cloudy", tool_call_id="call_1", name="weather", id="t1"),
        AIMessage("18 °C and cloudy.", id="a2"),
        HumanMessage(
            [{"type": "text", "text": "Merci ! 🌧️ 天気は？"}], id="h2", additional_kwargs={"lang": "fr"}
        ),
        RemoveMessage(id="a1"),
        AIMessageChunk("partial ans", id="c1"),
        ChatMessage("as a critic", role="critic", id="ch1"),
        FunctionMessage("42", name="answer", id="f1"),
        HumanMessage("ü" * 70_000, id="big"),
        HumanMessage("no id"),
    ]


def ext_elements(data: bytes) -> list[tuple[int, bytes]]:
    """The top-level elements of a serialized list, as raw ``(code, payload)`` (nothing decoded)."""
    return ormsgpack.unpackb(data, ext_hook=lambda code, payload: (code, payload))


def message_ext(module: str, name: str, fields: dict[str, Any]) -> ormsgpack.Ext:
    """A code-5 extension the way JsonPlus writes a pydantic v2 object (fields may hold raw Ext)."""
    return ormsgpack.Ext(5, ormsgpack.packb((module, name, fields, "model_validate_json")))


def pack_map(value: dict[Any, Any]) -> bytes:
    return ormsgpack.packb(value, option=ormsgpack.OPT_NON_STR_KEYS)


def pack_list(*elements: Any) -> Blob:
    return Blob("msgpack", ormsgpack.packb(list(elements)))


# -- the allowlist ------------------------------------------------------------------------------------


def test_default_classes_are_what_jsonplus_writes_for_langchain_messages() -> None:
    written = set()

    def hook(code: int, payload: bytes) -> None:
        module, name, *_ = ormsgpack.unpackb(payload)
        written.add((code, module, name))

    samples = [
        SystemMessage("x"),
        SystemMessageChunk(content="x"),
        HumanMessage("x"),
        HumanMessageChunk(content="x"),
        AIMessage("x"),
        AIMessageChunk(content="x"),
        ToolMessage("x", tool_call_id="c"),
        ToolMessageChunk(content="x", tool_call_id="c"),
        ChatMessage(content="x", role="r"),
        ChatMessageChunk(content="x", role="r"),
        FunctionMessage(content="x", name="f"),
        FunctionMessageChunk(content="x", name="f"),
        RemoveMessage(id="x"),
    ]
    ormsgpack.unpackb(SERDE.dumps_typed(samples)[1], ext_hook=hook)

    assert {(m, n) for _, m, n in written} == DEFAULT_MESSAGE_CLASSES
    assert {code for code, _, _ in written} == {5}
    assert DEFAULT_MESSAGE_CLASSES == {(cls.__module__, cls.__name__) for cls in ALL_CLASSES}
    assert DEFAULT_MESSAGE_CLASSES <= lg_msgpack.SAFE_MSGPACK_TYPES
    assert len(DEFAULT_MESSAGE_CLASSES) == 13


def test_extra_classes_accept_strings_and_pairs_and_reject_anything_else() -> None:
    codec = SafeMessagesCodec(["pkg.mod:Custom", ("other.mod", "Other")])
    assert codec.allowed == DEFAULT_MESSAGE_CLASSES | {("pkg.mod", "Custom"), ("other.mod", "Other")}
    assert SafeMessagesCodec().allowed == DEFAULT_MESSAGE_CLASSES
    for bad in ("no_colon", ":Class", "module:", ("module", ""), ("a", "b", "c"), 3):
        with pytest.raises(ValueError, match="module:Class"):
            SafeMessagesCodec([bad])


# -- round trip ---------------------------------------------------------------------------------------


def test_decode_gives_the_model_dumps_with_the_raw_payloads() -> None:
    messages = conversation()
    value = dumps(messages)
    decoded = SafeMessagesCodec().decode(value)

    assert decoded == [m.model_dump() for m in messages]
    assert all(type(m) is EncodedMessage for m in decoded)
    assert [(m.module, m.name) for m in decoded] == [(type(m).__module__, type(m).__name__) for m in messages]
    assert [(5, m.ext) for m in decoded] == ext_elements(value.data)
    ai = decoded[2]
    assert ai["type"] == "ai" and ai.get("id") == "a1"
    assert ai.get("tool_calls")[0]["id"] == "call_1"
    assert decoded[3]["tool_call_id"] == "call_1"


def test_encode_of_every_sublist_is_byte_identical_to_the_clients_serializer() -> None:
    messages = conversation()
    value = dumps(messages)
    codec = SafeMessagesCodec()
    decoded = codec.decode(value)

    assert codec.encode(decoded, value) is value
    assert codec.encode(list(decoded), None).data == value.data  # the packing path, too
    for cut in range(len(messages) + 1):
        for keep_head in (False, True):
            head = [0] if keep_head and cut > 0 else []
            indices = head + list(range(cut, len(messages)))
            expected = SERDE.dumps_typed([messages[i] for i in indices])
            encoded = codec.encode([decoded[i] for i in indices], value)
            assert (encoded.type, encoded.data) == expected, indices


def test_encode_matches_across_header_sizes() -> None:
    """fixarray/array16 and fixext/ext8/ext16/ext32 boundaries all re-encode identically."""
    sizes = [0, 1, 10, 200, 250, 260, 65_400, 65_600]
    messages = [HumanMessage("a" * size, id=f"m{i}") for i, size in enumerate(sizes * 3)]
    value = dumps(messages)
    codec = SafeMessagesCodec()
    decoded = codec.decode(value)
    assert len(decoded) == 24  # array16 header; the sublists below use fixarray
    for start in (0, 1, 8, 9, 20, 24):
        assert codec.encode(decoded[start:], value).data == SERDE.dumps_typed(messages[start:])[1]


def test_to_message_rebuilds_default_classes_and_leaves_others_as_dicts() -> None:
    messages = conversation()
    decoded = SafeMessagesCodec().decode(dumps(messages))
    rebuilt = [to_message(m) for m in decoded]
    assert rebuilt == messages
    assert [type(m) for m in rebuilt] == [type(m) for m in messages]

    custom = EncodedMessage({"type": "my", "content": "x"}, b"", "somewhere", "Mine")
    assert to_message(custom) == {"type": "my", "content": "x"}
    assert type(to_message(custom)) is dict


def test_encoded_message_reads_like_a_dict_and_keeps_its_payload_read_only() -> None:
    decoded = SafeMessagesCodec().decode(dumps([HumanMessage("hi", id="h")]))
    message = decoded[0]
    assert message["content"] == "hi" and message.get("id") == "h" and message.get("nope") is None
    with pytest.raises(AttributeError):
        message.ext = b"other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        message.extra = 1  # type: ignore[attr-defined]
    for clone in (copy.copy(message), copy.deepcopy(message), pickle.loads(pickle.dumps(message))):
        assert type(clone) is EncodedMessage
        assert clone == message and (clone.ext, clone.module, clone.name) == (message.ext, *HUMAN)


def test_values_that_are_not_blobs_are_stored_as_they_are() -> None:
    codec = SafeMessagesCodec()
    for value in (None, "text", 3, 2.5, True, [HumanMessage("x")]):
        assert codec.decode(value) is None
    assert codec.unreadable == 0


# -- hostile payloads ---------------------------------------------------------------------------------

TARGETS = [("os", "system"), ("subprocess", "Popen"), ("builtins", "eval"), ("importlib", "import_module")]


def attack_argument(target: tuple[str, str], marker: Path) -> Any:
    return {
        ("os", "system"): f"touch {marker}",
        ("subprocess", "Popen"): ["touch", str(marker)],
        ("builtins", "eval"): f"open({str(marker)!r}, 'w').close()",
        ("importlib", "import_module"): "json",
    }[target]


def attack(code: int, target: tuple[str, str], marker: Path) -> ormsgpack.Ext:
    """An extension shaped the way LangGraph's ext_hook reads each code (see _create_msgpack_ext_hook)."""
    module, name = target
    arg = attack_argument(target, marker)
    payload = {
        0: (module, name, arg),  # getattr(import_module(module), name)(arg)
        1: (module, name, [arg]),  # ...(*args)
        2: (module, name, {"command": arg}),  # ...(**kwargs)
        3: (module, name, arg, "__call__"),  # getattr(getattr(mod, name), method)(arg)
        4: (module, name, {"command": arg}),  # pydantic v1: cls(**kwargs)
        5: (module, name, {"command": arg}, "model_validate_json"),  # pydantic v2: cls(**kwargs)
    }[code]
    return ormsgpack.Ext(code, ormsgpack.packb(payload))


def plain_human() -> ormsgpack.Ext:
    return message_ext(*HUMAN, HumanMessage("hi").model_dump())


def human_with(ext: Any, key: str = "x") -> ormsgpack.Ext:
    fields = HumanMessage("hello", id="h").model_dump()
    fields["additional_kwargs"] = {key: ext}
    return message_ext(*HUMAN, fields)


def ai_calling_with(ext: Any) -> ormsgpack.Ext:
    fields = AIMessage("", id="a", tool_calls=[{"name": "t", "args": {"q": "ok"}, "id": "c"}]).model_dump()
    fields["tool_calls"][0]["args"]["q"] = ext
    return message_ext(*AI, fields)


PLACEMENTS = {
    "element": (lambda ext: [ext], "messages[0]"),
    "after_a_message": (lambda ext: [plain_human(), ext], "messages[1]"),
    "additional_kwargs": (lambda ext: [human_with(ext)], "messages[0].additional_kwargs.x"),
    "tool_call_args": (
        lambda ext: [plain_human(), ai_calling_with(ext)],
        "messages[1].tool_calls[0].args.q",
    ),
}


@pytest.fixture
def no_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any import through importlib while decoding fails the test."""

    def refuse(name: str, package: str | None = None) -> None:
        raise AssertionError(f"the codec imported {name}")

    monkeypatch.setattr(importlib, "import_module", refuse)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("target", TARGETS, ids=".".join)
@pytest.mark.parametrize("code", [0, 1, 2, 3, 4, 5])
def test_calling_extensions_are_refused_and_never_run(
    code: int, target: tuple[str, str], placement: str, tmp_path: Path, no_imports: None
) -> None:
    marker = tmp_path / "pwned"
    build, path = PLACEMENTS[placement]
    codec = SafeMessagesCodec()

    with pytest.raises(UnsafeMessagesError) as caught:
        codec.decode(pack_list(*build(attack(code, target, marker))))

    error = caught.value
    assert (error.code, error.module, error.name, error.path) == (code, *target, path)
    assert f"msgpack extension code {code} naming {target[0]}.{target[1]}" in str(error)
    assert f" at {path} is refused" in str(error)
    assert not marker.exists()
    assert codec.unreadable == 0


def test_the_refusal_reads_as_documented() -> None:
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(pack_list(attack(0, ("os", "system"), Path("/tmp/x"))))
    assert str(caught.value).startswith(
        "messages channel: msgpack extension code 0 naming os.system at messages[0] is refused; "
        "only LangChain message classes"
    )
    assert isinstance(caught.value, ValueError)

    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(pack_list(message_ext("os", "system", {})))
    assert "REDUCING_SAVER_ALLOWED_MESSAGE_CLASSES=module:Class" in str(caught.value)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize(
    "code, payload",
    [
        (6, ormsgpack.packb(("<f8", [1], "C", b"\0" * 8))),  # numpy array
        (7, ormsgpack.packb([1, 2])),  # a delta snapshot anywhere but the whole value
        (42, b"\x01"),  # a code LangGraph does not know
        (-1, b"\0" * 4),  # msgpack's timestamp: ormsgpack hands it to the hook as well
    ],
    ids=["numpy", "delta_nested", "unknown", "timestamp"],
)
def test_other_extension_codes_are_refused(code: int, payload: bytes, placement: str) -> None:
    build, path = PLACEMENTS[placement]
    value = pack_list(*build(ormsgpack.Ext(code % 128, payload)))
    if code < 0:  # ormsgpack packs only codes 0..127: patch the type byte of the fixext4 in place
        value = Blob("msgpack", value.data.replace(b"\xd6\x7f\0\0\0\0", b"\xd6\xff\0\0\0\0"))
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(value)
    error = caught.value
    assert (error.code, error.module, error.name, error.path) == (code, None, None, path)
    assert f"msgpack extension code {code} " in str(error)


def test_a_code_5_payload_shaped_as_a_map_is_refused(tmp_path: Path, no_imports: None) -> None:
    """LangGraph's hook indexes tup[0], tup[1]: an int-keyed map names a class as well as a list."""
    marker = tmp_path / "pwned"
    ext = ormsgpack.Ext(5, pack_map({0: "os", 1: "system", 2: {"command": f"touch {marker}"}}))
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(pack_list(ext))
    assert (caught.value.code, caught.value.module, caught.value.name) == (5, "os", "system")
    assert not marker.exists()


def test_a_malformed_message_payload_naming_an_allowed_class_is_refused() -> None:
    ext = ormsgpack.Ext(5, ormsgpack.packb((*HUMAN, "not a dump", "model_validate_json")))
    with pytest.raises(UnsafeMessagesError, match="malformed payload") as caught:
        SafeMessagesCodec().decode(pack_list(ext))
    assert caught.value.path == "messages[0]"


def test_the_first_refusal_is_reported_with_a_precise_path() -> None:
    inner = human_with(attack(0, ("os", "system"), Path("/x")), key="a b")
    value = pack_list(
        plain_human(),
        human_with(inner),
        attack(1, ("subprocess", "Popen"), Path("/y")),
    )
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(value)
    assert caught.value.path == "messages[1].additional_kwargs.x.additional_kwargs['a b']"
    assert (caught.value.code, caught.value.module, caught.value.name) == (0, "os", "system")


def test_a_refused_class_is_reported_before_what_it_nests() -> None:
    fields = {"additional_kwargs": {"x": attack(0, ("os", "system"), Path("/x"))}}
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(pack_list(message_ext("evil", "Thing", fields)))
    assert (caught.value.module, caught.value.name, caught.value.path) == ("evil", "Thing", "messages[0]")


def test_a_whole_value_that_is_a_calling_extension_is_refused() -> None:
    value = Blob("msgpack", ormsgpack.packb(attack(0, ("os", "system"), Path("/x"))))
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(value)
    assert caught.value.path == "messages"


SAFE_FIELDS = {
    "when": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2))),
    "day": date(2026, 1, 2),
    "at": time(1, 2, 3, 4, tzinfo=timezone(timedelta(hours=-5), "EST")),
    "naive": time(5, 6),
    "span": timedelta(days=1, seconds=2, microseconds=3),
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "price": Decimal("12.3400"),
    "tags": {"a"},
    "frozen": frozenset({1}),
    "queue": deque([1, 2]),
    "ip": IPv4Address("10.0.0.1"),
    "net": IPv6Network("2001:db8::/64"),
    "path": Path("/a/b"),
}


def test_safe_standard_values_in_messages_are_read_and_kept_byte_identical() -> None:
    """The standard types LangGraph's strict msgpack mode decodes travel inside messages, as a stock saver
    stores them; kept messages are written back byte for byte."""
    messages = [
        HumanMessage("hi", id="h", additional_kwargs=dict(SAFE_FIELDS)),
        AIMessage("yo", id="a", response_metadata={"created": datetime.now(UTC), "req": uuid.uuid4()}),
        HumanMessage("again", id="h2", additional_kwargs={"nested": {"list": [date(2020, 1, 1)]}}),
    ]
    codec = SafeMessagesCodec()
    blob = dumps(messages)
    decoded = codec.decode(blob)
    assert decoded is not None and [m["id"] for m in decoded] == ["h", "a", "h2"]
    expected = {**SAFE_FIELDS, "path": PurePosixPath("/a/b")}  # read as a pure path: no file system
    assert decoded[0]["additional_kwargs"] == expected
    assert decoded[1]["response_metadata"] == messages[1].response_metadata
    for kept in (decoded[:1], decoded[1:], [decoded[0], decoded[2]]):
        ids = [m["id"] for m in kept]
        assert codec.encode(kept, blob).data == dumps([m for m in messages if m.id in ids]).data
    assert to_message(decoded[0]).additional_kwargs == expected


def _ext(code: int, payload: tuple) -> ormsgpack.Ext:
    return ormsgpack.Ext(code, ormsgpack.packb(payload))


@pytest.mark.parametrize(
    ("ext", "module", "name"),
    [
        (
            _ext(3, ("datetime", "datetime", "2026-01-01", "strptime")),
            "datetime",
            "datetime",
        ),  # another method
        (_ext(0, ("datetime", "datetime", "2026-01-01")), "datetime", "datetime"),  # another code
        (_ext(0, ("uuid", "UUID", 5)), "uuid", "UUID"),  # an argument JsonPlus never writes
        (_ext(1, ("datetime", "timedelta", [10**15])), "datetime", "timedelta"),  # out of range
        (_ext(0, ("zoneinfo", "ZoneInfo", "Europe/Paris")), "zoneinfo", "ZoneInfo"),  # reads files
        (_ext(1, ("re", "compile", ["a+", 0])), "re", "compile"),  # compiles patterns
        (
            _ext(0, ("decimal", "Decimal", "1", "extra")),
            "decimal",
            "Decimal",
        ),  # not the shape JsonPlus writes
        (_ext(0, ("builtins", "set", [_ext(0, ("os", "system", "true"))])), "os", "system"),  # hostile inside
    ],
)
def test_near_misses_of_the_safe_types_are_refused(ext: ormsgpack.Ext, module: str, name: str) -> None:
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(pack_list(human_with(ext, key="when")))
    assert (caught.value.module, caught.value.name) == (module, name)
    assert caught.value.path.startswith("messages[0]")


def test_safe_values_outside_a_message_are_refused() -> None:
    """They are accepted inside messages only: a messages list holding a bare datetime is not one."""
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(dumps([datetime.now(UTC)]))
    assert (caught.value.code, caught.value.name, caught.value.path) == (3, "datetime", "messages[0]")


def test_the_payloads_are_real_the_stock_decoder_runs_them(tmp_path: Path) -> None:
    """What the codec refuses, LangGraph's default decoder executes (os.mkdir stands in for os.system)."""
    payloads = {
        "list": ormsgpack.Ext(0, ormsgpack.packb(("os", "mkdir", str(tmp_path / "list")))),
        "map": ormsgpack.Ext(0, pack_map({0: "os", 1: "mkdir", 2: str(tmp_path / "map")})),
        "nested": human_with(ormsgpack.Ext(0, ormsgpack.packb(("os", "mkdir", str(tmp_path / "nested"))))),
    }

    for label, ext in payloads.items():
        value = pack_list(ext)
        with pytest.raises(UnsafeMessagesError):
            SafeMessagesCodec().decode(value)
        assert not (tmp_path / label).exists()

        SERDE.loads_typed((value.type, value.data))
        if lg_msgpack.STRICT_MSGPACK_ENABLED:
            # LANGGRAPH_STRICT_MSGPACK is set here: the stock decoder returns the raw argument instead.
            assert not (tmp_path / label).exists()
        else:
            assert (tmp_path / label).is_dir(), label


# -- operator-allowed classes -------------------------------------------------------------------------


class MyMessage(BaseMessage):
    """A message class of the application's own, serialized by JsonPlus like LangChain's."""

    type: Literal["my"] = "my"


def test_a_custom_message_class_is_refused_by_default_and_accepted_when_allowed(no_imports: None) -> None:
    messages = [HumanMessage("hi", id="h"), MyMessage(content="custom", id="m")]
    value = dumps(messages)
    module = MyMessage.__module__

    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(value)
    assert (caught.value.code, caught.value.module, caught.value.name) == (5, module, "MyMessage")
    assert caught.value.path == "messages[1]"
    assert "REDUCING_SAVER_ALLOWED_MESSAGE_CLASSES" in str(caught.value)

    for codec in (SafeMessagesCodec([f"{module}:MyMessage"]), SafeMessagesCodec([(module, "MyMessage")])):
        decoded = codec.decode(value)
        assert decoded == [m.model_dump() for m in messages]
        assert (decoded[1].module, decoded[1].name) == (module, "MyMessage")
        assert to_message(decoded[1]) == messages[1].model_dump()
        assert codec.encode(decoded[1:], value).data == SERDE.dumps_typed(messages[1:])[1]


def test_an_allowed_class_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The payload names a real, importable module with an import side effect; decoding leaves it alone."""
    module = f"rs_codec_probe_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass MyMessage: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    # A MyMessage payload, renamed to the probe module.
    _, raw = ext_elements(SERDE.dumps_typed([MyMessage(content="x", id="m")])[1])[0]
    _, name, fields, method = ormsgpack.unpackb(raw)
    value = pack_list(ormsgpack.Ext(5, ormsgpack.packb((module, name, fields, method))))

    decoded = SafeMessagesCodec([f"{module}:MyMessage"]).decode(value)
    assert decoded == [fields] and decoded[0].module == module
    assert to_message(decoded[0]) == fields
    assert module not in sys.modules
    assert not marker.exists()

    # The probe is real: importing it is visible.
    importlib.import_module(module)
    monkeypatch.delitem(sys.modules, module)
    assert marker.exists()


# -- values stored unreduced --------------------------------------------------------------------------


def test_a_delta_snapshot_is_left_alone_undecoded_and_uncounted() -> None:
    codec = SafeMessagesCodec()
    assert codec.decode(dumps(_DeltaSnapshot(conversation()))) is None
    # Not decoded at all: what it holds is the client's business, as for any opaque channel value.
    inside = ormsgpack.packb([attack(0, ("os", "system"), Path("/x"))])
    hostile = Blob("msgpack", ormsgpack.packb(ormsgpack.Ext(7, inside)))
    assert codec.decode(hostile) is None
    assert codec.unreadable == 0


@pytest.mark.parametrize(
    "value",
    [
        Blob("msgpack+aes", b"\x91\xc7\x01\x05\x00"),
        Blob("json", b"[]"),
        Blob("pickle", pickle.dumps([1])),
        Blob("msgpack", b""),
        Blob("msgpack", SERDE.dumps_typed([HumanMessage("hi")] * 3)[1][:-5]),  # truncated
        Blob("msgpack", b"\xc1"),  # a byte msgpack never uses
        dumps({"messages": [1, 2]}),
        dumps("just a string"),
        dumps([{"type": "human", "content": "plain dict"}]),
        dumps([HumanMessage("hi"), "a str"]),
        dumps(HumanMessage("one message, not a list")),
        pack_list(ormsgpack.Ext(5, b"\xc1")),  # a message payload that is not msgpack
    ],
    ids=[
        "encrypted",
        "json",
        "pickle",
        "empty",
        "truncated",
        "invalid",
        "dict",
        "str",
        "plain_dicts",
        "mixed",
        "single_message",
        "bad_payload",
    ],
)
def test_unreadable_values_are_stored_unreduced_and_counted(value: Blob) -> None:
    codec = SafeMessagesCodec()
    assert codec.decode(value) is None
    assert codec.unreadable == 1
    assert codec.decode(value) is None
    assert codec.unreadable == 2


def test_an_empty_list_is_an_empty_window() -> None:
    codec = SafeMessagesCodec()
    value = dumps([])
    assert codec.decode(value) == []
    assert codec.encode([], None) == value
    assert codec.unreadable == 0


def test_the_unreadable_counter_is_exact_under_threads() -> None:
    codec = SafeMessagesCodec()
    value = Blob("msgpack", b"\xc1")

    def work() -> None:
        for _ in range(500):
            codec.decode(value)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert codec.unreadable == 4000


def test_a_list_nested_10_000_deep_inside_a_message_is_unreadable_not_a_crash() -> None:
    """ormsgpack stops at 1024 levels; the value is stored unreduced, never refused."""
    fields = HumanMessage("hi", id="h").model_dump()
    fields["additional_kwargs"] = {"deep": 0}
    payload = ormsgpack.packb((*HUMAN, fields, "model_validate_json"))
    deep = payload.replace(b"\xa4deep\x00", b"\xa4deep" + b"\x91" * 10_000 + b"\x00")
    assert len(deep) == len(payload) + 10_000
    value = pack_list(ormsgpack.Ext(5, deep))

    codec = SafeMessagesCodec()
    assert codec.decode(value) is None
    assert codec.unreadable == 1


def test_messages_nested_in_messages_are_decoded_up_to_a_bound() -> None:
    def nest(depth: int) -> ormsgpack.Ext:
        ext = message_ext(*HUMAN, HumanMessage("leaf").model_dump())
        for _ in range(depth):
            ext = human_with(ext, key="inner")
        return ext

    codec = SafeMessagesCodec()
    decoded = codec.decode(pack_list(nest(MAX_NESTED_MESSAGES)))
    inner = decoded[0]["additional_kwargs"]["inner"]
    assert type(inner) is EncodedMessage and inner.name == "HumanMessage"
    assert codec.unreadable == 0
    # Deeper than the bound: stored unreduced, neither decoded further nor refused.
    assert codec.decode(pack_list(nest(MAX_NESTED_MESSAGES + 1))) is None
    assert codec.decode(pack_list(nest(500))) is None
    assert codec.unreadable == 2
    # A refused extension within the bound is still found.
    with pytest.raises(UnsafeMessagesError) as caught:
        codec.decode(pack_list(human_with(human_with(attack(0, ("os", "system"), Path("/x"))))))
    assert caught.value.path == "messages[0].additional_kwargs.x.additional_kwargs.x"


WORST_CASE_SCRIPT = """
import sys, threading, ormsgpack
from reducing_saver.wire import Blob
from reducing_saver.service.messages_codec import MAX_NESTED_MESSAGES, SafeMessagesCodec, UnsafeMessagesError

HUMAN = ("langchain_core.messages.human", "HumanMessage")

def payload(bottom):
    # ormsgpack allows 1024 levels per unpackb: payload array, fields map, additional_kwargs, then lists.
    fields = {"content": "x", "additional_kwargs": {"deep": 0}}
    packed = ormsgpack.packb((*HUMAN, fields, "model_validate_json"))
    return packed.replace(b"\\xa4deep\\x00", b"\\xa4deep" + b"\\x91" * 1019 + bottom)

def value(nested, bottom):
    data = payload(bottom)
    for _ in range(nested):
        data = payload(ormsgpack.packb(ormsgpack.Ext(5, data)))
    return Blob("msgpack", b"\\x91" * 1022 + ormsgpack.packb(ormsgpack.Ext(5, data)))

attack = ormsgpack.packb(ormsgpack.Ext(0, ormsgpack.packb(("os", "system", "true"))))
results = []

def work():
    codec = SafeMessagesCodec()
    for nested in (MAX_NESTED_MESSAGES, MAX_NESTED_MESSAGES + 1):
        results.append(codec.decode(value(nested, b"\\x00")))
    try:
        codec.decode(value(MAX_NESTED_MESSAGES, attack))
    except UnsafeMessagesError as exc:
        results.append(exc.module + "." + exc.name)
    results.append(codec.unreadable)

threading.stack_size(int(sys.argv[1]))
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(results)
"""


def test_the_deepest_values_fit_in_half_a_default_thread_stack() -> None:
    """Each nested payload is one more ormsgpack call of up to 1024 levels on the C stack.

    Run in a child process: overflowing the stack is a segfault, not an exception. The service decodes
    in worker threads; glibc gives them 8 MB, and the worst value must fit in half of that.
    """
    child = subprocess.run(
        [sys.executable, "-c", WORST_CASE_SCRIPT, str(4 * 1024 * 1024)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "[None, None, 'os.system', 2]"


def test_a_refusal_inside_a_deep_value_still_finds_its_path() -> None:
    fields = HumanMessage("hi").model_dump()
    fields["additional_kwargs"] = {"deep": [[[[attack(2, ("os", "system"), Path("/x"))]]]]}
    with pytest.raises(UnsafeMessagesError) as caught:
        SafeMessagesCodec().decode(pack_list(message_ext(*HUMAN, fields)))
    assert caught.value.path == "messages[0].additional_kwargs.deep[0][0][0][0]"
