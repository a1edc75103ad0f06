"""Benchmark agents: a process of its own running one or several async chat graph loops on command.

A process hosts ``agents`` (a list of agent numbers), each an asyncio task with a checkpointer of its own.
The parent (``benchmarks.throughput``) talks to it through two queues:

* ``("prepare", mode, target, phase, count)``: open the checkpointers of the first ``count`` agents (every
  agent's when ``None``), concurrently (``"service"``: a
  ``RemoteReducingSaver(target)`` per agent; ``"inprocess"``: ``ReducingSaver(AsyncPostgresSaver)`` on
  database ``target`` with an ``on_prune`` hook writing the pruned messages into an
  ``AsyncPostgresStore`` of the agent's own; ``"plain"``: an ``AsyncPostgresSaver`` on database
  ``target``; ``"stock_service"``: a ``RemoteReducingSaver(target)`` to the stock-saver service), run
  one warm-up turn on each, answer ``("ready", process, {"agents": [ready agents],
  "errors": {agent: error}})``. An agent that cannot open its checkpointer (a database refusing more
  connections, say) closes what it opened and sits the phase out;
* ``("go", start_at, end_at)``: from wall-clock ``start_at``, every ready agent runs turns back to back
  until ``end_at`` (a new thread every ``turns_per_thread`` turns), then, :data:`CLOSE_AFTER_END`
  seconds after ``end_at`` at the earliest, its checkpointer is closed (pending store writes awaited first); answer ``("done", process, stats)``. Only turns that finished by
  ``end_at`` count; an agent whose turn fails stops, and its error is in ``stats["errors"]``;
* ``("stop",)``: exit.

With ``stages``, each agent of a service mode sends every request with its send time (``benchmarks.stages``)
and notes when the answer came; ``stats["requests"]`` holds ``(sent, received, agent)`` per request.

Once it has imported what the modes run and run a turn in memory, a process answers ``("started", process)``.

Anything else that fails is answered with ``("error", process, text)``.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from contextlib import AsyncExitStack
from typing import Any

#: ``service_b``, ``service_c``, ``service_d``: the service with other settings, the B (C, D) of an A/B.
VARIANTS = ("service_b", "service_c", "service_d")
MODES = ("service", "inprocess", "plain", "stock_service", *VARIANTS)
#: The modes whose agents talk to a service.
REMOTE_MODES = ("service", "stock_service", *VARIANTS)
#: Seconds after a phase's end before an agent closes its connections: the parent reads the phase's CPU at
#: the end (a PostgreSQL backend exiting at that moment shows none), a few milliseconds' work.
CLOSE_AFTER_END = 0.25


def error_text(exc: BaseException) -> str:
    """``Type: first line of the message``: the same failure reads the same in every agent."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


class TimedTransport:
    """The client's async transport, sending each request's send time and noting when its answer came."""

    def __init__(self, inner: Any, number: int) -> None:
        from benchmarks.stages import HEADER

        self.inner, self.number, self.header = inner, number, HEADER
        self.notes: list[tuple[int, int, int]] = []

    async def exchange(self, request: Any) -> Any:
        sent = time.monotonic_ns()
        headers = dict(request.headers)
        headers[self.header] = str(sent)
        try:
            return await self.inner.exchange(request._replace(headers=headers))
        finally:
            self.notes.append((sent, time.monotonic_ns(), self.number))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Agent:
    """One agent: its checkpointer (and store), and the resources to close after a phase."""

    def __init__(self, number: int, window: int, stages: bool = False) -> None:
        self.number, self.window, self.stages = number, window, stages
        self.stack = AsyncExitStack()
        self.graph: Any = None
        self.timed: TimedTransport | None = None

    async def open(self, mode: str, target: str) -> None:
        from benchmarks._common import AsyncStoreHook, chat_graph

        if mode in REMOTE_MODES:
            from reducing_saver.client import RemoteReducingSaver

            saver = await self.stack.enter_async_context(await RemoteReducingSaver.aopen(target))
            if self.stages:
                http = saver._http  # the client's connection: its async transport is timed in place
                self.timed = http._async = TimedTransport(http._async, self.number)
        elif mode == "inprocess":
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
            from langgraph.store.postgres.aio import AsyncPostgresStore

            from reducing_saver.reducer import MessageReducer, ReducerConfig, ReducingSaver

            # The saver first: a store exists (with its background task) only once both have connected.
            inner = await self.stack.enter_async_context(AsyncPostgresSaver.from_conn_string(target))
            store = await self.stack.enter_async_context(AsyncPostgresStore.from_conn_string(target))
            hook = AsyncStoreHook(store)
            self.stack.push_async_callback(hook.drain)  # runs before the store closes
            reducer = MessageReducer(ReducerConfig(max_messages=self.window, on_prune=[hook]))
            saver = ReducingSaver(inner, reducer)
        else:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

            saver = await self.stack.enter_async_context(AsyncPostgresSaver.from_conn_string(target))
        self.graph = chat_graph(saver)

    async def close(self) -> None:
        stack, self.stack, self.graph = self.stack, AsyncExitStack(), None
        await stack.aclose()

    async def prepare(self, mode: str, target: str, phase: str) -> None:
        from benchmarks._common import thread_config, user_input

        try:
            await self.open(mode, target)
            await self.graph.ainvoke(user_input(0), thread_config(f"tp-warmup-{phase}-{self.number}"))
        except BaseException:
            await self.close()
            raise

    async def run(self, phase: str, start_at: float, end_at: float, turns_per_thread: int) -> dict[str, Any]:
        from benchmarks._common import thread_config, user_input

        latencies: list[float] = []
        late = 0
        error = None
        await asyncio.sleep(max(0.0, start_at - time.time()))
        timed, self.timed = self.timed, None
        if timed is not None:
            timed.notes.clear()
        turn = 0
        try:
            while time.time() < end_at:
                config = thread_config(f"tp-{phase}-{self.number}-{turn // turns_per_thread}")
                started = time.perf_counter()
                await self.graph.ainvoke(user_input(turn % turns_per_thread), config)
                elapsed = (time.perf_counter() - started) * 1000
                if time.time() <= end_at:
                    latencies.append(elapsed)
                else:
                    late += 1
                turn += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported by the parent
            error = error_text(exc)
        # The parent reads the phase's CPU figures at end_at, the PostgreSQL backends these connections hold
        # among them: a backend that is exiting at that moment shows none of its CPU.
        await asyncio.sleep(max(0.0, end_at + CLOSE_AFTER_END - time.time()))
        try:
            # Its connections close before the next phase; pending store writes are awaited first.
            await self.close()
        except Exception as exc:  # noqa: BLE001 - a failed store write, say
            error = error or error_text(exc)
        requests = timed.notes if timed is not None else []
        return {"latencies_ms": latencies, "late_turns": late, "error": error, "requests": requests}


async def _prepare(agents: list[Agent], mode: str, target: str, phase: str) -> dict[str, Any]:
    outcomes = await asyncio.gather(
        *(agent.prepare(mode, target, phase) for agent in agents), return_exceptions=True
    )
    errors = {
        agent.number: error_text(outcome)
        for agent, outcome in zip(agents, outcomes, strict=True)
        if isinstance(outcome, BaseException)
    }
    return {"agents": [agent.number for agent in agents if agent.number not in errors], "errors": errors}


async def _run(
    agents: list[Agent], phase: str, start_at: float, end_at: float, turns_per_thread: int
) -> dict[str, Any]:
    cpu_started = time.process_time()
    stats = await asyncio.gather(*(agent.run(phase, start_at, end_at, turns_per_thread) for agent in agents))
    return {
        "agents": len(agents),
        "latencies_ms": [value for agent in stats for value in agent["latencies_ms"]],
        "late_turns": sum(agent["late_turns"] for agent in stats),
        "turns_by_agent": [len(agent["latencies_ms"]) for agent in stats],
        "turns_of": {agent.number: stat["latencies_ms"] for agent, stat in zip(agents, stats, strict=True)},
        "requests": [note for agent in stats for note in agent["requests"]],
        # This process's CPU (all threads) over every turn its agents ran, the late ones and the store
        # writes they left pending included.
        "cpu_s": time.process_time() - cpu_started,
        "errors": {
            agent.number: stat["error"] for agent, stat in zip(agents, stats, strict=True) if stat["error"]
        },
    }


async def _warm_up() -> None:
    """Import what every mode runs and run a turn in memory, before the first phase: agents that prepared
    early would otherwise sit idle while fresh processes do it, and the service closes keep-alive
    connections idle for 5 s (the client then retries its first call)."""
    import aiohttp  # noqa: F401 - RemoteReducingSaver's async transport
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver  # noqa: F401
    from langgraph.store.postgres.aio import AsyncPostgresStore  # noqa: F401

    from benchmarks._common import chat_graph, thread_config, user_input
    from reducing_saver.client import RemoteReducingSaver  # noqa: F401
    from reducing_saver.reducer import ReducingSaver  # noqa: F401

    await chat_graph(InMemorySaver()).ainvoke(user_input(0), thread_config("warm-up"))


async def _loop(
    process: int,
    numbers: list[int],
    commands: Any,
    results: Any,
    turns_per_thread: int,
    window: int,
    stages: bool,
) -> None:
    await _warm_up()
    results.put(("started", process))
    agents = [Agent(number, window, stages) for number in numbers]
    ready: list[Agent] = []
    phase = ""
    while True:
        command = await asyncio.to_thread(commands.get)
        try:
            if command[0] == "stop":
                for agent in agents:
                    await agent.close()
                return
            if command[0] == "prepare":
                _, mode, target, phase, count = command
                outcome = await _prepare(agents[:count], mode, target, phase)
                ready = [agent for agent in agents if agent.number in outcome["agents"]]
                results.put(("ready", process, outcome))
            elif command[0] == "go":
                _, start_at, end_at = command
                stats = await _run(ready, phase, start_at, end_at, turns_per_thread)
                ready = []
                results.put(("done", process, stats))
        except Exception:  # noqa: BLE001 - any failure goes to the parent, which raises it
            results.put(("error", process, traceback.format_exc()))


def main(
    process: int,
    agents: list[int],
    commands: Any,
    results: Any,
    turns_per_thread: int,
    window: int,
    stages: bool = False,
) -> None:
    """The process target (multiprocessing, spawn): agents number ``agents`` in process ``process``."""
    asyncio.run(_loop(process, agents, commands, results, turns_per_thread, window, stages))
