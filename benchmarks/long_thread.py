"""Long thread: per-turn ``ainvoke`` time along one long conversation, through three checkpointers.

* ``service``: ``RemoteReducingSaver`` to the service (window ``--max-messages``);
* ``plain``: ``AsyncPostgresSaver``, no reducer: every step stores the whole history again, so its turns
  slow down as the conversation grows;
* ``inprocess``: the same features in-process, ``ReducingSaver(AsyncPostgresSaver)`` with an ``on_prune``
  hook writing the pruned messages into an ``AsyncPostgresStore`` (see ``benchmarks.latency``).

Each round gives every checkpointer a fresh thread and runs the chat graph (~400-character messages) for
``turns`` turns on each, turn by turn (service, plain, in-process, then the order rotates every turn), so
all three see the same machine load. Each turn's wall time is kept; per kind and turn, the median over
the rounds makes the per-turn curve. Reported per kind: the median of that curve over the first, middle
and last tenth of the conversation (turns 1–20, 90–110 and 180–200 of 200; scaled to shorter runs, the
turns stated in the results) and the conversation's total time (the sum of the curve, and each round's
own total).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from benchmarks._common import chat_graph, ratio, thread_config, user_input
from benchmarks.latency import async_inprocess_saver, async_plain_saver, store_items
from reducing_saver.client import RemoteReducingSaver

KINDS = ("service", "plain", "inprocess")
LABELS = {
    "service": "RemoteReducingSaver to the service",
    "plain": "plain AsyncPostgresSaver",
    "inprocess": "in-process ReducingSaver + on_prune → AsyncPostgresStore",
}
WARM_UP_TURNS = 3


def turn_ranges(turns: int) -> dict[str, tuple[int, int]]:
    """The first, middle and last tenth of a ``turns``-turn conversation, 1-based and inclusive:
    ``(1, 20)``, ``(90, 110)`` and ``(180, 200)`` for 200 turns."""
    return {
        "first": (1, max(1, round(turns * 0.1))),
        "middle": (max(1, round(turns * 0.45)), max(1, round(turns * 0.55))),
        "last": (max(1, round(turns * 0.9)), turns),
    }


async def _turn(graph: Any, config: dict[str, Any], turn: int) -> float:
    start = time.perf_counter()
    await graph.ainvoke(user_input(turn), config)
    return (time.perf_counter() - start) * 1000


async def run_async(
    service_url: str, database: str, *, turns: int, rounds: int, window: int, thread_prefix: str = "long"
) -> dict[str, list[list[float]]]:
    """Per kind, per round, the wall ms of every turn."""
    samples: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    async with AsyncExitStack() as stack:
        graphs = {
            "service": chat_graph(await stack.enter_async_context(RemoteReducingSaver(service_url))),
            "plain": chat_graph(await stack.enter_async_context(async_plain_saver(database))),
            "inprocess": chat_graph(await stack.enter_async_context(async_inprocess_saver(database, window))),
        }
        for kind, graph in graphs.items():  # connections, first-call caches
            config = thread_config(f"{thread_prefix}-warm-{kind}-{uuid.uuid4().hex}")
            for turn in range(WARM_UP_TURNS):
                await _turn(graph, config, turn)
        for _ in range(rounds):
            threads = {kind: thread_config(f"{thread_prefix}-{kind}-{uuid.uuid4().hex}") for kind in KINDS}
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for turn in range(turns):
                shift = turn % len(KINDS)
                for kind in KINDS[shift:] + KINDS[:shift]:
                    times[kind].append(await _turn(graphs[kind], threads[kind], turn))
            for kind in KINDS:
                samples[kind].append(times[kind])
    return samples


def figures(per_round: list[list[float]], ranges: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The per-turn curve (median over rounds) of one kind, its range medians and totals."""
    curve = [statistics.median(values) for values in zip(*per_round, strict=True)]
    result: dict[str, Any] = {
        f"{name}_median_ms": round(statistics.median(curve[first - 1 : last]), 3)
        for name, (first, last) in ranges.items()
    }
    result["total_s"] = round(sum(curve) / 1000, 3)
    result["round_totals_s"] = [round(sum(times) / 1000, 3) for times in per_round]
    result["per_turn_ms"] = [round(value, 3) for value in curve]
    return result


def run(
    service_url: str,
    database: str,
    *,
    turns: int,
    rounds: int,
    window: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    ranges = turn_ranges(turns)
    samples = asyncio.run(run_async(service_url, database, turns=turns, rounds=rounds, window=window))
    by_kind = {kind: figures(samples[kind], ranges) for kind in KINDS}
    service, plain, inprocess = (by_kind[kind] for kind in KINDS)
    result: dict[str, Any] = {
        "turns": turns,
        "rounds": rounds,
        "window": window,
        "labels": LABELS,
        "ranges": {name: list(bounds) for name, bounds in ranges.items()},
        **by_kind,
        "ratios": {
            "service_vs_plain_total": ratio(service["total_s"], plain["total_s"]),
            "service_vs_plain_last_median": ratio(service["last_median_ms"], plain["last_median_ms"]),
            "service_vs_inprocess_total": ratio(service["total_s"], inprocess["total_s"]),
            "service_vs_inprocess_last_median": ratio(service["last_median_ms"], inprocess["last_median_ms"]),
        },
        "inprocess_store_items": store_items(database, "long-inprocess-"),
    }
    totals = ", ".join(f"{kind} {by_kind[kind]['total_s']:.2f} s" for kind in KINDS)
    log(f"  long thread, {turns} turns x {rounds} rounds: {totals}")
    return result
