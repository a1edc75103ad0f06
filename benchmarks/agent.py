"""One benchmark agent: a process of its own running the async chat graph loop on command.

The parent (``benchmarks.throughput``) talks to it through two queues:

* ``("prepare", mode, target, phase)``: open the checkpointer (``"service"``: ``RemoteReducingSaver(target)``;
  ``"direct"``: an ``AsyncPostgresSaver`` of its own on database ``target``), run one warm-up turn,
  answer ``("ready", agent)``;
* ``("go", start_at, end_at)``: from wall-clock ``start_at``, run turns back to back until ``end_at``
  (a new thread every ``turns_per_thread`` turns), close the checkpointer, answer ``("done", agent,
  stats)``; only turns that finished by ``end_at`` count;
* ``("stop",)``: exit.

Any failure is answered with ``("error", agent, text)``.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from contextlib import AsyncExitStack
from typing import Any


async def _prepare(stack: AsyncExitStack, mode: str, target: str) -> Any:
    from benchmarks._common import chat_graph

    if mode == "service":
        from reducing_saver.client import RemoteReducingSaver

        saver = await stack.enter_async_context(RemoteReducingSaver(target))
    else:
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        saver = await stack.enter_async_context(AsyncPostgresSaver.from_conn_string(target))
    return chat_graph(saver)


async def _run(graph: Any, agent: int, phase: str, start_at: float, end_at: float,
               turns_per_thread: int) -> dict[str, Any]:
    from benchmarks._common import thread_config, user_input

    latencies: list[float] = []
    late = 0
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu_started = time.process_time()
    turn = 0
    while time.time() < end_at:
        config = thread_config(f"tp-{phase}-{agent}-{turn // turns_per_thread}")
        started = time.perf_counter()
        await graph.ainvoke(user_input(turn % turns_per_thread), config)
        elapsed = (time.perf_counter() - started) * 1000
        if time.time() <= end_at:
            latencies.append(elapsed)
        else:
            late += 1
        turn += 1
    # This process's CPU (all threads) over every turn it ran, the late ones included.
    return {"latencies_ms": latencies, "late_turns": late, "cpu_s": time.process_time() - cpu_started}


async def _loop(agent: int, commands: Any, results: Any, turns_per_thread: int) -> None:
    stack = AsyncExitStack()
    graph = None
    phase = ""
    while True:
        command = await asyncio.to_thread(commands.get)
        try:
            if command[0] == "stop":
                await stack.aclose()
                return
            if command[0] == "prepare":
                _, mode, target, phase = command
                graph = await _prepare(stack, mode, target)
                from benchmarks._common import thread_config, user_input

                await graph.ainvoke(user_input(0), thread_config(f"tp-warmup-{phase}-{agent}"))
                results.put(("ready", agent))
            elif command[0] == "go":
                _, start_at, end_at = command
                stats = await _run(graph, agent, phase, start_at, end_at, turns_per_thread)
                await stack.aclose()  # direct mode: its connection closes before the next phase
                stack, graph = AsyncExitStack(), None
                results.put(("done", agent, stats))
        except Exception:  # noqa: BLE001 - any failure goes to the parent, which raises it
            results.put(("error", agent, traceback.format_exc()))


def main(agent: int, commands: Any, results: Any, turns_per_thread: int) -> None:
    """The process target (multiprocessing, spawn)."""
    asyncio.run(_loop(agent, commands, results, turns_per_thread))
