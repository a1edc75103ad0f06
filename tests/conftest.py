"""Shared fixtures: a PostgreSQL database of this test run's own, a PostgreSQL with pgvector, and small
chat graphs."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

PG_HOST = os.environ.get("REDUCING_SAVER_TEST_PGHOST", "127.0.0.1")
PG_PORT = os.environ.get("REDUCING_SAVER_TEST_PGPORT", "5432")
PG_USER = os.environ.get("REDUCING_SAVER_TEST_PGUSER", "postgres")


#: The test lanes, by where a test lives: ``tests/e2e/`` starts real processes (the service under uvicorn,
#: the command line, agents, ``langgraph dev``) and is left out of the fast lane (``scripts/test``);
#: the compose tests also need a Docker engine (so does a test that runs the service in the image: it marks
#: itself). Everything else runs in-process.
LANES = {"e2e": ("tests/e2e/",), "compose": ("tests/e2e/test_compose.py",)}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the lanes its path puts it in (``-m "not e2e"`` is the fast lane)."""
    for item in items:
        where = "tests/" + item.path.resolve().relative_to(TESTS).as_posix()
        for marker, prefixes in LANES.items():
            if where.startswith(prefixes):
                item.add_marker(marker)


def pg_url(database: str) -> str:
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{database}"


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loopback requests must never go through a proxy configured on the machine."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "*")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A database created for this test run (and dropped after it), so runs never see each other's rows."""
    name = f"rs_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url(name)
    finally:
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def make_database(pg_database: str) -> Iterator[Callable[[], str]]:
    """Create empty databases for one test (dropped after it); returns their URLs."""
    prefix = pg_database.rsplit("/", 1)[1]
    names: list[str] = []

    def create() -> str:
        name = f"{prefix}_{len(names)}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        names.append(name)
        return pg_url(name)

    yield create
    with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_pg(make_database: Callable[[], str]) -> str:
    """A database of its own for one test: the saver tables start empty."""
    return make_database()


@pytest.fixture(scope="session")
def pgvector_server() -> Iterator[str]:
    """A PostgreSQL with the pgvector extension for this run, stopped and deleted after it; its URL.

    The server at ``PG_HOST:PG_PORT`` may have no pgvector (Debian packages none for PostgreSQL 15), so
    vector search runs on the PostgreSQL 16 with pgvector that the test extra's ``pgserver`` ships
    in its wheel. It listens on a unix socket in its data folder only (``postgresql://postgres:@/postgres
    ?host=DATA``). As root, pgserver runs it as a ``pgserver`` user and makes every folder above the data
    folder and above its binaries (in the virtual environment) readable and traversable by all, hence a
    data folder of its own directly in the temporary directory rather than under pytest's private one.
    """
    with warnings.catch_warnings():
        # platformdirs warns at pgserver's import when XDG_RUNTIME_DIR is unset (as for root in CI).
        warnings.simplefilter("ignore")
        import pgserver

    data = Path(tempfile.mkdtemp(prefix="reducing-saver-pgvector-"))
    try:
        server = pgserver.get_server(data, cleanup_mode="delete")
        try:
            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                # A throwaway cluster: no waiting for the disk.
                conn.execute("ALTER SYSTEM SET fsync = off")
                conn.execute("ALTER SYSTEM SET synchronous_commit = off")
                conn.execute("SELECT pg_reload_conf()")
            yield server.get_uri()
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def pgvector_db(pgvector_server: str) -> Iterator[str]:
    """A database of its own on :func:`pgvector_server` for one test (dropped after it); its URL."""
    name = f"rs_vec_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pgvector_server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, query = pgvector_server.partition("?")
    try:
        yield f"{base.rsplit('/', 1)[0]}/{name}?{query}"
    finally:
        with psycopg.connect(pgvector_server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- a chat-API validity check shared by the reducer, saver and storage tests -----------------------

_CHUNK_KINDS = {
    "AIMessageChunk": "ai",
    "HumanMessageChunk": "human",
    "SystemMessageChunk": "system",
    "ToolMessageChunk": "tool",
}


def _msg_get(message, name):
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def msg_kind(message) -> str:
    """``"system"``, ``"human"``, ``"ai"``, ``"tool"``, ... for message objects and ``model_dump()`` dicts."""
    kind = _msg_get(message, "type") or ""
    return _CHUNK_KINDS.get(kind, kind)


def api_window_problems(window, *, start_on="human") -> list[str]:
    """Why ``window`` is not a message list a chat-model API accepts; empty when it is one.

    Written independently of the reducer, from the rules an API enforces:

    * with ``start_on="human"`` the first message after an optional leading system message is human;
    * every tool message answers a tool call of an earlier AI message in the window;
    * every tool call of an AI message is answered by a later tool message, except the calls of the
      newest message when it is an AI message whose tools have not run yet.
    """
    problems: list[str] = []
    head = 1 if window and msg_kind(window[0]) == "system" else 0
    if start_on == "human" and len(window) > head and msg_kind(window[head]) != "human":
        problems.append(f"window starts on {msg_kind(window[head])!r} at index {head}, not on a human message")
    open_calls: dict[str, int] = {}
    answered: set[str] = set()
    for index, message in enumerate(window):
        kind = msg_kind(message)
        if kind == "ai":
            for call in _msg_get(message, "tool_calls") or ():
                open_calls[call["id"]] = index
        elif kind == "tool":
            call_id = _msg_get(message, "tool_call_id")
            if call_id not in open_calls:
                problems.append(f"tool message at index {index} answers {call_id!r}, a call not in the window")
            answered.add(call_id)
    last = len(window) - 1
    for call_id, index in open_calls.items():
        if call_id not in answered and index != last:
            problems.append(f"tool call {call_id!r} of the AI message at index {index} has no result")
    return problems


@pytest.fixture(scope="session")
def window_problems():
    """:func:`api_window_problems`, for tests that check stored windows."""
    return api_window_problems


# -- a real LangGraph chat graph answered by a langchain_core fake chat model -----------------------


def padded(text: str, length: int = 400) -> str:
    """``text`` padded to exactly ``length`` characters, so message sizes do not drift between turns."""
    return text.ljust(length, ".")[:length]


def human(turn: int, prefix: str = "g", length: int = 400):
    from langchain_core.messages import HumanMessage

    return HumanMessage(padded(f"question {turn}", length), id=f"{prefix}-h-{turn:04d}")


def build_chat_graph(checkpointer, *, prefix: str = "g", length: int = 400, with_tools: bool = False, state_schema=None):
    """A compiled ``StateGraph(MessagesState)`` whose chat node answers with ``GenericFakeChatModel``.

    Without tools each turn adds one AI answer of ``length`` characters. With tools, on two turns out of
    three the model first calls one or two tools (answered by a prebuilt ``ToolNode``), then answers.
    Ids are deterministic and fixed-width (``f"{prefix}-ai-{turn:04d}"``), so sizes do not drift.
    """
    import itertools

    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    def answers():
        for turn in itertools.count():
            if with_tools and turn % 3 != 2:
                calls = [
                    {"id": f"{prefix}-call-{turn:04d}-{k}", "name": "lookup", "args": {"q": f"turn {turn:04d} part {k}"}}
                    for k in range(1 + turn % 2)
                ]
                yield AIMessage("", id=f"{prefix}-ai-{turn:04d}-call", tool_calls=calls)
            yield AIMessage(padded(f"answer {turn}", length), id=f"{prefix}-ai-{turn:04d}")

    model = GenericFakeChatModel(messages=answers())

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        return padded(f"result for {q}", length)

    def chat(state):
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(state_schema or MessagesState)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    if with_tools:
        builder.add_node("tools", ToolNode([lookup]))
        builder.add_conditional_edges("chat", tools_condition)
        builder.add_edge("tools", "chat")
    else:
        builder.add_edge("chat", END)
    return builder.compile(checkpointer=checkpointer)


def build_subgraph_chat(checkpointer, **chat):
    """A parent graph whose one node is :func:`build_chat_graph` (``chat`` its arguments) as a subgraph
    sharing ``messages``, the usual multi-agent shape: each turn the subgraph checkpoints the parent's
    window in a namespace of its own (``inner:<task id>``) and hands the messages back."""
    from langgraph.graph import START, MessagesState, StateGraph

    parent = StateGraph(MessagesState)
    parent.add_node("inner", build_chat_graph(None, **chat))
    parent.add_edge(START, "inner")
    return parent.compile(checkpointer=checkpointer)


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the figures tests recorded (``record_property("<topic> figures", ...)``) after the run."""
    lines = [
        f"{report.nodeid}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name.endswith(" figures")
    ]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)
