"""A graph's own types and code-naming values, end to end: real graphs, a real service, PostgreSQL.

* A graph whose state holds its own pydantic model, dataclass, Enum and namedtuple (defined here) runs
  through ``RemoteReducingSaver`` with no configuration and ``LANGGRAPH_STRICT_MSGPACK`` unset, sync and
  async, and a second saver reads the same types back.
* A value naming ``subprocess.Popen`` sent through the client, as a channel value or a pending write, is
  refused with 422 naming it, and nothing is stored.
* A value naming it written straight into the database (a stock ``PostgresSaver``, bypassing the
  service) reads as inert data through ``RemoteReducingSaver``, while a stock reader runs it.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import operator
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NamedTuple, TypedDict

import ormsgpack
import psycopg
import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.serde import _msgpack as lg_msgpack
from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from reducing_saver.client import BadRequestError, RemoteReducingSaver
from tests.hostile.corpus import attack
from tests.support.server import ROOT, run_service


class Priority(enum.Enum):
    LOW = "low"
    HIGH = "high"


class Point(NamedTuple):
    x: int
    y: int


@dataclasses.dataclass
class Task:
    name: str
    priority: Priority
    due: datetime.datetime


class Plan(BaseModel):
    title: str
    tasks: list[Task]
    origin: Point


class State(TypedDict):
    plan: Plan | None
    tasks: Annotated[list[Task], operator.add]
    priority: Priority
    turns: int


DUE = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)


def planner(state: State) -> dict[str, Any]:
    turn = state.get("turns", 0) + 1
    task = Task(f"task-{turn}", Priority.HIGH if turn % 2 else Priority.LOW, DUE)
    tasks = [*(state["plan"].tasks if state.get("plan") else []), task]
    return {
        "plan": Plan(title=f"plan-{turn}", tasks=tasks, origin=Point(turn, -turn)),
        "tasks": [task],
        "turns": turn,
    }


def checker(state: State) -> dict[str, Any]:
    # Reads the state the checkpointer gave back: these must be the real types, not dicts.
    assert isinstance(state["plan"], Plan) and isinstance(state["plan"].tasks[0], Task)
    assert all(isinstance(task.priority, Priority) for task in state["tasks"])
    return {"priority": state["tasks"][-1].priority}


def build(checkpointer: Any) -> Any:
    builder = StateGraph(State)
    builder.add_node("planner", planner)
    builder.add_node("checker", checker)
    builder.add_edge(START, "planner")
    builder.add_edge("planner", "checker")
    builder.add_edge("checker", END)
    return builder.compile(checkpointer=checkpointer)


def assert_typed(values: dict[str, Any], turns: int) -> None:
    plan = values["plan"]
    assert isinstance(plan, Plan) and plan.title == f"plan-{turns}" and plan.origin == Point(turns, -turns)
    assert type(plan.origin) is Point
    assert [type(task) for task in plan.tasks] == [Task] * turns
    assert [task.priority for task in values["tasks"]] == [Priority.HIGH, Priority.LOW, Priority.HIGH][:turns]
    assert values["tasks"][0].due == DUE
    assert values["priority"] is values["tasks"][-1].priority


@pytest.fixture
def service(tmp_path: Path, fresh_pg: str):
    with run_service(tmp_path, "--database", fresh_pg) as process:
        yield process


@pytest.fixture(autouse=True)
def _default_mode() -> None:
    assert not lg_msgpack.STRICT_MSGPACK_ENABLED, (
        "these tests are about LangGraph's default (non-strict) mode"
    )


def test_a_graph_with_its_own_types_round_trips_sync(service):
    config = {"configurable": {"thread_id": "typed-sync"}}
    with RemoteReducingSaver(service.url) as saver:
        graph = build(saver)
        for _ in range(3):
            graph.invoke({}, config)
        assert_typed(graph.get_state(config).values, 3)
    with RemoteReducingSaver(service.url) as reader:  # another process's saver, same thread
        assert_typed(build(reader).get_state(config).values, 3)
        writes = [value for item in reader.list(config) for _, _, value in item.pending_writes or ()]
        assert any(isinstance(value, Plan) for value in writes), "pending writes hold the types too"


async def test_a_graph_with_its_own_types_round_trips_async(service):
    config = {"configurable": {"thread_id": "typed-async"}}
    async with RemoteReducingSaver(service.url) as saver:
        graph = build(saver)
        for _ in range(3):
            await graph.ainvoke({}, config)
        assert_typed((await graph.aget_state(config)).values, 3)
        state = await build(saver).aget_state(config)
        assert_typed(state.values, 3)


def popen(marker: Path) -> ormsgpack.Ext:
    return attack(1, ("subprocess", "Popen"), marker)


def stored(database: str, thread_id: str) -> int:
    with psycopg.connect(database, autocommit=True) as conn:
        return sum(
            conn.execute(f"SELECT count(*) FROM {table} WHERE thread_id = %s", (thread_id,)).fetchone()[0]
            for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes")
        )


def test_a_value_naming_popen_is_refused_in_any_channel_and_write(service, fresh_pg: str, tmp_path: Path):
    marker = tmp_path / "ran"
    config = {"configurable": {"thread_id": "gadget", "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"notes": {"plan": popen(marker)}}
    checkpoint["channel_versions"] = {"notes": "1"}
    with RemoteReducingSaver(service.url) as saver:
        with pytest.raises(
            BadRequestError, match=r"values\.notes: msgpack extension code 1 naming subprocess\.Popen"
        ):
            saver.put(config, checkpoint, {"source": "loop", "step": 1}, {"notes": "1"})
        write_config = {"configurable": {**config["configurable"], "checkpoint_id": checkpoint["id"]}}
        with pytest.raises(
            BadRequestError,
            match=r"writes\[1\] \(channel 'notes'\): msgpack extension code 1 naming subprocess\.Popen",
        ):
            saver.put_writes(write_config, [("tasks", [1]), ("notes", [popen(marker)])], "task-1")
    assert stored(fresh_pg, "gadget") == 0
    time.sleep(0.3)
    assert not marker.exists()


STOCK_READER = """
import sys, time
from langgraph.checkpoint.postgres import PostgresSaver
with PostgresSaver.from_conn_string(sys.argv[1]) as saver:
    item = saver.get_tuple({"configurable": {"thread_id": "direct", "checkpoint_ns": ""}})
    assert item is not None
time.sleep(0.5)
"""


def test_a_value_naming_popen_written_into_the_database_is_inert_for_remote_readers(
    service, fresh_pg: str, tmp_path: Path
):
    marker = tmp_path / "ran"
    config = {"configurable": {"thread_id": "direct", "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    plan = Plan(title="p", tasks=[Task("t", Priority.LOW, DUE)], origin=Point(0, 0))
    checkpoint["channel_values"] = {"notes": popen(marker), "plan": plan}
    checkpoint["channel_versions"] = {"notes": "1", "plan": "1"}
    # Bypassing the service: an operator's stock saver, or anyone with the database's credentials.
    with PostgresSaver.from_conn_string(fresh_pg) as stock:
        next_config = stock.put(
            config, checkpoint, {"source": "loop", "step": 1}, {"notes": "1", "plan": "1"}
        )
        stock.put_writes(next_config, [("notes", popen(marker))], "task-1")

    with RemoteReducingSaver(service.url) as saver:
        item = saver.get_tuple(config)
    time.sleep(0.5)
    assert not marker.exists(), "RemoteReducingSaver ran the stored value"
    assert item.checkpoint["channel_values"]["notes"] == [["touch", str(marker)]], "read as its argument"
    assert item.checkpoint["channel_values"]["plan"] == plan, "the graph's own type next to it still reads"
    assert [value for _, _, value in item.pending_writes] == [[["touch", str(marker)]]]

    # The control: LangGraph's stock reader runs the very same rows.
    env = {key: value for key, value in os.environ.items() if key != "LANGGRAPH_STRICT_MSGPACK"}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-c", STOCK_READER, fresh_pg], env=env, check=True, timeout=60)
    assert marker.exists(), "a stock reader runs it"
