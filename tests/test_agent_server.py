"""LangGraph Agent Server with the service as its checkpointer (reducing_saver.client.agent_server).

The tests open savers under blockbuster, the blocking-call detector Agent Server runs its graphs under.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blockbuster import BlockBuster, BlockingError
from langgraph.checkpoint.base import BaseCheckpointSaver

from reducing_saver.client import RemoteReducingSaver, ServerUnavailableError, agent_server
from tests.support.server import free_port, run_service

CHECKPOINTER_PATH = "reducing_saver.client.agent_server.checkpointer"
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
        await RemoteReducingSaver.aopen(f"http://127.0.0.1:{free_port()}", max_retries=0)
    with pytest.raises(ValueError, match="body_format"):
        await RemoteReducingSaver.aopen("http://127.0.0.1:1", body_format="xml")


# -- the factory ---------------------------------------------------------------------------------------------


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


async def test_factory_without_url_says_which_variable(monkeypatch) -> None:
    monkeypatch.delenv("REDUCING_SAVER_URL", raising=False)
    with pytest.raises(RuntimeError, match="REDUCING_SAVER_URL"):
        async with agent_server.checkpointer():
            pass
