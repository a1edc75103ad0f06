"""Per-turn `graph.invoke` latency: through the service vs in-process ReducingSaver(PostgresSaver).

    .venv/bin/python -m benchmarks.turn_latency --database postgresql://postgres@127.0.0.1:5432/postgres

Starts `reducing-saver serve` on the given database, runs the same chat graph for --turns turns on
fresh threads through RemoteReducingSaver and in-process, interleaved so both see the same machine
load, and prints medians, p95 and their ratio (remote / in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from langchain_core.messages import AIMessage
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import START, MessagesState, StateGraph

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.service import MessageReducer, ReducingSaver
from tests.support.server import run_service

TEXT = "lorem ipsum dolor sit amet " * 15


def chat_graph(saver):
    def bot(state: MessagesState):
        return {"messages": [AIMessage(TEXT[:400])]}

    graph = StateGraph(MessagesState)
    graph.add_node("bot", bot)
    graph.add_edge(START, "bot")
    return graph.compile(checkpointer=saver)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_sync(graph, turns: int) -> list[float]:
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = []
    for _ in range(turns):
        start = time.perf_counter()
        graph.invoke({"messages": [("user", TEXT[:400])]}, config)
        out.append((time.perf_counter() - start) * 1000)
    return out


async def time_async(graph, turns: int) -> list[float]:
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = []
    for _ in range(turns):
        start = time.perf_counter()
        await graph.ainvoke({"messages": [("user", TEXT[:400])]}, config)
        out.append((time.perf_counter() - start) * 1000)
    return out


def report(name: str, remote: list[float], local: list[float]) -> None:
    rm, lm = statistics.median(remote), statistics.median(local)
    print(
        f"{name:5} remote median {rm:6.2f} ms p95 {percentile(remote, .95):6.2f} | in-process median "
        f"{lm:6.2f} ms p95 {percentile(local, .95):6.2f} | ratio {rm / lm:4.2f}x"
    )


async def run_async(url: str, database: str, turns: int, rounds: int) -> tuple[list[float], list[float]]:
    remote, local = [], []
    reducer = MessageReducer(max_messages=20)
    async with AsyncPostgresSaver.from_conn_string(database) as inner:
        await inner.setup()
        local_graph = chat_graph(ReducingSaver(inner, reducer))
        async with RemoteReducingSaver(url) as client:
            remote_graph = chat_graph(client)
            for _ in range(rounds):
                remote += await time_async(remote_graph, turns)
                local += await time_async(local_graph, turns)
    return remote, local


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, run_service(
        Path(folder), "--database", args.database, "--max-messages", "20"
    ) as service:
        remote, local = [], []
        with PostgresSaver.from_conn_string(args.database) as inner, RemoteReducingSaver(service.url) as client:
            inner.setup()
            local_graph = chat_graph(ReducingSaver(inner, MessageReducer(max_messages=20)))
            remote_graph = chat_graph(client)
            time_sync(remote_graph, 5), time_sync(local_graph, 5)  # warm up
            for _ in range(args.rounds):
                remote += time_sync(remote_graph, args.turns)
                local += time_sync(local_graph, args.turns)
        report("sync", remote, local)
        remote, local = asyncio.run(run_async(service.url, args.database, args.turns, args.rounds))
        report("async", remote, local)


if __name__ == "__main__":
    main()
