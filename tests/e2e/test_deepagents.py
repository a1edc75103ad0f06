"""deepagents against the service: 64 turns of one thread compared, turn by turn, with a stock PostgresSaver.

deepagents keeps ``messages`` and ``files`` in LangGraph's DeltaChannel. A scripted model (no network,
``tests/support/deepagent.py``) drives todos, files (write, read, edit, ls, two tool calls at once), the
``task`` subagent and ``interrupt_on`` (each interrupt resumed); deepagents' own summarization for the
first 32 turns, LangChain's ``SummarizationMiddleware`` (which removes messages) for the next 32. After every
turn the state reads as the reference's; with ``--keep-checkpoints 5`` the thread keeps a flat history
whose every checkpoint reads as the reference's; every message LangChain's summarization removed reaches
long-term memory once. The service runs in process (ASGI) on PostgreSQL where the point is the state;
under uvicorn where the point is the requests a turn costs: the same at turn 60 as at turn 10, with
``--encryption required``.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.types import Command

from reducing_saver.client import RemoteReducingSaver, RemoteStore
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from tests.support.deepagent import build_deep_agent, human_turn
from tests.support.encryption import new_key, ring_json
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

TURNS, SWITCH, KEEP = 64, 32, 5
APPROVE = Command(resume={"decisions": [{"type": "approve"}]})
# What differs between two runs of the same turns: random ids (tool messages, deepagents' session) and
# timestamps (file metadata).
_RANDOM = re.compile(r"session_[0-9a-f]{32}|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?")


def _message(message: Any) -> dict[str, Any]:
    fields = {"type": message.type, "content": message.content}
    if message.type == "ai":
        fields["id"] = message.id
        fields["tool_calls"] = [(c["name"], c["args"], c["id"]) for c in message.tool_calls]
    if message.type == "tool":
        fields["tool_call_id"] = message.tool_call_id
    if message.type == "human":
        fields["lc_source"] = message.additional_kwargs.get("lc_source")
    return fields


def _normal(values: dict[str, Any]) -> str:
    """A state's values as comparable text: messages by their content, random ids and times masked."""
    shaped = {k: ([_message(m) for m in v] if k == "messages" else v) for k, v in values.items()}
    text = json.dumps(shaped, default=lambda o: _message(o) if hasattr(o, "type") else str(o), sort_keys=True)
    return _RANDOM.sub("*", text)


def _turn(graph: Any, turn: int, config: dict) -> int:
    """One turn, every interrupt approved; how many interrupts there were."""
    out, interrupts = graph.invoke(human_turn(turn), config), 0
    while "__interrupt__" in out:
        interrupts += 1
        out = graph.invoke(APPROVE, config)
    return interrupts


def _graphs(saver: Any) -> tuple[Any, Any]:
    return build_deep_agent(saver), build_deep_agent(saver, langchain_summarization=True)


@pytest.mark.parametrize("mode", ["default", "keep", "encrypted"])
def test_a_deepagents_thread_reads_as_a_stock_postgres_saver_does(mode: str, make_database) -> None:
    extra: dict[str, Any] = {}
    if mode == "keep":
        extra["keep_checkpoints"] = KEEP
    if mode == "encrypted":
        extra.update(encryption="required", encryption_keys=ring_json("k1", k1=new_key()))
    settings = Settings(database=make_database(), sweep=False, extraction_linger_seconds=0, **extra)
    config = {"configurable": {"thread_id": f"deep-{mode}"}}
    seen: set[str] = set()
    started = time.monotonic()
    with PostgresSaver.from_conn_string(make_database()) as stock, TestClient(create_app(settings)) as client:
        stock.setup()
        saver = RemoteReducingSaver("http://testserver", transport=client._transport)
        store = RemoteStore("http://testserver", transport=client._transport)
        graphs, references = _graphs(saver), _graphs(stock)
        interrupts = kept = 0
        for turn in range(TURNS):
            graph, reference = graphs[turn >= SWITCH], references[turn >= SWITCH]
            interrupts += _turn(graph, turn, config)
            _turn(reference, turn, config)
            state = graph.get_state(config)
            assert _normal(state.values) == _normal(reference.get_state(config).values), turn
            # Summaries are passed over when removed (docs/memory.md): they are not conversation.
            seen |= {
                m.id
                for m in state.values["messages"]
                if m.additional_kwargs.get("lc_source") != "summarization"
            }
            if turn == SWITCH - 1:  # deepagents' own summarization has run (it keeps the messages)
                assert state.values["_summarization_event"]["cutoff_index"] > 0
            if mode == "keep":
                history = list(graph.get_state_history(config))
                kept = max(kept, len(history))
                expected = itertools.islice(reference.get_state_history(config), len(history))
                for index, (ours, theirs) in enumerate(zip(history, expected, strict=True)):
                    assert _normal(ours.values) == _normal(theirs.values), (turn, index)
                    assert ours.next == theirs.next and ours.metadata["step"] == theirs.metadata["step"]
        elapsed = time.monotonic() - started
        final = graph.get_state(config).values
        assert len(final["files"]) >= 16 and final["todos"]
        assert interrupts == 2 * TURNS // 8  # every write_file (two turns in eight) waits for approval
        if mode == "keep":
            # Flat: the newest K and the ones back to the run's first (it holds every snapshot); a turn is
            # up to 15 checkpoints (two runs when it is interrupted).
            assert kept <= KEEP + 20, kept
            stored = client.get(f"/v1/threads/deep-{mode}/storage").json()
            assert stored["checkpoints"] < 60, stored
            assert stored["delta_channels"] == ["files", "messages"]
        else:  # the whole history is there; its newest 40 checkpoints read as the reference's
            assert len(list(saver.list(config, limit=None))) == len(list(stock.list(config))) > 500
            ours = [_normal(s.values) for s in itertools.islice(graph.get_state_history(config), 40)]
            theirs = [_normal(s.values) for s in itertools.islice(reference.get_state_history(config), 40)]
            assert ours == theirs
        # LangChain's summarization removed messages: each reached memory once, none that stayed did.
        left = seen - {m.id for m in final["messages"]}
        deadline = time.monotonic() + 30

        def memories() -> set[str]:
            items, offset = [], 0
            while page := store.search(("memories", f"deep-{mode}"), limit=1000, offset=offset):
                items += page
                offset += len(page)
            return {item.key for item in items}

        while len(found := memories()) < len(left):
            assert time.monotonic() < deadline, (len(found), len(left))
            time.sleep(0.2)
        assert found == left and len(left) > 100
        print(
            f"{mode}: {TURNS} turns in {elapsed:.1f} s, {interrupts} interrupts, {len(left)} removed messages in memory"
        )
        saver.close()
        store.close()


class _Counting(httpx.BaseTransport):
    """Sync HTTP to the service, counting requests."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_requests_per_turn_stay_flat_under_encryption(tmp_path, fresh_pg) -> None:
    """Under uvicorn with ``--encryption required``: a deepagents turn costs the same requests at turn 60
    as at turn 20 (its history comes in one request per read, not one per ancestor)."""
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())}
    args = ("--database", fresh_pg, "--encryption", "required", "--no-extract")
    with run_service(tmp_path, *args, env=env) as service:
        counting = _Counting()
        saver = RemoteReducingSaver(service.url, transport=counting)
        assert "delta_channel_history" in saver.capabilities
        graph = build_deep_agent(saver)
        config = {"configurable": {"thread_id": "deep-requests"}}
        per_turn = []
        for turn in range(64):
            before = counting.requests
            _turn(graph, turn, config)
            per_turn.append(counting.requests - before)
        saver.close()
    # Turns of one kind (turn % 8) cost the same, however long the thread has grown.
    for turn in range(56, 64):
        assert per_turn[turn] <= per_turn[turn - 40] + 2, per_turn
