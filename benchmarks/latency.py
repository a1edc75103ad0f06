"""Latency: per-turn ``graph.invoke`` / ``ainvoke`` through three checkpointers on the same database.

* ``remote``: ``RemoteReducingSaver`` to the service;
* ``inprocess``: ``ReducingSaver(PostgresSaver)`` (async: ``ReducingSaver(AsyncPostgresSaver)``);
* ``plain``: ``PostgresSaver`` (async: ``AsyncPostgresSaver``), no reducer.

Each round gives every checkpointer a fresh thread and runs ``turns`` turns on each, the checkpointers
taking turns turn by turn (remote, in-process, plain, remote, ...; the order rotates every round), so
all three see the same machine load. Besides each turn's time, the agent process's own CPU time over the
turn is kept (``cpu`` samples): what a turn costs the agent's machine, the service's and PostgreSQL's
work aside.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack, ExitStack
from typing import Any

from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from benchmarks._common import chat_graph, ratio, summary, thread_config, user_input
from reducing_saver.client import RemoteReducingSaver
from reducing_saver.reducer import MessageReducer, ReducingSaver

KINDS = ("remote", "inprocess", "plain")


def _turn_sync(graph: Any, config: dict[str, Any], turn: int) -> tuple[float, float]:
    """(wall ms, this process's CPU ms) of one turn."""
    start, cpu = time.perf_counter(), time.process_time()
    graph.invoke(user_input(turn), config)
    return (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000


async def _turn_async(graph: Any, config: dict[str, Any], turn: int) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    await graph.ainvoke(user_input(turn), config)
    return (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000


def _new_threads(kinds: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {kind: thread_config(f"lat-{kind}-{uuid.uuid4().hex}") for kind in kinds}


def figures(samples: list[tuple[float, float]]) -> dict[str, float]:
    """Wall-time summary of the turns, plus the agent process's median CPU per turn."""
    result = summary([wall for wall, _ in samples])
    result["agent_cpu_ms_median"] = round(statistics.median(cpu for _, cpu in samples), 3)
    return result


def _ratios(result: dict[str, dict[str, float]]) -> dict[str, float]:
    return {
        "remote_vs_inprocess_median": ratio(result["remote"]["median_ms"], result["inprocess"]["median_ms"]),
        "remote_vs_inprocess_p95": ratio(result["remote"]["p95_ms"], result["inprocess"]["p95_ms"]),
        "remote_vs_plain_median": ratio(result["remote"]["median_ms"], result["plain"]["median_ms"]),
        "inprocess_vs_plain_median": ratio(result["inprocess"]["median_ms"], result["plain"]["median_ms"]),
        "remote_vs_inprocess_agent_cpu": ratio(
            result["remote"]["agent_cpu_ms_median"], result["inprocess"]["agent_cpu_ms_median"]
        ),
    }


def _rotated(round_index: int) -> list[str]:
    shift = round_index % len(KINDS)
    return list(KINDS[shift:] + KINDS[:shift])


def run_sync(service_url: str, database: str, *, turns: int, rounds: int, window: int,
             kinds: tuple[str, ...] = KINDS) -> dict[str, list[tuple[float, float]]]:
    """Per kind, ``(wall ms, agent CPU ms)`` of every measured turn."""
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    with ExitStack() as stack:
        graphs: dict[str, Any] = {}
        if "remote" in kinds:
            graphs["remote"] = chat_graph(stack.enter_context(RemoteReducingSaver(service_url)))
        if "inprocess" in kinds:
            inner = stack.enter_context(PostgresSaver.from_conn_string(database))
            inner.setup()
            graphs["inprocess"] = chat_graph(ReducingSaver(inner, MessageReducer(max_messages=window)))
        if "plain" in kinds:
            plain = stack.enter_context(PostgresSaver.from_conn_string(database))
            plain.setup()
            graphs["plain"] = chat_graph(plain)
        for kind, config in _new_threads(graphs).items():  # warm up: connections, first-call caches
            for turn in range(3):
                _turn_sync(graphs[kind], config, turn)
        for round_index in range(rounds):
            threads = _new_threads(graphs)
            order = [kind for kind in _rotated(round_index) if kind in graphs]
            for turn in range(turns):
                for kind in order:
                    samples[kind].append(_turn_sync(graphs[kind], threads[kind], turn))
    return samples


async def run_async(service_url: str, database: str, *, turns: int, rounds: int, window: int,
                    kinds: tuple[str, ...] = KINDS) -> dict[str, list[tuple[float, float]]]:
    """Per kind, ``(wall ms, agent CPU ms)`` of every measured turn."""
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    async with AsyncExitStack() as stack:
        graphs: dict[str, Any] = {}
        if "remote" in kinds:
            graphs["remote"] = chat_graph(await stack.enter_async_context(RemoteReducingSaver(service_url)))
        if "inprocess" in kinds:
            inner = await stack.enter_async_context(AsyncPostgresSaver.from_conn_string(database))
            await inner.setup()
            graphs["inprocess"] = chat_graph(ReducingSaver(inner, MessageReducer(max_messages=window)))
        if "plain" in kinds:
            plain = await stack.enter_async_context(AsyncPostgresSaver.from_conn_string(database))
            await plain.setup()
            graphs["plain"] = chat_graph(plain)
        for kind, config in _new_threads(graphs).items():
            for turn in range(3):
                await _turn_async(graphs[kind], config, turn)
        for round_index in range(rounds):
            threads = _new_threads(graphs)
            order = [kind for kind in _rotated(round_index) if kind in graphs]
            for turn in range(turns):
                for kind in order:
                    samples[kind].append(await _turn_async(graphs[kind], threads[kind], turn))
    return samples


def run(service_url: str, database: str, *, turns: int, rounds: int, window: int,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    result: dict[str, Any] = {"turns_per_thread": turns, "rounds": rounds, "window": window}
    for mode in ("sync", "async"):
        if mode == "sync":
            samples = run_sync(service_url, database, turns=turns, rounds=rounds, window=window)
        else:
            samples = asyncio.run(run_async(service_url, database, turns=turns, rounds=rounds, window=window))
        figures_by_kind = {kind: figures(values) for kind, values in samples.items()}
        result[mode] = {**figures_by_kind, "ratios": _ratios(figures_by_kind)}
        medians = ", ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in figures_by_kind.items())
        log(f"  latency {mode}: {medians}")
    return result
