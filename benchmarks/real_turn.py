"""Real turns: what the service costs an agent whose model and tools take time.

    .venv/bin/python -m benchmarks.real_turn [--quick] [--latencies 0,0.2,1] [--database URL]

A LangGraph agent as users write one: a model node and a ``ToolNode`` routed by ``tools_condition``; the
model call waits a simulated latency (0, 200 ms and 1 s per call in a full run), the tool 50 ms, and every
third turn calls the tool once (human, tool call, tool result, answer: two model calls), the others
answer at once (one model call). It runs with LangGraph's default ``durability="async"``: a checkpoint's put overlaps the next
model call, and the run waits for what is pending only when it ends. Three checkpointers on one
PostgreSQL database, taking turns turn by turn (the order rotating every round), each turn an
``ainvoke`` on a thread of its own:

* ``service``: ``RemoteReducingSaver`` to ``reducing-saver serve`` (window 20 messages);
* ``inprocess``: the same features in the agent, ``ReducingSaver(AsyncPostgresSaver)`` with an
  ``on_prune`` hook writing the cut messages into an ``AsyncPostgresStore`` (``benchmarks/latency.py``);
* ``plain``: ``AsyncPostgresSaver``, no window and no memory.

Per model latency it reports each checkpointer's median turn (one model call), p95 turn (a tool turn)
and mean turn (a conversation's time over its turns), the ratios service / in-process and service /
plain of each (from the same run), and the milliseconds the service adds to a turn's median. Run alone it starts the service on a scratch database; ``python -m benchmarks`` runs it as its
``real_turn`` section.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from contextlib import AsyncExitStack, nullcontext
from pathlib import Path
from typing import Any

from benchmarks._common import ratio, scratch_database, summary, text, thread_config
from benchmarks.latency import async_inprocess_saver, async_plain_saver
from reducing_saver.client import RemoteReducingSaver

KINDS = ("service", "inprocess", "plain")
LABELS = {
    "service": "RemoteReducingSaver to the service",
    "inprocess": "the same features in-process: ReducingSaver(AsyncPostgresSaver) + on_prune → AsyncPostgresStore",
    "plain": "plain AsyncPostgresSaver",
}
#: LangGraph's default for invoke, ainvoke and stream.
DURABILITY = "async"
FULL = {"latencies": [0.0, 0.2, 1.0], "tool_seconds": 0.05, "turns": 12, "rounds": 4, "window": 20}
QUICK = {"latencies": [0.0, 0.02], "tool_seconds": 0.01, "turns": 9, "rounds": 1, "window": 20}


def agent_graph(checkpointer: Any, model_seconds: float, tool_seconds: float) -> Any:
    """A tool-calling agent whose model waits ``model_seconds`` a call and whose tool ``tool_seconds``."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    async def lookup(query: str) -> str:
        """Look up what the user asked about."""
        await asyncio.sleep(tool_seconds)
        return text(f"tool-{query}", 200)

    async def model(state: MessagesState) -> dict[str, list[AIMessage]]:
        await asyncio.sleep(model_seconds)
        messages = state["messages"]
        turn = sum(isinstance(message, HumanMessage) for message in messages)
        if isinstance(messages[-1], HumanMessage) and turn % 3 == 0:
            call = {"name": "lookup", "args": {"query": str(len(messages))}, "id": f"call-{uuid.uuid4().hex}"}
            return {"messages": [AIMessage("", tool_calls=[call])]}
        return {"messages": [AIMessage(text(f"ai-{len(messages)}"))]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", model)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer)


async def _turn(graph: Any, config: dict[str, Any], turn: int) -> float:
    """Wall milliseconds of one turn, from ``ainvoke`` to its return (pending puts included)."""
    start = time.perf_counter()
    await graph.ainvoke({"messages": [("user", text(f"user-{turn}"))]}, config, durability=DURABILITY)
    return (time.perf_counter() - start) * 1000


async def measure(
    service_url: str,
    database: str,
    *,
    model_seconds: float,
    tool_seconds: float,
    turns: int,
    rounds: int,
    window: int,
) -> dict[str, Any]:
    """Every checkpointer's turns at one model latency, interleaved; their figures and ratios."""
    async with AsyncExitStack() as stack:
        savers = {
            "service": await stack.enter_async_context(RemoteReducingSaver(service_url)),
            "inprocess": await stack.enter_async_context(async_inprocess_saver(database, window)),
            "plain": await stack.enter_async_context(async_plain_saver(database)),
        }
        graphs = {kind: agent_graph(saver, model_seconds, tool_seconds) for kind, saver in savers.items()}
        prefix = f"real-{round(model_seconds * 1000)}ms"
        for kind, graph in graphs.items():  # warm up: connections, first-call caches
            config = thread_config(f"{prefix}-warm-{kind}-{uuid.uuid4().hex}")
            for turn in range(2):
                await _turn(graph, config, turn)
        samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
        kept: dict[str, int] = {}
        for round_index in range(rounds):
            threads = {kind: thread_config(f"{prefix}-{kind}-{uuid.uuid4().hex}") for kind in KINDS}
            order = KINDS[round_index % len(KINDS) :] + KINDS[: round_index % len(KINDS)]
            for turn in range(turns):
                for kind in order:
                    samples[kind].append(await _turn(graphs[kind], threads[kind], turn))
        for kind, graph in graphs.items():
            kept[kind] = len((await graph.aget_state(threads[kind])).values["messages"])
    figures = {kind: summary(values) for kind, values in samples.items()}
    service, inprocess, plain = (figures[kind] for kind in KINDS)
    return {
        "model_ms": round(model_seconds * 1000),
        **figures,
        "messages_in_last_thread": kept,
        "ratios": {
            "service_vs_inprocess_median": ratio(service["median_ms"], inprocess["median_ms"]),
            "service_vs_inprocess_p95": ratio(service["p95_ms"], inprocess["p95_ms"]),
            "service_vs_plain_median": ratio(service["median_ms"], plain["median_ms"]),
            "service_vs_plain_p95": ratio(service["p95_ms"], plain["p95_ms"]),
            "service_vs_inprocess_mean": ratio(service["mean_ms"], inprocess["mean_ms"]),
            "service_vs_plain_mean": ratio(service["mean_ms"], plain["mean_ms"]),
        },
        "service_adds_ms_median": round(service["median_ms"] - inprocess["median_ms"], 2),
    }


def run(
    service_url: str,
    database: str,
    *,
    latencies: list[float],
    tool_seconds: float,
    turns: int,
    rounds: int,
    window: int,
    log: Any = print,
) -> dict[str, Any]:
    """The section: one :func:`measure` per model latency."""
    result: dict[str, Any] = {
        "durability": DURABILITY,
        "tool_ms": round(tool_seconds * 1000),
        "turns_per_thread": turns,
        "rounds": rounds,
        "window": window,
        "labels": LABELS,
        "by_model_latency": [],
    }
    for seconds in latencies:
        figures = asyncio.run(
            measure(
                service_url,
                database,
                model_seconds=seconds,
                tool_seconds=tool_seconds,
                turns=turns,
                rounds=rounds,
                window=window,
            )
        )
        result["by_model_latency"].append(figures)
        log(
            f"  real turn, model {figures['model_ms']} ms: "
            + ", ".join(
                f"{kind} {figures[kind]['median_ms']:.1f} / {figures[kind]['p95_ms']:.1f} ms"
                for kind in KINDS
            )
            + f"; service / in-process {figures['ratios']['service_vs_inprocess_median']:.3f}x"
        )
    return result


def table(result: dict[str, Any]) -> list[str]:
    """The section as a Markdown table."""
    lines = [
        "| model call | service, median / p95 / mean | in-process, same features | plain AsyncPostgresSaver | "
        "service / in-process, median / p95 / mean | service / plain, median / p95 / mean |",
        "|---|---|---|---|---|---|",
    ]
    for figures in result["by_model_latency"]:
        cells = [
            f"{figures[kind]['median_ms']:,.1f} / {figures[kind]['p95_ms']:,.1f} / {figures[kind]['mean_ms']:,.1f} ms"
            for kind in KINDS
        ]
        r = figures["ratios"]
        ratios = [
            " / ".join(f"{r[f'service_vs_{other}_{stat}']:.3f}×" for stat in ("median", "p95", "mean"))
            for other in ("inprocess", "plain")
        ]
        lines.append(f"| {figures['model_ms']:,} ms | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    from tests.support.server import run_service

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.real_turn", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: short latencies, one round")
    parser.add_argument("--latencies", help="model latencies in seconds, comma-separated (default: 0,0.2,1)")
    parser.add_argument("--rounds", type=int, help="rounds of fresh threads per latency (default: 4)")
    parser.add_argument("--turns", type=int, help="turns per thread (default: 10)")
    parser.add_argument("--database", help="PostgreSQL URL (default: a scratch database, dropped afterwards)")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    if args.latencies:
        settings["latencies"] = [float(value) for value in args.latencies.split(",")]
    if args.rounds:
        settings["rounds"] = args.rounds
    if args.turns:
        settings["turns"] = args.turns
    with (
        nullcontext(args.database) if args.database else scratch_database() as database,
        tempfile.TemporaryDirectory() as folder,
        run_service(
            Path(folder), "--database", database, "--max-messages", str(settings["window"])
        ) as service,
    ):
        result = run(service.url, database, **settings)
    print(
        f"\nReal turns: durability={result['durability']}, tool {result['tool_ms']} ms, every third turn "
        f"calls it; {result['rounds']} rounds x {result['turns_per_thread']}-turn threads per checkpointer"
    )
    for line in table(result):
        print(f"  {line}")


if __name__ == "__main__":
    main()
