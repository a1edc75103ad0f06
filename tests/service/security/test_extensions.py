"""The service's scan of stored values' msgpack extensions (service/security/extensions.py), in process.

The refused payloads are shaped as LangGraph's decoder reads each code (tests/hostile/corpus.py's
``attack``); the accepted ones are what ``JsonPlusSerializer`` itself writes for a graph's own types.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import sys
import uuid
from http import HTTPStatus
from pathlib import Path
from typing import Any, NamedTuple

import ormsgpack
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot
from langgraph.types import Send
from pydantic import BaseModel

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.service.security import extensions
from reducing_saver.service.security.extensions import (
    MAX_EXTENSION_DEPTH,
    ExtensionPolicy,
    UnsafeValueError,
    check_extensions,
    check_value,
)
from reducing_saver.wire import Blob, blob_to_wire
from tests.hostile.corpus import attack

SERDE = JsonPlusSerializer()
DEFAULT = ExtensionPolicy()


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Step:
    name: str
    color: Color
    due: datetime.datetime


class Point(NamedTuple):
    x: int
    y: int


class Plan(BaseModel):
    title: str
    steps: list[Step]
    origin: Point
    tags: set[str]


def packed(value: Any) -> bytes:
    type_, data = SERDE.dumps_typed(value)
    assert type_ == "msgpack"
    return data


def ext(code: int, *payload: Any) -> ormsgpack.Ext:
    return ormsgpack.Ext(code, ormsgpack.packb(payload))


def refusal(data: bytes, policy: ExtensionPolicy = DEFAULT) -> UnsafeValueError:
    with pytest.raises(UnsafeValueError) as info:
        check_value(data, "values.notes", policy)
    return info.value


# -- what a graph's own state serializes to passes with no configuration -------------------------------


def a_plan() -> Plan:
    due = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.UTC)
    return Plan(title="t", steps=[Step("a", Color.RED, due)], origin=Point(1, 2), tags={"x"})


@pytest.mark.parametrize(
    "value",
    [
        a_plan(),
        [Step("b", Color.BLUE, datetime.datetime(2026, 1, 1))],
        {"color": Color.RED, "point": Point(3, 4)},
        [
            uuid.uuid4(),
            decimal.Decimal("1.5"),
            datetime.date(2026, 1, 1),
            datetime.timedelta(3),
            Path("/tmp"),
        ],
        [HumanMessage("hi", id="h"), AIMessage("yo", id="a")],
        Send("node", {"x": 1}),
        _DeltaSnapshot([HumanMessage("hi", id="h")]),
        frozenset({1, 2}),
    ],
    ids=[
        "pydantic-dataclass-enum-namedtuple",
        "dataclasses",
        "enum-namedtuple",
        "stdlib-safe-types",
        "messages",
        "send",
        "snapshot",
        "frozenset",
    ],
)
def test_what_jsonplus_writes_for_state_types_is_accepted(value: Any):
    data = packed(value)
    check_value(data, "values.notes", DEFAULT)
    # What is let through is the value itself: a stock reader gets it back.
    assert SERDE.loads_typed(("msgpack", data)) == value


def test_numpy_arrays_are_accepted():
    np = pytest.importorskip("numpy")
    array = np.arange(6).reshape(2, 3)
    data = packed({"a": array})
    check_value(data, "values.notes", DEFAULT)
    assert np.array_equal(SERDE.loads_typed(("msgpack", data))["a"], array)


def test_a_datetime_subclass_from_another_package_is_accepted():
    # JsonPlus writes (module, Class, isoformat, "fromisoformat") for datetime subclasses (pendulum's, say).
    data = ormsgpack.packb(ext(3, "pendulum", "DateTime", "2026-01-01T00:00:00", "fromisoformat"))
    check_value(data, "f", DEFAULT)
    # Accepted by the default "*" entry, not by a rule for every method call: a list without it refuses.
    assert "pendulum.DateTime" in str(refusal(data, ExtensionPolicy(["other"])))


# -- gadgets are refused, wherever they sit ---------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("pip._internal.utils.wheel", "ZipFile"),
        ("pip._internal.utils.filesystem", "NamedTemporaryFile"),
        ("sqlite_vec", "Connection"),
        ("aiosqlite.core", "Thread"),
        ("anyio.from_thread", "Thread"),
        ("psycopg_pool._acompat", "Worker"),
        ("langchain_core.runnables.config", "ThreadPoolExecutor"),
        ("setuptools.command.editable_wheel", "TemporaryDirectory"),
    ],
)
def test_standard_library_callables_under_a_third_party_name_are_refused(module: str, name: str):
    with pytest.raises(UnsafeValueError, match=f"{module}.{name}.*not a class {module} defines"):
        check_value(ormsgpack.packb(ext(1, module, name, ["x"])), "values.notes", DEFAULT)


STATE_MODULE = """
import collections, enum, threading, typing, pathlib
from dataclasses import make_dataclass
from zipfile import ZipFile
pathlib.Path(__file__).with_suffix(".ran").touch()

class Task:
    pass

Pair = collections.namedtuple("Pair", "a b")
Mood = enum.Enum("Mood", "HAPPY SAD")
Box = make_dataclass("Box", ["size"])
class Coords(typing.NamedTuple):
    x: int
Runner = threading.Thread
Later = Task
class Twice:
    pass
Twice = threading.Thread
try:
    from fastjson import Parser
except ImportError:
    class Parser:
        pass
if True:
    class Kept:
        pass
"""


def test_a_name_is_accepted_only_where_its_module_defines_the_class(tmp_path: Path, monkeypatch):
    """The module is read, never run: its top-level statement that touches a file does not run."""
    package = tmp_path / "graphstate_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n"
    )
    (package / "state.py").write_text(STATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    extensions.defined_classes.cache_clear()
    for name in ("Task", "Pair", "Mood", "Box", "Coords", "Kept"):
        check_value(ormsgpack.packb(ext(1, "graphstate_pkg.state", name, [1])), "f", DEFAULT)
    for name in ("ZipFile", "Runner", "Later", "Twice", "Parser", "Missing"):
        with pytest.raises(UnsafeValueError, match="not a class graphstate_pkg.state defines"):
            check_value(ormsgpack.packb(ext(1, "graphstate_pkg.state", name, [1])), "f", DEFAULT)
    assert sorted(path.name for path in package.iterdir()) == ["__init__.py", "state.py"], "nothing ran"
    assert "graphstate_pkg" not in sys.modules and "graphstate_pkg.state" not in sys.modules
    # A module this environment lacks cannot be read: the default mode's limit (a list without * closes it).
    check_value(ormsgpack.packb(ext(1, "graphstate_pkg.elsewhere", "Anything", [1])), "f", DEFAULT)
    with pytest.raises(UnsafeValueError, match="not an allowed state type"):
        check_value(
            ormsgpack.packb(ext(1, "graphstate_pkg.elsewhere", "Anything", [1])), "f", ExtensionPolicy([])
        )


def test_resolving_a_name_imports_nothing():
    assert "pip._internal.utils.wheel" not in sys.modules
    extensions.defined_classes.cache_clear()
    with pytest.raises(UnsafeValueError):
        check_value(ormsgpack.packb(ext(1, "pip._internal.utils.wheel", "ZipFile", ["x"])), "f", DEFAULT)
    assert not any(module == "pip" or module.startswith("pip.") for module in sys.modules)


def test_a_class_in_compiled_code_is_refused():
    pytest.importorskip("pydantic_core")
    with pytest.raises(UnsafeValueError, match="not a class pydantic_core._pydantic_core defines"):
        check_value(
            ormsgpack.packb(ext(1, "pydantic_core._pydantic_core", "SchemaValidator", [1])), "f", DEFAULT
        )


@pytest.mark.parametrize("code", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    "target",
    [("os", "system"), ("subprocess", "Popen"), ("builtins", "eval"), ("importlib", "import_module")],
)
def test_stdlib_gadgets_are_refused_with_every_code(code: int, target: tuple[str, str], tmp_path: Path):
    error = refusal(ormsgpack.packb({"k": attack(code, target, tmp_path / "m")}))
    assert (error.code, error.module, error.name) == (code, *target)
    assert f"code {code} naming {target[0]}.{target[1]}" in str(error)
    assert "values.notes" in str(error) and "REDUCING_SAVER_ALLOWED_STATE_TYPES" in str(error)


@pytest.mark.parametrize(
    "where",
    ["in-a-dataclass", "in-a-pydantic-model", "in-a-snapshot", "in-a-numpy-payload", "in-a-message"],
)
def test_nested_gadgets_are_refused(where: str, tmp_path: Path):
    gadget = attack(1, ("subprocess", "Popen"), tmp_path / "m")
    outer = {
        "in-a-dataclass": ext(2, "myapp.state", "Step", {"name": gadget}),
        "in-a-pydantic-model": ext(5, "myapp.state", "Plan", {"steps": [gadget]}, "model_validate_json"),
        "in-a-snapshot": ormsgpack.Ext(7, ormsgpack.packb([gadget])),
        "in-a-numpy-payload": ext(6, "<i8", [1], "C", gadget),
        "in-a-message": ext(
            5, "langchain_core.messages.human", "HumanMessage", {"content": gadget}, "model_validate_json"
        ),
    }[where]
    error = refusal(ormsgpack.packb([outer]))
    assert (error.code, error.module, error.name) == (1, "subprocess", "Popen")


@pytest.mark.parametrize(
    "payload, reason",
    [
        (ext(0, "numpy.distutils.fcompiler.gnu", "Popen", ["touch", "x"]), "process-starting"),  # a re-export
        (ext(0, "yaml", "unsafe_load", "!!python/object/apply:os.system ['true']"), "function name"),
        (ext(0, "pandas", "read_pickle", "/tmp/x"), "function name"),
        (ext(0, "pathlib", "PurePosixPath", "x"), "standard-library"),  # not one of LangGraph's safe types
        (ext(0, "posix", "system", "true"), "standard-library"),
        (ext(3, "pathlib", "Path", "/tmp/x", "write_text"), "method 'write_text'"),
        (ext(3, "myapp", "Thing", "x", "__call__"), "method '__call__'"),
        (
            ormsgpack.Ext(
                0, ormsgpack.packb({0: "os", 1: "system", 2: "true"}, option=ormsgpack.OPT_NON_STR_KEYS)
            ),
            "malformed",
        ),  # indexable too
        (ormsgpack.Ext(0, ormsgpack.packb("os.system")), "malformed"),
        (ext(0, "os", "system"), "malformed"),
        (ext(0, ".os", "System", "x"), "not a module"),
        (ext(0, "myapp", "Thing.__init__", "x"), "not a module"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_other_targets_are_refused(payload: ormsgpack.Ext, reason: str):
    assert reason in str(refusal(ormsgpack.packb(payload)))


def test_the_error_names_the_outermost_refused_extension_first():
    inner = ext(0, "os", "system", "true")
    data = ormsgpack.packb([ext(2, "myapp", "Step", {"a": inner}), ext(1, "subprocess", "Popen", ["x"])])
    assert refusal(data).module == "subprocess"


def test_nesting_is_bounded_without_recursion():
    value: Any = 1
    for _ in range(MAX_EXTENSION_DEPTH + 1):
        value = ext(2, "myapp", "Node", {"child": value})
    assert "nested more than" in str(refusal(ormsgpack.packb(value)))
    value = 1
    for _ in range(MAX_EXTENSION_DEPTH):
        value = ext(2, "myapp", "Node", {"child": value})
    check_value(ormsgpack.packb(value), "values.notes", DEFAULT)


def test_extensions_before_a_decoding_error_are_still_checked():
    # A reader's decoder calls the hook for everything before the point where the bytes break.
    data = ormsgpack.packb([ext(0, "os", "system", "true"), "x" * 40])[:-5]
    assert refusal(data).name == "system"


def test_codes_langgraph_does_not_know_are_left_alone():
    # LangGraph's hook returns None for them without reading the payload.
    gadget_payload = ormsgpack.packb(("os", "system", "x"))
    for data in (
        ormsgpack.packb([ormsgpack.Ext(42, gadget_payload)]),
        b"\x92\xd4\xfd\x00\xc0",
    ):  # code 42; -3
        check_value(data, "f", DEFAULT)
        # ... because a stock reader reads each as None, never opening the payload.
        assert all(item is None for item in SERDE.loads_typed(("msgpack", data)))


# -- bytes no reader can decode ---------------------------------------------------------------------

GADGET = ormsgpack.packb(ormsgpack.Ext(0, ormsgpack.packb(["os", "system", "touch X"])))
#: Values LangGraph's decoder (ormsgpack, as every reader uses it) cannot read: stored, each would break
#: every read of its thread, through the service's client and a stock saver alike.
UNREADABLE = {
    # An extension as a map key (the gadget's target is never reached: ormsgpack refuses the key).
    "ext-key": b"\x81" + GADGET + b"\x01",
    "ext-key-in-array": b"\x92\x01\x81" + GADGET + b"\x01",
    "ext-key-in-nested-map": b"\x81\xa1a\x81\xa1b\x81" + GADGET + b"\x01",
    "unknown-ext-key": b"\x81\xd4\x63\x00\x01",  # code 99: a value LangGraph reads as None, but not as a key
    "map-key": b"\x81\x80\x01",
    "non-utf8-string": b"\x92\xa1a\xa2\xff\xfe",
    "non-utf8-key": b"\x81\xa1\xff\x01",
    "reserved-byte": b"\x91\xc1",
    "truncated": b"\x93\x01\x02",
    "nested-too-deep": b"\x91" * 1100 + b"\xc0",
}
#: Values whose extension payloads LangGraph's decoder cannot read: a stock reader gets ``None`` or the
#: raw argument in their place (silently), or fails (a DeltaChannel snapshot).
UNREADABLE_PAYLOADS = {
    "ext-key-in-a-models-fields": ormsgpack.packb(
        [ormsgpack.Ext(2, b"\x93\xa5myapp\xa4Step\x81" + GADGET + b"\x01")]
    ),
    "ext-key-in-a-snapshot": ormsgpack.packb(ormsgpack.Ext(7, b"\x81" + GADGET + b"\x01")),
    "truncated-payload": ormsgpack.packb({"a": ormsgpack.Ext(5, b"\x94\xa5myapp")}),
}
#: Odd but readable: what ormsgpack decodes with LangGraph's options is accepted.
READABLE = {
    "int-key": b"\x81\x01\x01",
    "nil-key": b"\x81\xc0\x01",
    "bin-key": b"\x81\xc4\x01x\x01",
    "float-key": b"\x81\xcb" + b"\x00" * 8 + b"\x01",
    "array-key": b"\x81\x91\x01\x01",
    "msgpack-timestamp": b"\x91\xd6\xff\x00\x00\x00\x00",
    "nested-1000-deep": b"\x91" * 1000 + b"\xc0",
}


@pytest.mark.parametrize("data", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_a_value_no_reader_can_decode_is_refused(data: bytes):
    with pytest.raises(ValueError):  # what every reader would meet
        SERDE.loads_typed(("msgpack", data))
    refused = refusal(data)
    assert str(refused).startswith("values.notes: not msgpack a reader can decode (")
    assert "every reader of the thread" in str(refused)


@pytest.mark.parametrize("data", UNREADABLE_PAYLOADS.values(), ids=UNREADABLE_PAYLOADS.keys())
def test_an_extension_payload_no_reader_can_decode_is_refused(data: bytes):
    try:
        read = SERDE.loads_typed(("msgpack", data))
    except ValueError:
        pass
    else:  # the stock reader put something else in the payload's place
        assert None in (read if isinstance(read, list) else list(read.values()))
    refused = refusal(data)
    assert "the payload of msgpack extension code" in str(refused), str(refused)
    assert refused.field == "values.notes"


@pytest.mark.parametrize("data", READABLE.values(), ids=READABLE.keys())
def test_what_a_stock_reader_decodes_is_accepted(data: bytes):
    read = SERDE.loads_typed(("msgpack", data))
    check_value(data, "values.notes", DEFAULT)
    # The reader got the value: each is a one-entry map or array, and reads as one.
    assert len(read) == 1, read


# -- the policy and its setting -------------------------------------------------------------------


def test_an_allowlist_without_star_accepts_only_what_it_lists():
    policy = ExtensionPolicy(["myapp", "other.models:Thing", "http:HTTPStatus"])
    for module, name in [
        ("myapp", "Plan"),
        ("myapp.state", "Step"),
        ("other.models", "Thing"),
        ("http", "HTTPStatus"),
    ]:
        check_value(ormsgpack.packb(ext(0, module, name, 1)), "f", policy)
    check_value(packed([datetime.datetime(2026, 1, 1), HumanMessage("hi")]), "f", policy)  # safe types stay
    for module, name in [("myappx", "Plan"), ("other.models", "Other"), ("thirdparty", "Thing")]:
        assert "not an allowed state type" in str(refusal(ormsgpack.packb(ext(0, module, name, 1)), policy))


def test_star_and_entries_combine():
    # A standard-library Enum is refused by "*" alone (the service cannot tell it from a function).
    refusal(ormsgpack.packb(ext(0, "http", "HTTPStatus", 200)))
    data = ormsgpack.packb(ext(0, "http", "HTTPStatus", 200))
    check_value(data, "f", ExtensionPolicy(["*", "http:HTTPStatus"]))
    assert SERDE.loads_typed(("msgpack", data)) is HTTPStatus.OK


def test_configured_message_classes_are_accepted():
    data = ormsgpack.packb(ext(5, "mymessages", "Note", {}, "model_validate_json"))
    check_value(data, "f", ExtensionPolicy([], message_classes=[("mymessages", "Note")]))
    # The configured class is what lets it through: without it, the same value is refused.
    assert "mymessages" in str(refusal(data, ExtensionPolicy([])))


@pytest.mark.parametrize("entry", ["os.", "a b", "mod:", ":Cls", "mod:Cls.attr", "mod:not valid"])
def test_malformed_entries_are_refused_by_the_settings(entry: str):
    with pytest.raises(ValueError, match="allowed_state_types"):
        Settings(database="memory://", allowed_state_types=entry)


def test_the_setting_defaults_to_star_and_splits_on_commas():
    assert Settings(database="memory://").allowed_state_types == ["*"]
    assert Settings(database="memory://", allowed_state_types="myapp, other:Thing").allowed_state_types == [
        "myapp",
        "other:Thing",
    ]


def test_check_extensions_reads_blobs_only(tmp_path: Path):
    gadget = ormsgpack.packb(attack(0, ("os", "system"), tmp_path / "m"))
    check_extensions(
        {"a": 1, "b": "text", "c": Blob("encrypted", gadget), "d": Blob("msgpack", b"\x90")}, DEFAULT
    )
    with pytest.raises(UnsafeValueError, match=r"writes\[1\]"):
        check_extensions(
            [("writes[0]", Blob("msgpack", b"\x90")), ("writes[1]", Blob("msgpack", gadget))], DEFAULT
        )


# -- through the app: the setting decides, before anything is stored ----------------------------------


def _state_put(value: bytes, thread_id: str = "t1") -> dict[str, Any]:
    checkpoint = empty_checkpoint()
    checkpoint.pop("channel_values")
    checkpoint["channel_versions"] = {"notes": "1"}
    return {
        "config": {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}},
        "checkpoint": checkpoint,
        "values": {"notes": blob_to_wire("msgpack", value)},
        "metadata": {"source": "loop", "step": 1},
        "new_versions": {"notes": "1"},
    }


def _stored(client: TestClient, thread_id: str = "t1") -> Any:
    config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    return client.post("/v1/checkpoints/get", json={"config": config}).json()["checkpoint"]


@pytest.mark.parametrize(
    ("allowed", "accepted", "refused"),
    [
        (None, [Plan, Step, Color, Point], []),  # the default, *
        (f"{__name__}:Plan,{__name__}:Step,{__name__}:Color", [Plan, Step, Color], [Point]),
        (__name__.rpartition(".")[0], [Plan, Step, Color, Point], []),  # a package and its modules
        ("otherpkg", [], [Plan]),
    ],
    ids=["default", "classes", "package", "another-package"],
)
def test_the_setting_decides_which_state_types_are_stored(allowed, accepted, refused):
    settings = {"allowed_state_types": allowed} if allowed is not None else {}
    samples = {
        Plan: a_plan(),
        Step: Step("s", Color.RED, datetime.datetime(2026, 1, 1)),
        Color: Color.BLUE,
        Point: Point(1, 2),
    }
    with TestClient(create_app(Settings(database="memory://", **settings))) as client:
        for kind in accepted:
            response = client.post(
                "/v1/checkpoints/put", json=_state_put(packed(samples[kind]), kind.__name__)
            )
            assert response.status_code == 200, response.text
        for kind in refused:
            response = client.post(
                "/v1/checkpoints/put", json=_state_put(packed(samples[kind]), kind.__name__)
            )
            assert response.status_code == 422, response.text
            assert f"{__name__}.{kind.__name__}" in response.json()["detail"]
            assert "not an allowed state type" in response.json()["detail"]
            assert _stored(client, kind.__name__) is None


def test_a_pending_write_naming_code_is_refused_and_not_stored(tmp_path: Path):
    with TestClient(create_app(Settings(database="memory://"))) as client:
        assert client.post("/v1/checkpoints/put", json=_state_put(packed({"a": 1}))).status_code == 200
        checkpoint_id = _stored(client)["config"]["configurable"]["checkpoint_id"]
        config = {"configurable": {"thread_id": "t1", "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}
        gadget = ormsgpack.packb(attack(1, ("subprocess", "Popen"), tmp_path / "m"))
        writes = [
            ["notes", blob_to_wire("msgpack", packed(a_plan()))],
            ["notes", blob_to_wire("msgpack", gadget)],
        ]
        response = client.post("/v1/writes/put", json={"config": config, "writes": writes, "task_id": "t"})
        assert response.status_code == 422
        assert (
            "writes[1] (channel 'notes'): msgpack extension code 1 naming subprocess.Popen"
            in response.json()["detail"]
        )
        assert _stored(client)["pending_writes"] == [], "neither write was stored"


def test_an_extension_map_key_is_refused_at_put_and_write_and_the_thread_stays_readable(fresh_pg: str):
    """The value that used to be stored and then broke every read of its thread (the service's client and
    a stock PostgresSaver both failed with ValueError) is refused at put and at put_writes, naming the
    channel; nothing of it is stored, and both readers read the thread."""
    import psycopg
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg.rows import dict_row

    from reducing_saver.client import RemoteReducingSaver

    poisoned = blob_to_wire("msgpack", UNREADABLE["ext-key"])
    with TestClient(create_app(Settings(database=fresh_pg, extract=False, sweep=False))) as client:
        refused = client.post("/v1/checkpoints/put", json=_state_put(UNREADABLE["ext-key"]))
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"].startswith("values.notes: not msgpack a reader can decode")
        assert client.post("/v1/checkpoints/put", json=_state_put(packed({"a": 1}))).status_code == 200
        checkpoint_id = _stored(client)["config"]["configurable"]["checkpoint_id"]
        config = {"configurable": {"thread_id": "t1", "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}
        writes = [["notes", blob_to_wire("msgpack", packed({"b": 2}))], ["notes", poisoned]]
        refused = client.post("/v1/writes/put", json={"config": config, "writes": writes, "task_id": "t"})
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"].startswith(
            "writes[1] (channel 'notes'): not msgpack a reader can decode"
        )
        with RemoteReducingSaver("http://testserver", transport=client._transport) as saver:
            mine = saver.get_tuple({"configurable": {"thread_id": "t1"}})
            assert mine.checkpoint["channel_values"] == {"notes": {"a": 1}} and mine.pending_writes == []
    with psycopg.connect(fresh_pg, autocommit=True, row_factory=dict_row) as conn:
        theirs = PostgresSaver(conn).get_tuple({"configurable": {"thread_id": "t1", "checkpoint_ns": ""}})
    assert theirs.checkpoint["channel_values"] == {"notes": {"a": 1}} and theirs.pending_writes == []


def test_the_flag_sets_it():
    from reducing_saver.service.cli import build_parser, load_settings

    args = build_parser().parse_args(["serve", "--allow-state-type", "myapp,*"])
    assert load_settings(args).allowed_state_types == ["myapp", "*"]


# -- the messages channel: checked by the codec's decode, once ----------------------------------------


def _messages_put(value: bytes, thread_id: str) -> dict[str, Any]:
    put = _state_put(value, thread_id)
    put["values"] = {"messages": put["values"].pop("notes")}
    put["checkpoint"]["channel_versions"] = put["new_versions"] = {"messages": "1"}
    return put


def test_every_target_the_codec_accepts_the_policy_accepts_too():
    """What lets a messages value the codec reads skip the scan: the codec's safe values and classes are
    all targets the strictest policy (no allowed state types) accepts."""
    from reducing_saver.service.messages_codec import _SAFE_VALUES, SafeMessagesCodec

    codec = SafeMessagesCodec(["tests.service.security.test_extensions:Plan"])
    strict = ExtensionPolicy((), codec.allowed)
    for code, module, name, *method in _SAFE_VALUES:
        assert strict.refusal(code, module, name, *method) is None, (code, module, name)
    for module, name in codec.allowed:
        assert strict.refusal(5, module, name) is None, (module, name)


def test_a_put_reads_its_messages_value_once_and_still_refuses_code(tmp_path: Path, monkeypatch):
    from reducing_saver.service.messages_codec import SafeMessagesCodec

    decoded: list[bytes] = []
    decode = SafeMessagesCodec.decode

    def counting(self: Any, value: Any) -> Any:
        decoded.append(value.data)
        return decode(self, value)

    monkeypatch.setattr(SafeMessagesCodec, "decode", counting)
    scanned: list[str] = []
    scan = extensions.check_value
    monkeypatch.setattr(
        "reducing_saver.service.operations.saver.check_value",
        lambda data, field, policy: scanned.append(field) or scan(data, field, policy),
    )
    window = [HumanMessage("hi", id="1"), AIMessage("hello", id="2")]
    with TestClient(create_app(Settings(database="memory://"))) as client:
        response = client.post("/v1/checkpoints/put", json=_messages_put(packed(window), "ok"))
        assert response.status_code == 200, response.text
        assert len(decoded) == 1, "the extension check and the reducer share one decode"
        assert scanned == [], "a value the codec read was checked by it"

        # A message carrying a gadget: refused by the codec's decode, before anything is stored.
        gadget = ormsgpack.Ext(0, ormsgpack.packb(["os", "system", "true"]))
        payload = ormsgpack.packb(
            ["langchain_core.messages.human", "HumanMessage", {"content": gadget}, "model_validate"]
        )
        value = ormsgpack.packb([ormsgpack.Ext(5, payload)])
        response = client.post("/v1/checkpoints/put", json=_messages_put(value, "bad"))
        assert response.status_code == 422, response.text
        assert "os.system" in response.json()["detail"]
        assert _stored(client, "bad") is None

        # A DeltaChannel snapshot (the codec leaves it as it is): scanned as every other value.
        gadget = ormsgpack.packb(attack(0, ("os", "system"), tmp_path / "m"))
        snapshot = ormsgpack.packb(ormsgpack.Ext(7, gadget))
        response = client.post("/v1/checkpoints/put", json=_messages_put(snapshot, "delta"))
        assert response.status_code == 422, response.text
        assert "values.messages: msgpack extension code 0 naming os.system" in response.json()["detail"]
        assert scanned == ["values.messages"]
