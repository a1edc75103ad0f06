"""A deepagents thread against the service: requests and time a turn, storage and memory as it grows.

    .venv/bin/python -m benchmarks.deepagents_thread [--turns 300] [--out benchmarks/results]

deepagents keeps ``messages`` and ``files`` in LangGraph's DeltaChannel. The agent is the tests' scripted
one (``tests/support/deepagent.py``: todos, files, two tool calls at once, the ``task`` subagent,
``interrupt_on``; deepagents' own summarization for 32 turns, then LangChain's ``SummarizationMiddleware``,
which removes messages). Two parts, each on a scratch database of its own and ``reducing-saver serve``:

* ``--encryption required``: 64 turns read the DeltaChannels' history in one request
  (``get_delta_channel_history``), beside 64 turns of a client without it, which walks ``get_tuple`` one
  ancestor at a time as LangGraph does when a saver cannot answer (what every read did under encryption
  before the service opened the history itself). Requests and milliseconds a turn at turns 10 and 60.
* ``--keep-checkpoints 5``: one thread keeps 5 (and what they are rebuilt from), another, turn for turn
  the same, keeps everything (``keep_checkpoints: 0``: what a DeltaChannel thread kept before). Stored
  bytes and checkpoints, the state's own size, and the removed messages that reached memory, at turns
  30, 60 and ``--turns``.

Writes ``deepagents_thread.json`` into ``--out`` and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import scratch_database

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the scripted agent lives with the tests
    sys.path.insert(0, str(ROOT))


class _Counting(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def _walking(saver: Any) -> Any:
    """The same saver without ``get_delta_channel_history``: LangGraph walks ``get_tuple`` instead."""
    from reducing_saver.client import RemoteReducingSaver
    from reducing_saver.client._optional import MIXINS
    from reducing_saver.wire.capabilities import with_capabilities

    variant = with_capabilities(RemoteReducingSaver, saver.capabilities - {"delta_channel_history"}, MIXINS)
    clone = object.__new__(variant)
    clone.__dict__.update(saver.__dict__)
    return clone


def _run_turn(graphs: tuple[Any, Any], turn: int, config: dict) -> None:
    from langgraph.types import Command

    from tests.support.deepagent import human_turn

    graph = graphs[turn >= 32]
    out = graph.invoke(human_turn(turn), config)
    while "__interrupt__" in out:
        out = graph.invoke(Command(resume={"decisions": [{"type": "approve"}]}), config)


def _graphs(saver: Any) -> tuple[Any, Any]:
    from tests.support.deepagent import build_deep_agent

    return build_deep_agent(saver), build_deep_agent(saver, langchain_summarization=True)


def requests_and_time(database: str, log_dir: Path, turns: int = 64) -> dict[str, Any]:
    from reducing_saver.client import RemoteReducingSaver
    from tests.support.encryption import new_key, ring_json
    from tests.support.server import run_service

    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())}
    results: dict[str, Any] = {}
    with run_service(
        log_dir, "--database", database, "--encryption", "required", "--no-extract", env=env
    ) as service:
        for name in ("history", "walk"):
            counting = _Counting()
            saver = RemoteReducingSaver(service.url, transport=counting)
            client = saver if name == "history" else _walking(saver)
            graphs = _graphs(client)
            config = {"configurable": {"thread_id": f"requests-{name}"}}
            per_turn = []
            for turn in range(turns):
                before, started = counting.requests, time.perf_counter()
                _run_turn(graphs, turn, config)
                per_turn.append((counting.requests - before, (time.perf_counter() - started) * 1000))
            saver.close()
            results[name] = {
                f"turn_{t}": {"requests": per_turn[t][0], "ms": round(per_turn[t][1], 1)} for t in (10, 60)
            }
            results[name]["per_turn"] = per_turn
    return results


def _state_bytes(graph: Any, config: dict) -> int:
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    return len(JsonPlusSerializer().dumps_typed(graph.get_state(config).values)[1])


def storage_and_memory(database: str, log_dir: Path, turns: int) -> dict[str, Any]:
    from reducing_saver.client import RemoteReducingSaver, RemoteStore
    from tests.support.server import run_service

    marks = sorted({30, 60, turns})
    results: dict[str, Any] = {}
    args = ("--database", database, "--keep-checkpoints", "5", "--extraction-linger-seconds", "0")
    with run_service(log_dir, *args) as service:
        saver = RemoteReducingSaver(service.url)
        store = RemoteStore(service.url)
        graphs = _graphs(saver)
        threads = {"keep 5": {"thread_id": "kept"}, "keep all": {"thread_id": "whole", "keep_checkpoints": 0}}
        seen: dict[str, set[str]] = {name: set() for name in threads}
        for turn in range(turns):
            for name, configurable in threads.items():
                config = {"configurable": configurable}
                _run_turn(graphs, turn, config)
                messages = graphs[turn >= 32].get_state(config).values["messages"]
                seen[name] |= {
                    m.id for m in messages if m.additional_kwargs.get("lc_source") != "summarization"
                }
            if turn + 1 in marks:
                for name, configurable in threads.items():
                    config = {"configurable": configurable}
                    stored = httpx.get(f"{service.url}/v1/threads/{configurable['thread_id']}/storage").json()
                    graph = graphs[turn >= 32]
                    state = {m.id for m in graph.get_state(config).values["messages"]}
                    removed = seen[name] - state
                    time.sleep(1.5)  # the deliverer's round
                    memories = _count(store, ("memories", configurable["thread_id"]))
                    results.setdefault(f"turn_{turn + 1}", {})[name] = {
                        "checkpoints": stored["checkpoints"],
                        "saver_bytes": stored["saver_bytes"],
                        "total_bytes": stored["total_bytes"],
                        "state_bytes": _state_bytes(graph, config),
                        "removed_messages": len(removed),
                        "in_memory": memories,
                    }
        saver.close()
        store.close()
    return results


def _count(store: Any, namespace: tuple[str, ...]) -> int:
    count, offset = 0, 0
    while page := store.search(namespace, limit=1000, offset=offset):
        count += len(page)
        offset += len(page)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with scratch_database() as first, scratch_database() as second:
        figures = {
            "requests": requests_and_time(first, args.out),
            "storage": storage_and_memory(second, args.out, args.turns),
        }
    (args.out / "deepagents_thread.json").write_text(json.dumps(figures, indent=2))
    for name in ("history", "walk"):
        row = figures["requests"][name]
        print(
            f"{name:8} turn 10: {row['turn_10']['requests']} requests, {row['turn_10']['ms']} ms; "
            f"turn 60: {row['turn_60']['requests']} requests, {row['turn_60']['ms']} ms"
        )
    for mark, rows in figures["storage"].items():
        for name, row in rows.items():
            print(
                f"{mark:9} {name:9} {row['checkpoints']:5} checkpoints, {row['saver_bytes'] / 1024:8.1f} KiB stored, "
                f"state {row['state_bytes'] / 1024:6.1f} KiB, {row['in_memory']}/{row['removed_messages']} removed messages in memory"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
