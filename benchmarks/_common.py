"""What every benchmark section shares: scratch databases, the chat graph, percentiles, CPU readings."""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

PG_HOST = os.environ.get("REDUCING_SAVER_TEST_PGHOST", "127.0.0.1")
PG_PORT = os.environ.get("REDUCING_SAVER_TEST_PGPORT", "5432")
PG_USER = os.environ.get("REDUCING_SAVER_TEST_PGUSER", "postgres")
DEFAULT_SERVER = f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}"

MESSAGE_CHARS = 400
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# Messages are words drawn from a fixed vocabulary: about as compressible as prose (PostgreSQL compresses
# large blobs), unlike a repeated phrase. Sizes are reported uncompressed (octet_length) anyway.
_VOCABULARY = [
    "".join(random.Random(seed).choices("abcdefghijklmnopqrstuvwxyz", k=3 + seed % 7)) for seed in range(600)
]


def text(seed: int | str, length: int = MESSAGE_CHARS) -> str:
    """``length`` characters of deterministic word salad for ``seed``."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(_VOCABULARY)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:length]


def user_input(turn: int) -> dict[str, Any]:
    return {"messages": [("user", text(f"user-{turn}"))]}


def chat_graph(checkpointer: Any) -> Any:
    """A simple chat graph: ``StateGraph(MessagesState)``, one node answering ~400 characters."""
    from langchain_core.messages import AIMessage
    from langgraph.graph import START, MessagesState, StateGraph

    def bot(state: MessagesState) -> dict[str, list[AIMessage]]:
        return {"messages": [AIMessage(text(f"ai-{len(state['messages'])}"))]}

    builder = StateGraph(MessagesState)
    builder.add_node("bot", bot)
    builder.add_edge(START, "bot")
    return builder.compile(checkpointer=checkpointer)


def store_put_ops(messages: list[Any], namespace: tuple[str, ...]) -> list[Any]:
    """One store item per pruned message: keyed by its id, valued as langchain_core serializes it
    (``message_to_dict``, as the service's store writer does)."""
    from langchain_core.messages import message_to_dict
    from langgraph.store.base import PutOp

    return [PutOp(namespace, message.id, message_to_dict(message)) for message in messages]


class AsyncStoreHook:
    """The same-features baseline's ``on_prune`` hook: the pruned messages into an async LangGraph store.

    Hooks are sync callables, called inside ``aput`` on the running loop, so this one cannot await: it
    schedules ``store.abatch`` as a task and keeps it until :meth:`drain` awaits it (which raises the
    first failed write).
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self.pending: list[asyncio.Task[Any]] = []

    def __call__(self, messages: list[Any], namespace: tuple[str, ...]) -> None:
        write = self.store.abatch(store_put_ops(messages, namespace))
        self.pending.append(asyncio.get_running_loop().create_task(write))

    async def drain(self) -> None:
        pending, self.pending = self.pending, []
        await asyncio.gather(*pending)


def thread_config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(latencies_ms: list[float]) -> dict[str, float]:
    return {
        "n": len(latencies_ms),
        "median_ms": round(statistics.median(latencies_ms), 3),
        "p95_ms": round(percentile(latencies_ms, 0.95), 3),
        "mean_ms": round(statistics.fmean(latencies_ms), 3),
    }


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as listed:
                children += [int(child) for child in listed.read().split()]
    except FileNotFoundError:  # exited meanwhile
        pass
    return children


def _process_cpu(pid: int | str, reaped_children: bool = False) -> tuple[str, float] | None:
    """``(command name, user + system CPU seconds)`` of a process, from /proc/<pid>/stat; ``None`` once
    it has exited. ``reaped_children`` adds the time of its children that exited and were waited for."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            head, _, rest = stat.read().rpartition(")")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # rest[0] is field 3 (state): utime and stime are fields 14 and 15, cutime and cstime 16 and 17.
    fields = rest.split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return head.partition("(")[2], ticks / CLOCK_TICKS


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` alone; ``None`` once it has exited."""
    found = _process_cpu(pid)
    return found[1] if found is not None else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) and of its live child processes (the
    worker processes of ``serve --workers N``), from /proc/<pid>/stat."""
    own = _process_cpu(pid)
    if own is None:
        return 0.0
    return own[1] + sum(cpu_seconds(child) for child in _children(pid))


def run_time_seconds(pid: int) -> float:
    """Time the threads of process ``pid`` have spent on a CPU, in nanoseconds' resolution (the sum of
    ``/proc/<pid>/task/*/schedstat``); :func:`cpu_seconds` counts clock ticks, too coarse for a few
    thousand short requests. Falls back to it where schedstat is missing."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        total = 0
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as schedstat:
                total += int(schedstat.read().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return cpu_seconds(pid)
    return total / 1e9


def tree_run_time_seconds(pid: int) -> float:
    """:func:`run_time_seconds` of process ``pid`` plus that of its live child processes (a server's
    worker processes), recursively."""
    return run_time_seconds(pid) + sum(tree_run_time_seconds(child) for child in _children(pid))


def postgres_cpu_seconds() -> float:
    """User + system CPU time of every PostgreSQL server process of this machine (its backends, WAL
    writer, checkpointer...), from /proc; 0.0 where there is no /proc. The server must be local, as the
    suite's is. Server processes that exited (backends of closed connections, autovacuum workers) count
    through the postmaster, which reaps them, so the difference of two readings holds their work too."""
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except FileNotFoundError:
        return 0.0
    found = (_process_cpu(pid, reaped_children=True) for pid in pids)
    return sum(cpu for name, cpu in filter(None, found) if name == "postgres")


def machine_cpu_seconds() -> float:
    """CPU time every core of this machine has spent busy (user, nice, system, irq, softirq, steal), from
    /proc/stat; 0.0 where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except FileNotFoundError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


@contextmanager
def scratch_database(server: str = DEFAULT_SERVER) -> Iterator[str]:
    """A database of this run's own on ``server``, dropped afterwards; yields its URL."""
    name = f"rs_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{server}/{name}"
    finally:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
