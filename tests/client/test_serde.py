"""SafeJsonPlusSerializer (client/_serde.py): JsonPlus's bytes, read without running what they name.

Controls show the payloads are live: LangGraph's own ``JsonPlusSerializer`` runs them (a ``touch`` of a
marker in tmp_path, nothing worse); the safe serializer must leave the marker absent.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
import os
import subprocess
import sys
import time
import types
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any, NamedTuple

import ormsgpack
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde import _msgpack as lg_msgpack
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot
from langgraph.types import Send
from pydantic import BaseModel, SecretStr

from reducing_saver.client import SafeJsonPlusSerializer
from tests.hostile.corpus import TRIPWIRE_MODULE, attack

STOCK = JsonPlusSerializer()


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
    secret: SecretStr | None = None


def a_plan() -> Plan:
    due = datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.UTC)
    return Plan(title="t", steps=[Step("a", Color.RED, due)], origin=Point(1, 2))


def roundtrip(serde: Any, value: Any) -> Any:
    return serde.loads_typed(STOCK.dumps_typed(value))


def settle(marker: Path) -> bool:
    """Whether ``marker`` exists, after giving a started process time to create it."""
    time.sleep(0.3)
    return marker.exists()


# -- a graph's own types read back with no configuration ---------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        a_plan(),
        {
            "steps": [Step("b", Color.BLUE, datetime.datetime(2026, 1, 1))],
            "color": Color.RED,
            "at": Point(3, 4),
        },
        [
            uuid.UUID(int=7),
            Decimal("1.5"),
            datetime.date(2026, 1, 1),
            datetime.timedelta(3),
            Path("/tmp"),
            {1, 2},
        ],
        [HumanMessage("hi", id="h"), AIMessage("yo", id="a")],
        Send("node", {"x": 1}),
        _DeltaSnapshot([HumanMessage("hi", id="h"), Color.BLUE]),
        Plan(title="s", steps=[], origin=Point(0, 0), secret=SecretStr("pw")),
    ],
    ids=["pydantic", "dataclass-enum-namedtuple", "safe-types", "messages", "send", "snapshot", "secret"],
)
def test_state_types_read_back_as_jsonplus_reads_them(value: Any):
    got = roundtrip(SafeJsonPlusSerializer(), value)
    assert got == roundtrip(STOCK, value) == value
    assert type(got) is type(value)


def test_numpy_arrays_read_back():
    np = pytest.importorskip("numpy")
    got = roundtrip(SafeJsonPlusSerializer(), {"a": np.arange(6).reshape(2, 3)})
    assert got["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_it_writes_what_jsonplus_writes():
    value = {"plan": a_plan(), "messages": [HumanMessage("hi", id="h")]}
    assert SafeJsonPlusSerializer().dumps_typed(value) == STOCK.dumps_typed(value)


# -- gadgets are inert ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", [("os", "system"), ("subprocess", "Popen")])
@pytest.mark.parametrize("code", [0, 1, 2, 3, 5])
def test_gadgets_are_neither_imported_nor_called(code: int, target: tuple[str, str], tmp_path: Path):
    marker = tmp_path / "ran"
    data = ormsgpack.packb({"notes": attack(code, target, marker)})
    got = SafeJsonPlusSerializer().loads_typed(("msgpack", data))
    assert not settle(marker)
    argument = ormsgpack.unpackb(data, ext_hook=lambda code, payload: ormsgpack.unpackb(payload)[2])["notes"]
    assert got["notes"] == argument, "read as its argument, inert"


@pytest.mark.parametrize("target", [("os", "system"), ("subprocess", "Popen")])
def test_the_control_stock_jsonplus_runs_them(target: tuple[str, str], tmp_path: Path):
    marker = tmp_path / "ran"
    data = ormsgpack.packb([attack(1 if target[1] == "Popen" else 0, target, marker)])
    script = (
        "import sys, time\n"
        "from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer\n"
        "JsonPlusSerializer().loads_typed(('msgpack', sys.stdin.buffer.read()))\n"
        "time.sleep(0.5)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "LANGGRAPH_STRICT_MSGPACK"}
    subprocess.run([sys.executable, "-c", script], input=data, env=env, check=True, timeout=60)
    assert marker.exists(), "the payload is live"


@pytest.mark.parametrize("where", ["dataclass", "pydantic", "snapshot", "message"])
def test_nested_gadgets_are_inert(where: str, tmp_path: Path):
    marker = tmp_path / "ran"
    gadget = attack(1, ("subprocess", "Popen"), marker)

    def ext(code: int, *payload: Any) -> ormsgpack.Ext:
        return ormsgpack.Ext(code, ormsgpack.packb(payload))

    outer = {
        "dataclass": ext(2, __name__, "Step", {"name": gadget, "color": Color.RED.value, "due": None}),
        "pydantic": ext(
            5, __name__, "Plan", {"title": gadget, "steps": [], "origin": [0, 0]}, "model_validate_json"
        ),
        "snapshot": ormsgpack.Ext(7, ormsgpack.packb([gadget])),
        "message": ext(
            5,
            "langchain_core.messages.human",
            "HumanMessage",
            {"content": "x", "additional_kwargs": {"a": gadget}},
            "model_validate_json",
        ),
    }[where]
    SafeJsonPlusSerializer().loads_typed(("msgpack", ormsgpack.packb([outer])))
    assert not settle(marker)


def test_a_module_nobody_imported_is_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if TRIPWIRE_MODULE in sys.modules:
        pytest.skip("the tripwire module is already imported in this process")
    tripwire = tmp_path / "imported"
    monkeypatch.setenv("HOSTILE_TRIPWIRE", str(tripwire))
    value = ormsgpack.Ext(2, ormsgpack.packb((TRIPWIRE_MODULE, "State", {"a": 1})))
    assert SafeJsonPlusSerializer().loads_typed(("msgpack", ormsgpack.packb(value))) == {"a": 1}
    assert TRIPWIRE_MODULE not in sys.modules and not tripwire.exists()


def test_a_loaded_module_s_non_data_attributes_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A re-exported Popen, a function, and a module __getattr__ (which must not even run)."""
    asked: list[str] = []
    module = types.ModuleType("myapp_reexports")
    module.Popen = subprocess.Popen
    module.run = subprocess.run
    module.__getattr__ = lambda name: asked.append(name)  # PEP 562
    monkeypatch.setitem(sys.modules, "myapp_reexports", module)
    marker = tmp_path / "ran"
    for code, name, arg in [
        (1, "Popen", [["touch", str(marker)]]),
        (1, "run", [["touch", str(marker)]]),
        (0, "Lazy", 1),
    ]:
        value = ormsgpack.Ext(code, ormsgpack.packb(("myapp_reexports", name, arg)))
        assert SafeJsonPlusSerializer().loads_typed(("msgpack", ormsgpack.packb(value))) == arg
    assert not settle(marker)
    assert asked == []


def test_a_refused_type_is_logged_once(caplog: pytest.LogCaptureFixture, tmp_path: Path):
    data = ormsgpack.packb([attack(0, ("os", "system"), tmp_path / "m")] * 3)
    with caplog.at_level(logging.WARNING, logger="reducing_saver.client._serde"):
        SafeJsonPlusSerializer().loads_typed(("msgpack", data))
        SafeJsonPlusSerializer().loads_typed(("msgpack", data))
    assert sum("os.system" in record.getMessage() for record in caplog.records) <= 1


# -- strict mode and allowlists -------------------------------------------------------------------


def test_strict_mode_reads_only_registered_types(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(lg_msgpack, "STRICT_MSGPACK_ENABLED", True)
    strict = SafeJsonPlusSerializer()
    assert roundtrip(strict, Color.RED) == "red"  # read as its argument, like LangGraph's strict mode
    registered = strict.with_msgpack_allowlist([Color, (Step.__module__, "Step")])
    assert registered is not strict and roundtrip(registered, Color.RED) is Color.RED
    assert roundtrip(strict, Color.RED) == "red", "the original is unchanged"
    assert registered.with_msgpack_allowlist([Color]) is registered


def test_a_checkpointer_s_with_allowlist_keeps_it():
    saver = InMemorySaver(serde=SafeJsonPlusSerializer(loaded_data_classes=False)).with_allowlist(
        {(__name__, "Color")}
    )
    assert isinstance(saver.serde, SafeJsonPlusSerializer)
    assert roundtrip(saver.serde, Color.BLUE) is Color.BLUE
    assert roundtrip(saver.serde, Point(1, 2)) == {"x": 1, "y": 2}  # not registered: read as its fields


def test_allowed_types_are_read_even_when_not_data_classes():
    serde = SafeJsonPlusSerializer(allowed_types=[("fractions", "Fraction")])
    value = ormsgpack.packb(ormsgpack.Ext(1, ormsgpack.packb(("fractions", "Fraction", [1, 3]))))
    assert str(serde.loads_typed(("msgpack", value))) == "1/3"
    assert SafeJsonPlusSerializer().loads_typed(("msgpack", value)) == [1, 3]
