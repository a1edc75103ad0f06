"""Latency: per-turn ``graph.invoke`` / ``ainvoke`` through three or four checkpointers on one database.

* ``remote``: ``RemoteReducingSaver`` to the service;
* ``inprocess``: what a user would run instead of the service with the same features, in-process
  ``ReducingSaver + on_prune → AsyncPostgresStore``: ``ReducingSaver(AsyncPostgresSaver)`` (sync:
  ``ReducingSaver(PostgresSaver)``) whose ``on_prune`` hook writes the pruned messages into LangGraph's
  ``AsyncPostgresStore`` (sync: ``PostgresStore``), one item per message under the hook's namespace, as the
  service's deliverer writes them into its store;
* ``plain``: ``PostgresSaver`` (async: ``AsyncPostgresSaver``), no reducer and no long-term memory;
* ``stock_service`` (when given its url): ``RemoteReducingSaver`` to the stock-saver service
  (``benchmarks/stock_service.py``), the service with its per-step work reduced to the stock
  ``PostgresSaver`` call: the floor of a per-call service storing through LangGraph's saver.

Each round gives every checkpointer a fresh thread and runs ``turns`` turns on each (20 in a full run:
the window of 20 messages fills at turn 10, so half the turns prune), the checkpointers taking turns turn
by turn (remote, in-process, plain, remote, ...; the order rotates every round), so all see the
same machine load. Besides each turn's time, the agent process's own CPU time over the turn is kept
(``cpu`` samples): what a turn costs the agent's machine, the service's and PostgreSQL's work aside. The
store items the in-process hook wrote are counted afterwards, to show the baseline did its share, and
the messages each checkpointer gives back in its last thread, to show which keep a window.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from typing import Any

import psycopg
from langchain_core.messages import BaseMessage
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.store.postgres import AsyncPostgresStore, PostgresStore

from benchmarks._common import (
    AsyncStoreHook,
    chat_graph,
    ratio,
    store_put_ops,
    summary,
    thread_config,
    user_input,
)
from reducing_saver.client import RemoteReducingSaver
from reducing_saver.reducer import MessageReducer, ReducerConfig, ReducingSaver

KINDS = ("remote", "inprocess", "plain")
STOCK_SERVICE = "stock_service"
LABELS = {
    "remote": "RemoteReducingSaver to the service",
    "inprocess": "in-process ReducingSaver + on_prune → AsyncPostgresStore (sync: PostgresSaver, PostgresStore)",
    "plain": "plain AsyncPostgresSaver (sync: PostgresSaver)",
    STOCK_SERVICE: "RemoteReducingSaver to the service with its per-step work reduced to the stock "
    "PostgresSaver call",
}


@contextmanager
def inprocess_saver(database: str, window: int) -> Iterator[ReducingSaver]:
    """``ReducingSaver(PostgresSaver)`` whose ``on_prune`` hook puts the pruned messages into a
    ``PostgresStore`` (``store.batch``, on the put's own path)."""
    with PostgresStore.from_conn_string(database) as store, PostgresSaver.from_conn_string(database) as saver:
        store.setup()
        saver.setup()

        def store_pruned(messages: list[BaseMessage], namespace: tuple[str, ...]) -> None:
            store.batch(store_put_ops(messages, namespace))

        reducer = MessageReducer(ReducerConfig(max_messages=window, on_prune=[store_pruned]))
        yield ReducingSaver(saver, reducer)


@asynccontextmanager
async def async_inprocess_saver(database: str, window: int) -> AsyncIterator[ReducingSaver]:
    """``ReducingSaver(AsyncPostgresSaver)`` whose ``on_prune`` hook puts the pruned messages into an
    ``AsyncPostgresStore`` (``_common.AsyncStoreHook``); the writes still pending are awaited on exit."""
    async with (
        AsyncPostgresStore.from_conn_string(database) as store,
        AsyncPostgresSaver.from_conn_string(database) as saver,
    ):
        await store.setup()
        await saver.setup()
        hook = AsyncStoreHook(store)
        try:
            reducer = MessageReducer(ReducerConfig(max_messages=window, on_prune=[hook]))
            yield ReducingSaver(saver, reducer)
        finally:
            await hook.drain()


@contextmanager
def plain_saver(database: str) -> Iterator[PostgresSaver]:
    with PostgresSaver.from_conn_string(database) as saver:
        saver.setup()
        yield saver


@asynccontextmanager
async def async_plain_saver(database: str) -> AsyncIterator[AsyncPostgresSaver]:
    async with AsyncPostgresSaver.from_conn_string(database) as saver:
        await saver.setup()
        yield saver


def store_items(database: str, thread_prefix: str) -> int:
    """Store items under the default memory namespaces (``("memories", thread id)``) of the threads whose
    ids start with ``thread_prefix``."""
    with psycopg.connect(database) as conn:
        row = conn.execute(
            "SELECT count(*) FROM store WHERE prefix LIKE %s", (f"memories.{thread_prefix}%",)
        ).fetchone()
    return int(row[0]) if row else 0


def _turn_sync(graph: Any, config: dict[str, Any], turn: int) -> tuple[float, float]:
    """(wall ms, this process's CPU ms) of one turn."""
    start, cpu = time.perf_counter(), time.process_time()
    graph.invoke(user_input(turn), config)
    return (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000


async def _turn_async(graph: Any, config: dict[str, Any], turn: int) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    await graph.ainvoke(user_input(turn), config)
    return (time.perf_counter() - start) * 1000, (time.process_time() - cpu) * 1000


def _new_threads(kinds: Iterable[str], prefix: str) -> dict[str, dict[str, Any]]:
    return {kind: thread_config(f"{prefix}-{kind}-{uuid.uuid4().hex}") for kind in kinds}


def figures(samples: list[tuple[float, float]]) -> dict[str, float]:
    """Wall-time summary of the turns, plus the agent process's median CPU per turn."""
    result = summary([wall for wall, _ in samples])
    result["agent_cpu_ms_median"] = round(statistics.median(cpu for _, cpu in samples), 3)
    return result


def _ratios(result: dict[str, dict[str, float]]) -> dict[str, float]:
    remote, inprocess, plain = (result[kind] for kind in KINDS)
    ratios = {
        "remote_vs_inprocess_median": ratio(remote["median_ms"], inprocess["median_ms"]),
        "remote_vs_inprocess_p95": ratio(remote["p95_ms"], inprocess["p95_ms"]),
        "remote_vs_plain_median": ratio(remote["median_ms"], plain["median_ms"]),
        "remote_vs_plain_p95": ratio(remote["p95_ms"], plain["p95_ms"]),
        "inprocess_vs_plain_median": ratio(inprocess["median_ms"], plain["median_ms"]),
        "remote_vs_inprocess_agent_cpu": ratio(
            remote["agent_cpu_ms_median"], inprocess["agent_cpu_ms_median"]
        ),
    }
    if STOCK_SERVICE in result:
        stock = result[STOCK_SERVICE]
        ratios["stock_service_vs_inprocess_median"] = ratio(stock["median_ms"], inprocess["median_ms"])
        ratios["stock_service_vs_inprocess_p95"] = ratio(stock["p95_ms"], inprocess["p95_ms"])
        ratios["remote_vs_stock_service_median"] = ratio(remote["median_ms"], stock["median_ms"])
    return ratios


def _rotated(kinds: list[str], round_index: int) -> list[str]:
    shift = round_index % len(kinds)
    return kinds[shift:] + kinds[:shift]


def run_sync(
    service_url: str,
    database: str,
    *,
    turns: int,
    rounds: int,
    window: int,
    kinds: tuple[str, ...] = KINDS,
    stock_service_url: str | None = None,
    thread_prefix: str = "lat-sync",
    kept: dict[str, int] | None = None,
) -> dict[str, list[tuple[float, float]]]:
    """Per kind, ``(wall ms, agent CPU ms)`` of every measured turn; ``kept`` gets, per kind, the messages
    in the state of its last thread."""
    with ExitStack() as stack:
        graphs: dict[str, Any] = {}
        if "remote" in kinds:
            graphs["remote"] = chat_graph(stack.enter_context(RemoteReducingSaver(service_url)))
        if "inprocess" in kinds:
            graphs["inprocess"] = chat_graph(stack.enter_context(inprocess_saver(database, window)))
        if "plain" in kinds:
            graphs["plain"] = chat_graph(stack.enter_context(plain_saver(database)))
        if stock_service_url:
            graphs[STOCK_SERVICE] = chat_graph(stack.enter_context(RemoteReducingSaver(stock_service_url)))
        samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in graphs}
        # Warm up (connections, first-call caches) on threads of their own.
        for kind, config in _new_threads(graphs, f"{thread_prefix}-warm").items():
            for turn in range(3):
                _turn_sync(graphs[kind], config, turn)
        for round_index in range(rounds):
            threads = _new_threads(graphs, thread_prefix)
            order = _rotated(list(graphs), round_index)
            for turn in range(turns):
                for kind in order:
                    samples[kind].append(_turn_sync(graphs[kind], threads[kind], turn))
        if kept is not None:
            for kind, graph in graphs.items():
                kept[kind] = len(graph.get_state(threads[kind]).values["messages"])
    return samples


async def run_async(
    service_url: str,
    database: str,
    *,
    turns: int,
    rounds: int,
    window: int,
    kinds: tuple[str, ...] = KINDS,
    stock_service_url: str | None = None,
    thread_prefix: str = "lat-async",
    kept: dict[str, int] | None = None,
) -> dict[str, list[tuple[float, float]]]:
    """Per kind, ``(wall ms, agent CPU ms)`` of every measured turn; ``kept`` as :func:`run_sync`'s."""
    async with AsyncExitStack() as stack:
        graphs: dict[str, Any] = {}
        if "remote" in kinds:
            graphs["remote"] = chat_graph(await stack.enter_async_context(RemoteReducingSaver(service_url)))
        if "inprocess" in kinds:
            inprocess = await stack.enter_async_context(async_inprocess_saver(database, window))
            graphs["inprocess"] = chat_graph(inprocess)
        if "plain" in kinds:
            graphs["plain"] = chat_graph(await stack.enter_async_context(async_plain_saver(database)))
        if stock_service_url:
            stock = await stack.enter_async_context(RemoteReducingSaver(stock_service_url))
            graphs[STOCK_SERVICE] = chat_graph(stock)
        samples = {kind: [] for kind in graphs}
        for kind, config in _new_threads(graphs, f"{thread_prefix}-warm").items():
            for turn in range(3):
                await _turn_async(graphs[kind], config, turn)
        for round_index in range(rounds):
            threads = _new_threads(graphs, thread_prefix)
            order = _rotated(list(graphs), round_index)
            for turn in range(turns):
                for kind in order:
                    samples[kind].append(await _turn_async(graphs[kind], threads[kind], turn))
        if kept is not None:
            for kind, graph in graphs.items():
                kept[kind] = len((await graph.aget_state(threads[kind])).values["messages"])
    return samples


def run(
    service_url: str,
    database: str,
    *,
    turns: int,
    rounds: int,
    window: int,
    stock_service_url: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Sync then async turns of every checkpointer (``stock_service`` too when ``stock_service_url`` is
    given), with their figures and ratios."""
    result: dict[str, Any] = {"turns_per_thread": turns, "rounds": rounds, "window": window, "labels": LABELS}
    for mode in ("sync", "async"):
        prefix = f"lat-{mode}"
        kept: dict[str, int] = {}
        options = {
            "turns": turns,
            "rounds": rounds,
            "window": window,
            "thread_prefix": prefix,
            "stock_service_url": stock_service_url,
            "kept": kept,
        }
        if mode == "sync":
            samples = run_sync(service_url, database, **options)
        else:
            samples = asyncio.run(run_async(service_url, database, **options))
        figures_by_kind = {kind: figures(values) for kind, values in samples.items()}
        result[mode] = {
            **figures_by_kind,
            "ratios": _ratios(figures_by_kind),
            "inprocess_store_items": store_items(database, f"{prefix}-inprocess-"),
            # What each checkpointer gives the graph back: a window, or (plain, stock service) everything.
            "messages_in_last_thread": kept,
        }
        medians = ", ".join(f"{k} {v['median_ms']:.2f} ms" for k, v in figures_by_kind.items())
        log(f"  latency {mode}: {medians}")
    return result
