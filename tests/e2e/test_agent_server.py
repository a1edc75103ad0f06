"""LangGraph Agent Server with the service as its checkpointer and store (reducing_saver.client.agent_server).

The unit tests open savers and stores under blockbuster, the blocking-call detector Agent Server runs its
graphs under. The end-to-end test runs `langgraph dev` (from the `agent-server` extra, which scripts/test
installs into .venv-agent-server: its pins conflict with the test extra's) on tests/e2e/agent_server_project,
drives it with langgraph_sdk (runs, and Agent Server's own /store routes), and checks what the service
stored and extracted, and that the graph's runtime.store found the extracted memories: once with a shared
loop on the memory backend, once with BG_JOB_ISOLATED_LOOPS=true on PostgreSQL with an API key (the items
then live under the tenant's prefix). A second graph of the project runs with the service's running summaries
(a deterministic ``--summarizer``): Agent Server's get_state, forks from its history and update_state see
the one summary each checkpoint carries. Offline: no telemetry, no browser, no
LangSmith key, loopback only. Without `langgraph` it skips on a developer's machine and fails in CI
(``CI=true``).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blockbuster import BlockBuster, BlockingError
from langgraph.checkpoint.base import BaseCheckpointSaver

from reducing_saver.client import (
    AuthenticationError,
    RemoteReducingSaver,
    RemoteStore,
    ServerUnavailableError,
    _http,
    agent_server,
)
from tests.support.server import ROOT, free_port, run_service

PROJECT = Path(__file__).with_name("agent_server_project")
CHECKPOINTER_PATH = "reducing_saver.client.agent_server.checkpointer"
STORE_PATH = "reducing_saver.client.agent_server.store"
MAX_MESSAGES = 6


@pytest.fixture
def blockbuster() -> Iterator[BlockBuster]:
    """Every blocking call blockbuster knows fails on a running event loop (Agent Server disables some)."""
    detector = BlockBuster()
    detector.activate()
    try:
        yield detector
    finally:
        detector.deactivate()


@pytest.fixture
def service(tmp_path: Path):
    args = ("--database", "memory://", "--max-messages", str(MAX_MESSAGES), "--min-messages", "4")
    with run_service(tmp_path, *args) as process:
        yield process


# -- the async opener --------------------------------------------------------------------------------------


# httpcore leaves the socket the detector interrupted unclosed: its ResourceWarning is not this test's point.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_the_constructor_is_what_the_detector_catches(service, blockbuster) -> None:
    # The trap of the issue: the sync constructor connects a blocking socket on the running loop.
    with pytest.raises(BlockingError, match="socket.socket.connect"):
        RemoteReducingSaver(service.url)
    blockbuster.deactivate()
    gc.collect()


async def test_aopen_makes_no_blocking_call_on_the_loop(service, blockbuster) -> None:
    saver = await RemoteReducingSaver.aopen(service.url)
    try:
        config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
        assert await saver.aget_tuple(config) is None
        assert "copy_thread" in saver.capabilities
        assert type(saver).acopy_thread is not BaseCheckpointSaver.acopy_thread
    finally:
        await saver.aclose()
    blockbuster.deactivate()
    with RemoteReducingSaver(service.url) as sync_saver:
        assert type(sync_saver) is type(saver)
        assert (sync_saver.reducer, sync_saver.backend, sync_saver.body_format) == (
            saver.reducer,
            saver.backend,
            saver.body_format,
        )


async def test_aopen_sends_through_the_async_transport() -> None:
    capabilities = {
        "capabilities": ["delete_for_runs"],
        "backend": "memory",
        "messages_key": "messages",
        "reducer": {
            "max_messages": 6,
            "min_messages": 4,
            "max_tokens": None,
            "target_tokens": None,
            "preserve_first": True,
            "cascade_tool_messages": True,
            "start_on": "human",
            "namespace_key": "memory_namespace",
        },
        "version": "9.9.9",
        "body_formats": ["application/json"],
    }
    seen: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"sync transport used for {request.url}")

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json=capabilities)

    saver = await RemoteReducingSaver.aopen(
        "http://reducing-saver.invalid",
        transport=httpx.MockTransport(refuse),
        async_transport=httpx.MockTransport(answer),
    )
    assert seen == ["GET /v1/capabilities"]
    # Agent Server detects capabilities the same way: which methods the class overrides.
    assert saver.capabilities == frozenset({"delete_for_runs"})
    assert type(saver).adelete_for_runs is not BaseCheckpointSaver.adelete_for_runs
    assert type(saver).acopy_thread is BaseCheckpointSaver.acopy_thread
    assert saver.server_version == "9.9.9" and saver.body_format == "application/json"
    await saver.aclose()


async def test_aopen_failure_names_the_service() -> None:
    with pytest.raises(ServerUnavailableError, match="capabilities"):
        await RemoteReducingSaver.aopen(f"http://127.0.0.1:{free_port()}", max_retries=0, startup_timeout=1)
    with pytest.raises(ValueError, match="body_format"):
        await RemoteReducingSaver.aopen("http://127.0.0.1:1", body_format="xml")


# -- the store's async opener ------------------------------------------------------------------------------


async def test_store_aopen_builds_off_the_loop_and_sends_nothing(monkeypatch) -> None:
    # The constructor sends no request but builds an SSL context (it reads the CA bundle): blockbuster does
    # not see that C-level read, so the test records where the transport is built.
    built_in: list[int] = []
    real_init = _http.Http.__init__

    def recording_init(self, *args, **kwargs) -> None:
        built_in.append(threading.get_ident())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(_http.Http, "__init__", recording_init)
    seen: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"results": [None]})

    store = await RemoteStore.aopen(
        "http://reducing-saver.invalid", async_transport=httpx.MockTransport(answer)
    )
    assert built_in and threading.get_ident() not in built_in
    assert seen == [], "opening sends no request"
    assert await store.aget(("a",), "k") is None
    assert seen == ["POST /store/batch"]
    await store.aclose()
    with pytest.raises(ValueError, match="http"):
        await RemoteStore.aopen("postgresql://db/x")


async def test_store_aopen_makes_no_blocking_call_on_the_loop(service, blockbuster) -> None:
    store = await RemoteStore.aopen(service.url)
    try:
        await store.aput(("notes", "t"), "k", {"text": "green tea"})
        assert (await store.aget(("notes", "t"), "k")).value == {"text": "green tea"}
        assert [i.key for i in await store.asearch(("notes",))] == ["k"]
        assert await store.alist_namespaces(prefix=("notes",)) == [("notes", "t")]
    finally:
        await store.aclose()


# -- the factories -------------------------------------------------------------------------------------------


def _load_like_agent_server(path: str):
    # langgraph_api._checkpointer._adapter._load_checkpointer: a module path is split on its last dot.
    module, attr = path.rsplit(".", 1)
    return importlib.import_module(module).__dict__[attr]


async def test_factory_opens_from_the_environment_without_blocking(service, blockbuster, monkeypatch) -> None:
    monkeypatch.setenv("REDUCING_SAVER_URL", service.url)
    factory = _load_like_agent_server(CHECKPOINTER_PATH)
    assert factory is agent_server.checkpointer
    async with factory() as saver:
        assert isinstance(saver, RemoteReducingSaver) and saver.backend == "memory"
        assert await saver.aget_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}}) is None
    with pytest.raises(RuntimeError, match="this RemoteReducingSaver is closed"):
        await saver.aget_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}})


async def test_store_factory_opens_from_the_environment_without_blocking(
    service, blockbuster, monkeypatch
) -> None:
    monkeypatch.setenv("REDUCING_SAVER_URL", service.url)
    factory = _load_like_agent_server(STORE_PATH)
    assert factory is agent_server.store
    async with factory() as store:
        assert isinstance(store, RemoteStore) and store.url == service.url
        await store.aput(("memories", "t"), "m", {"text": "hello"})
        assert [i.key for i in await store.asearch(("memories", "t"))] == ["m"]
    with pytest.raises(RuntimeError, match="closed"):
        await store.aget(("memories", "t"), "m")


async def test_store_factory_in_another_loop_thread_under_blockbuster(
    service, blockbuster, monkeypatch
) -> None:
    # BG_JOB_ISOLATED_LOOPS=true: Agent Server enters the factory again in each run thread's own loop.
    monkeypatch.setenv("REDUCING_SAVER_URL", service.url)

    async def in_own_loop() -> list[str]:
        async with agent_server.store() as store:
            await store.aput(("notes", "loop"), "k", {"v": 1})
            return [i.key for i in await store.asearch(("notes", "loop"))]

    assert await asyncio.to_thread(asyncio.run, in_own_loop()) == ["k"]


async def test_factory_sends_the_api_key_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    args = ("--database", "memory://")
    with run_service(tmp_path, *args, env={"REDUCING_SAVER_API_KEYS": "agents=factory-key"}) as keyed:
        monkeypatch.setenv("REDUCING_SAVER_URL", keyed.url)
        monkeypatch.delenv("REDUCING_SAVER_API_KEY", raising=False)
        with pytest.raises(AuthenticationError):
            async with agent_server.checkpointer():
                pass
        monkeypatch.setenv("REDUCING_SAVER_API_KEY", "factory-key")
        async with agent_server.checkpointer() as saver:
            assert await saver.aget_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}}) is None
        async with agent_server.store() as store:
            await store.aput(("notes",), "k", {"v": 1})
            assert (await store.aget(("notes",), "k")).value == {"v": 1}
        monkeypatch.setenv("REDUCING_SAVER_API_KEY", "wrong-key")
        async with agent_server.store() as store:  # opening sends nothing: the first call says
            with pytest.raises(AuthenticationError):
                await store.aget(("notes",), "k")


async def test_factory_without_url_says_which_variable(monkeypatch) -> None:
    monkeypatch.delenv("REDUCING_SAVER_URL", raising=False)
    with pytest.raises(RuntimeError, match="REDUCING_SAVER_URL"):
        async with agent_server.checkpointer():
            pass
    with pytest.raises(RuntimeError, match="REDUCING_SAVER_URL"):
        async with agent_server.store():
            pass


# -- end to end: langgraph dev ------------------------------------------------------------------------------


def _langgraph_cli() -> Path:
    override = os.environ.get("REDUCING_SAVER_TEST_LANGGRAPH")
    cli = Path(override) if override else ROOT / ".venv-agent-server" / "bin" / "langgraph"
    if not cli.exists():
        reason = f"{cli} not found (scripts/test installs the agent-server extra into .venv-agent-server)"
        if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}:
            pytest.fail(f"{reason}; CI=true, so the Agent Server test must run, not skip")
        pytest.skip(reason)
    return cli


def _offline_env(extra: dict[str, str]) -> dict[str, str]:
    drop = ("LANGSMITH_", "LANGCHAIN_", "LANGGRAPH_", "REDUCING_SAVER_", "BG_JOB_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {
        **env,
        "LANGGRAPH_CLI_NO_ANALYTICS": "1",  # langgraph-cli's usage report
        "LANGSMITH_TRACING": "false",
        "LANGCHAIN_TRACING_V2": "false",
        "NO_PROXY": "127.0.0.1,localhost",
        **extra,
    }


def _wait_ok(url: str, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"langgraph dev exited with {process.returncode}:\n{log.read_text(errors='replace')}"
            )
        try:
            if httpx.get(f"{url}/ok", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"langgraph dev not ready after {timeout}s:\n{log.read_text(errors='replace')}")


#: The metrics scraper's key of a service with tenant keys: /metrics answers no tenant's.
SCRAPER_KEY = "scraper-key"


def _routes(service_url: str, headers: dict[str, str]) -> dict[str, float]:
    """Successful requests the service counted, by "METHOD /route" (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{service_url}/metrics", headers=headers).text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "reducing_saver_http_requests_total" and labels["status"].startswith("2"):
                route = f"{labels['method']} {labels['route']}"
                counts[route] = counts.get(route, 0) + sample.value
    return counts


def _drained(service_url: str, headers: dict[str, str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(f"{service_url}/v1/extraction/status", headers=headers, timeout=5).json()
        if status["pending"] == 0 and status["in_flight"] == 0:
            return status
        assert time.monotonic() < deadline, f"outbox not drained after {timeout}s: {status}"
        time.sleep(0.2)


def _human(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text + " " + "y" * 300}]}


#: The key Agent Server's factories send in the keyed run; the service's tenant for it.
TENANT, TENANT_KEY = "agents", "agent-server-key"


class _ServiceStore:
    """What the service stored, read beside Agent Server: PostgresStore on the database itself (where a
    tenant's items live under ``("tenants", tenant, ...)``), or a RemoteStore for ``memory://``."""

    def __init__(self, service_url: str, database: str, api_key: str | None) -> None:
        from langgraph.store.postgres import PostgresStore

        self.prefix: tuple[str, ...] = ("tenants", TENANT) if api_key else ()
        if database.startswith("postgresql"):
            self._context = PostgresStore.from_conn_string(database)
            self.store = self._context.__enter__()
        else:
            assert not api_key, "memory:// is read through the service: run it without keys"
            self._context = self.store = RemoteStore(service_url)

    def keys(self, *namespace: str) -> set[str]:
        return {i.key for i in self.store.search((*self.prefix, *namespace), limit=1000)}

    def get(self, *namespace: str, key: str):
        return self.store.get((*self.prefix, *namespace), key)

    def close(self) -> None:
        self._context.__exit__(None, None, None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("isolated_loops", "backend", "api_key"),
    [(False, "memory", None), (True, "postgres", TENANT_KEY)],
    ids=["shared-loop-memory", "isolated-loops-postgres-keyed"],
)
def test_langgraph_dev_keeps_its_threads_in_the_service(
    tmp_path: Path, request: pytest.FixtureRequest, isolated_loops: bool, backend: str, api_key: str | None
) -> None:
    from langgraph_sdk import get_sync_client

    cli = _langgraph_cli()
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project)
    database = request.getfixturevalue("fresh_pg") if backend == "postgres" else "memory://"
    keys_env = (
        {"REDUCING_SAVER_API_KEYS": f"{TENANT}={api_key}", "REDUCING_SAVER_METRICS_KEY": SCRAPER_KEY}
        if api_key
        else {}
    )
    with run_service(
        tmp_path,
        *("--database", database, "--max-messages", str(MAX_MESSAGES), "--min-messages", "4"),
        env=keys_env,
    ) as service:
        # The service's URL (and key) reach the factories through langgraph.json's "env", as in a deployment.
        config_file = project / "langgraph.json"
        config = json.loads(config_file.read_text())
        config["env"] = {
            "REDUCING_SAVER_URL": service.url,
            **({"REDUCING_SAVER_API_KEY": api_key} if api_key else {}),
        }
        assert config["checkpointer"]["path"] == CHECKPOINTER_PATH
        assert config["store"]["path"] == STORE_PATH
        config_file.write_text(json.dumps(config))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tmp_path / "langgraph-dev.log"
        env = _offline_env({"BG_JOB_ISOLATED_LOOPS": "true"} if isolated_loops else {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(cli), "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", str(port)],
                cwd=project,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        stored = _ServiceStore(service.url, database, api_key)
        try:
            _wait_ok(url, process, log)
            with get_sync_client(url=url, api_key=None) as client:
                _drive(client, url, service.url, api_key, stored)
        finally:
            stored.close()
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        text = log.read_text(errors="replace")
        assert "Using custom checkpointer: RemoteReducingSaver" in text
        assert f"Using custom store: RemoteStore('{service.url}')" in text
        assert "BlockingError" not in text and "Blocking call" not in text, text[-4000:]
        if isolated_loops:  # the factories were entered again in a run thread's loop, under blockbuster
            assert "Starting queue with isolated loops" in text
            assert text.count("Using custom checkpointer: RemoteReducingSaver") >= 2
            assert text.count("Using custom store: RemoteStore") >= 2
        routes = _routes(service.url, {"Authorization": f"Bearer {SCRAPER_KEY}"} if api_key else {})
        # The messages the windows cut went on to long-term memory (the service's extraction).
        extraction = _drained(service.url, headers)
        assert extraction["delivered"] > 0, extraction
    # What Agent Server asked of the service.
    for route in (
        "POST /v1/checkpoints/put",
        "POST /v1/writes/put",
        "POST /v1/checkpoints/get",
        "POST /v1/checkpoints/list",
        "POST /v1/threads/copy",
        "POST /v1/runs/delete",
        "POST /v1/threads/delete",
        "POST /store/batch",
    ):
        assert route in routes, sorted(routes)


def _stored(saver: RemoteReducingSaver, thread_id: str) -> list:
    return list(saver.list({"configurable": {"thread_id": thread_id}}))


def _ancestry(history: list[dict]) -> list[str]:
    """The checkpoint ids from the newest back to the first, following parent links."""
    parents = {
        h["checkpoint"]["checkpoint_id"]: (h.get("parent_checkpoint") or {}).get("checkpoint_id")
        for h in history
    }
    chain, current = [], history[0]["checkpoint"]["checkpoint_id"]
    while current is not None:
        chain.append(current)
        current = parents.get(current)
    return chain


def _drive(client, url: str, service_url: str, api_key: str | None, stored: _ServiceStore) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    thread = client.threads.create()["thread_id"]
    last = None
    for turn in range(6):  # 12 messages: the stored window must have been cut
        last = client.runs.wait(thread, "agent", input=_human(f"turn {turn}"), raise_error=True)
    assert last["messages"][-1]["type"] == "ai"
    # A run's output and Agent Server's thread row carry the state as the run built it (the stored window plus
    # the turn's messages); get_state shows what the service stored, the window cut again.
    stored_now = client.threads.get_state(thread)["values"]["messages"]
    assert len(stored_now) < len(last["messages"]) == 8
    assert len(client.threads.get(thread)["values"]["messages"]) == len(last["messages"])
    assert stored_now == last["messages"][-len(stored_now) :]

    _check_the_store(client, thread, service_url, headers, stored)
    chunks = list(client.runs.stream(thread, "agent", input=_human("streamed"), stream_mode="values"))
    assert any(c.event == "values" for c in chunks)

    state = client.threads.get_state(thread)
    assert 0 < len(state["values"]["messages"]) <= MAX_MESSAGES
    assert state["values"]["messages"][-1]["content"].startswith("answer")

    history = client.threads.get_history(thread, limit=3)
    assert len(history) == 3
    # `before` through GET .../history?before=<id>: the SDK's POST form hands its checkpoint dict to the saver
    # as it is, without "configurable", where the saver reads no checkpoint id.
    older = httpx.get(
        f"{url}/threads/{thread}/history",
        params={"limit": 2, "before": history[0]["checkpoint"]["checkpoint_id"]},
    ).json()
    assert len(older) == 2
    assert older and older[0]["checkpoint"]["checkpoint_id"] == history[1]["checkpoint"]["checkpoint_id"]
    loops = client.threads.get_history(thread, limit=50, metadata={"source": "loop"})
    assert loops and all(h["metadata"]["source"] == "loop" for h in loops)

    client.threads.update_state(thread, {"messages": [{"role": "user", "content": "a note from outside"}]})
    assert client.threads.get_state(thread)["values"]["messages"][-1]["content"] == "a note from outside"

    # A fork: a run from an older checkpoint leaves the newer branch as it was.
    fork_from = history[2]["checkpoint"]
    forked = client.runs.wait(thread, "agent", input=_human("fork"), checkpoint=fork_from, raise_error=True)
    assert forked["messages"][-1]["type"] == "ai"
    assert all(m["content"] != "a note from outside" for m in forked["messages"])
    ancestry = _ancestry(client.threads.get_history(thread, limit=100))
    assert (
        fork_from["checkpoint_id"] in ancestry and history[0]["checkpoint"]["checkpoint_id"] not in ancestry
    )

    # An interrupt and its resume.
    paused = client.runs.wait(thread, "agent", input=_human("confirm the order"), raise_error=True)
    assert paused.get("__interrupt__"), paused
    assert client.threads.get_state(thread)["next"] == ["confirm"]
    done = client.runs.wait(thread, "agent", command={"resume": "yes"}, raise_error=True)
    assert done["messages"][-1]["content"] == "confirmed: yes"
    assert client.threads.get_state(thread)["next"] == []

    # multitask_strategy="rollback": the interrupted run's checkpoints leave the service (runs/delete).
    slow = client.runs.create(thread, "agent", input=_human("slow turn"))
    deadline = time.monotonic() + 30
    with RemoteReducingSaver(service_url, api_key=api_key) as saver:
        while not any(t.metadata.get("run_id") == slow["run_id"] for t in _stored(saver, thread)):
            assert time.monotonic() < deadline, "the slow run stored no checkpoint"
            time.sleep(0.1)
        after = client.runs.wait(
            thread, "agent", input=_human("after rollback"), multitask_strategy="rollback", raise_error=True
        )
        assert after["messages"][-1]["type"] == "ai"
        assert not [t for t in _stored(saver, thread) if t.metadata.get("run_id") == slow["run_id"]]

        # threads.copy, then threads.delete of the copy.
        copy = client.threads.copy(thread)["thread_id"]
        assert len(_stored(saver, copy)) == len(_stored(saver, thread))
        assert client.threads.get_state(copy)["values"] == client.threads.get_state(thread)["values"]
        client.threads.delete(copy)
        assert _stored(saver, copy) == []
        assert _stored(saver, thread)

        # What the service stored: every checkpoint's window bounded, although the thread is longer.
        stored = _stored(saver, thread)
        windows = [len(t.checkpoint["channel_values"].get("messages") or []) for t in stored]
        assert max(windows) <= MAX_MESSAGES, windows


def _check_the_store(
    client, thread: str, service_url: str, headers: dict[str, str], stored: _ServiceStore
) -> None:
    """The graph's runtime.store and Agent Server's /store routes reach the service's store."""
    # The `remember` node's notes, written through runtime.store, are in the service's store (in the
    # tenant's subtree when keyed), and nowhere else.
    assert stored.keys("notes", thread) == {f"turn-{n}" for n in range(6)}
    if stored.prefix:
        assert not stored.store.search(("notes",)), "a tenant's items live under its prefix only"
    # The memories the service extracted from the cut messages: the node finds them through the same store.
    _drained(service_url, headers)
    extracted = stored.keys("memories", thread)
    assert extracted, "the windows cut messages, which the service extracts"
    memory = stored.get("memories", thread, key=min(extracted))
    assert memory.value["data"]["content"].startswith(("turn", "answer"))
    client.runs.wait(thread, "agent", input=_human("recall"), raise_error=True)
    recall = stored.get("recall", thread, key="latest").value
    assert recall["turn"] == "recall"
    _drained(service_url, headers)
    assert extracted <= set(recall["keys"]) <= stored.keys("memories", thread), recall

    # Agent Server's own store API (langgraph_sdk's client.store against langgraph dev) goes to the service.
    assert {
        i["key"] for i in client.store.search_items(["memories", thread], limit=100)["items"]
    } >= extracted
    client.store.put_item(["profile", thread], key="color", value={"text": "green"})
    assert stored.get("profile", thread, key="color").value == {"text": "green"}
    assert client.store.get_item(["profile", thread], key="color")["value"] == {"text": "green"}
    listed = client.store.list_namespaces(prefix=["notes"], max_depth=2)["namespaces"]
    assert [tuple(n) for n in listed] == [("notes", thread)]
    client.store.delete_item(["profile", thread], key="color")
    assert stored.get("profile", thread, key="color") is None


# -- end to end: running summaries through langgraph dev ----------------------------------------------------


def _pending_summaries(service_url: str) -> float:
    for line in httpx.get(f"{service_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("reducing_saver_summary_pending_steps "):
            return float(line.split()[1])
    raise AssertionError("reducing_saver_summary_pending_steps not in /metrics")


def _wait_summarized(service_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _pending_summaries(service_url):
        assert time.monotonic() < deadline, "the summarizer did not catch up"
        time.sleep(0.05)


def _turn(n: int) -> dict:
    return {"role": "user", "content": f"FACT: fact {n:03d}\nquestion {n}", "id": f"h-{n:03d}"}


def _turns_in(text: str) -> set[int]:
    """The turns a text holds facts of: the user's (``fact 007``), the model's (``answered question 7``)."""
    return {int(n) for n in re.findall(r"FACT: (?:fact |answered question )(\d+)", text)}


def _summaries(messages: list[dict]) -> list[dict]:
    return [m for m in messages if (m.get("additional_kwargs") or {}).get("lc_source") == "summarization"]


def _seen_version(answer: dict) -> int:
    """The version of the running summary the model was sent (the sample graph says it in its answer)."""
    line = str(answer["content"]).splitlines()[-1]
    assert line.startswith("saw summary version "), line
    return int(line.split()[3])


@pytest.mark.timeout(240)
def test_langgraph_dev_threads_carry_the_running_summary(tmp_path: Path) -> None:
    from langgraph_sdk import get_sync_client

    from reducing_saver.reducer import MARK_KEY, SUMMARY_PREFIX, summary_message_id

    cli = _langgraph_cli()
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project)
    args = ("--database", "memory://", "--max-messages", "6", "--min-messages", "4")
    with run_service(tmp_path, *args, "--summarizer", "tests.support.summarizers:facts") as service:
        config_file = project / "langgraph.json"
        config = json.loads(config_file.read_text())
        config["env"] = {"REDUCING_SAVER_URL": service.url}
        config_file.write_text(json.dumps(config))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tmp_path / "langgraph-dev.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(cli), "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", str(port)],
                cwd=project,
                env=_offline_env({}),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_ok(url, process, log)
            with get_sync_client(url=url, api_key=None) as client:
                _drive_summaries(client, service.url, summary_message_id, MARK_KEY, SUMMARY_PREFIX)
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        text = log.read_text(errors="replace")
        assert "Using custom checkpointer: RemoteReducingSaver" in text


def _drive_summaries(client, service_url: str, summary_message_id, mark_key: str, prefix: str) -> None:
    thread = client.threads.create()["thread_id"]
    summary_id = summary_message_id(thread, "")
    turns = 14
    for n in range(turns):
        first = [{"role": "system", "content": "You are terse.", "id": "sys"}] if n == 0 else []
        client.runs.wait(thread, "summarized", input={"messages": [*first, _turn(n)]}, raise_error=True)
        # Each cut waits in the window for its summary; the next put folds the summary in.
        _wait_summarized(service_url)

    # get_state: the system message, then the one summary, then a human turn; nothing was forgotten.
    messages = client.threads.get_state(thread)["values"]["messages"]
    assert messages[0]["type"] == "system" and messages[0]["id"] == "sys"
    summary = messages[1]
    assert _summaries(messages) == [summary], [m["id"] for m in messages]
    assert summary["id"] == summary_id and summary["type"] == "human"
    assert summary["additional_kwargs"]["lc_source"] == "summarization"
    assert str(summary["content"]).startswith(prefix)
    newest = summary["additional_kwargs"][mark_key]
    assert messages[2]["type"] == "human"
    assert len(messages) <= 1 + 1 + 6, [m["id"] for m in messages]
    kept = {m["id"] for m in messages}
    cut = [n for n in range(turns) if f"h-{n:03d}" not in kept]
    assert cut, "the window cut messages"
    # The summary covers every turn the window no longer holds (its question and the model's answer).
    assert set(cut) <= _turns_in(str(summary["content"])), (cut, summary["content"])
    assert _turns_in("\n".join(str(m["content"]) for m in messages)) == set(range(turns))
    # And the agent was sent it: the model's last answer names the summary's version.
    assert _seen_version(messages[-1]) >= newest["version"] - 1 >= 2

    # A fork from an earlier checkpoint resumes with the summary that covered that checkpoint's own cut.
    history = client.threads.get_history(thread, limit=1000)
    assert (
        history[0]["checkpoint"]["checkpoint_id"]
        == client.threads.get_state(thread)["checkpoint"]["checkpoint_id"]
    )
    candidates = []
    for state in history:
        window = state["values"].get("messages", [])
        found = _summaries(window)
        assert len(found) <= 1, [m["id"] for m in window]
        if found and window[-1]["type"] == "ai" and not state["next"]:
            version = found[0]["additional_kwargs"][mark_key]["version"]
            if version <= newest["version"] - 2:
                candidates.append((state, found[0]))
    assert candidates, "an earlier checkpoint carries an older summary"
    at, old = candidates[-1]  # the oldest
    old_version = old["additional_kwargs"][mark_key]["version"]
    last_turn = max(_turns_in("\n".join(str(m["content"]) for m in at["values"]["messages"])))
    later = {n for n in _turns_in(str(summary["content"])) if n > last_turn}
    assert later, "the newest summary covers turns the fork point never had"
    fork_turn = 900
    client.runs.wait(
        thread,
        "summarized",
        input={"messages": [_turn(fork_turn)]},
        checkpoint_id=at["checkpoint"]["checkpoint_id"],
        raise_error=True,
    )
    forked = client.threads.get_state(thread)
    assert forked["parent_checkpoint"]["checkpoint_id"] != history[0]["checkpoint"]["checkpoint_id"]
    window = forked["values"]["messages"]
    ids = [m["id"] for m in window]
    assert f"h-{fork_turn}" in ids and not any(f"h-{n:03d}" in ids for n in range(last_turn + 1, turns))
    (fork_summary,) = _summaries(window)
    assert fork_summary["id"] == summary_id
    fork_facts = _turns_in(str(fork_summary["content"]))
    assert not fork_facts & later, (sorted(fork_facts), sorted(later))
    assert _turns_in(str(old["content"])) <= fork_facts
    assert old_version <= fork_summary["additional_kwargs"][mark_key]["version"] < newest["version"]
    seen = _seen_version(window[-1])
    assert old_version <= seen < newest["version"], (old_version, seen, newest)

    # update_state adding a message keeps exactly one summary, before and after the next turns fold more in.
    client.threads.update_state(
        thread, {"messages": [{"role": "user", "content": "FACT: fact 950\nadded", "id": "added"}]}
    )
    window = client.threads.get_state(thread)["values"]["messages"]
    assert "added" in [m["id"] for m in window]
    assert [m["id"] for m in _summaries(window)] == [summary_id]
    for n in range(901, 906):
        client.runs.wait(thread, "summarized", input={"messages": [_turn(n)]}, raise_error=True)
        _wait_summarized(service_url)
        window = client.threads.get_state(thread)["values"]["messages"]
        assert [m["id"] for m in _summaries(window)] == [summary_id], [m["id"] for m in window]
        assert window[0]["id"] == "sys" and window[1]["id"] == summary_id
    assert 950 in _turns_in(str(window[1]["content"])), "the added message was summarized once it was cut"
    assert not _turns_in(str(window[1]["content"])) & later
