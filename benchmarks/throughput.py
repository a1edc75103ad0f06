"""Throughput: N agents through one service vs the same agents each with its own checkpointer.

Three or four modes (``benchmarks.agent`` opens them):

* ``service``: every agent has a ``RemoteReducingSaver`` of its own to the one service;
* ``inprocess``: what a user would run instead with the same features: every agent has a
  ``ReducingSaver(AsyncPostgresSaver)`` (the service's window) whose ``on_prune`` hook writes the pruned
  messages into an ``AsyncPostgresStore`` of the agent's own (two connections per agent); the parent
  runs the store's ``setup()`` once;
* ``plain``: every agent has a plain ``AsyncPostgresSaver`` (no window, no memory);
* ``stock_service`` (when the suite runs one): every agent has a ``RemoteReducingSaver`` to the
  stock-saver service (``benchmarks/stock_service.py``: the service with the same workers, its per-step
  work reduced to the stock ``PostgresSaver`` call), the floor under the ``service`` mode.

A level is N agents in P processes: one agent per process (N = P), or several per process as asyncio
tasks (N/P each). The processes are spawned once per layout (as many as its largest level needs); for
each level, the first P of them alternate between the modes for ``rounds`` rounds of ``duration``
seconds each (``service``, ``inprocess``, ``plain``, ``stock_service``, then the reverse order, ...),
all agents starting and stopping on the same wall-clock instants; the others wait, idle. An agent that
cannot open its checkpointer (a database refusing more connections: PostgreSQL's ``max_connections`` is
below what many direct agents need) sits the phase out; the level reports per mode how many agents
connected, completed the phase, and failed with which error. After each phase the parent waits until the agents'
connections are gone from ``pg_stat_activity``.

Meanwhile a sampler reads ``pg_stat_activity`` for the benchmark database every 100 ms, by
``application_name`` (the service's connections and the agents' own are named): connections open and
connections active (running a statement), maxima over the phase. In service phases the service
process's CPU time (the stock-saver service's in its phases) is read from /proc around the phase,
giving its CPU per turn; so is PostgreSQL's (every server process), and each agent process reports its
own CPU, so each mode's CPU per turn is accounted for: agents + service + PostgreSQL. The whole
machine's busy time per turn (/proc/stat) is kept too: it also holds what the processes' own figures miss (the kernel's work for their sockets, the
sampler). On one machine the modes share its cores, so those sums set the ratio of turns/s. PostgreSQL's
figure is every server process of the machine; ``postgres_backends_cpu_us_per_turn`` is the mode's own
connections' backends alone (what other users of a shared server cannot blur).

Levels of the same processes (``32/4,128/4``) are interleaved: one set of processes holds the largest
level, a smaller one uses the first agents of each, and every round runs every level and mode, after a
short phase of every mode that is not counted. With
``conditions=("quiet", "contended")`` every level runs again with a CPU-hungry process beside it
(:class:`Neighbour`, a busy loop; its CPU is taken out of the machine's). ``growth`` compares each
condition's largest level with its smallest: turns/s and p95, per mode.

With ``stages_dir``, the services run under ``benchmarks.stages``: their workers time every per-step
request by stage (accept, decode, worker thread, saver, pool, database, resume, answer) and the agents
note when they sent each request and when its answer came; each service mode gets ``stages`` (per stage
median, p95, p99 and mean in ms, and each worker's share of the requests) and the turns per agent, so a
tail is shown by where requests waited, and for whom.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Self

import psycopg

from benchmarks import agent as agent_module
from benchmarks import stages
from benchmarks._common import (
    cpu_seconds,
    machine_cpu_seconds,
    percentile,
    postgres_cpu_seconds,
    process_cpu_seconds,
    ratio,
    summary,
)

MODES = agent_module.MODES
#: The modes whose agents talk to PostgreSQL themselves.
DIRECT_MODES = ("inprocess", "plain")
#: ``application_name`` of the service's connections and of the agents' own (set in their database URLs).
SERVICE_APP = "rs-bench-service"
AGENT_APP = "rs-bench-agent"
#: ``application_name`` of the stock-saver service's connections (``benchmarks/stock_service.py``).
STOCK_APP = "rs-bench-stock-service"
#: The modes whose agents talk to a service, and its connections' ``application_name`` (the variants':
#: the service with other settings, when an A/B runs them: ``--ab-args``).
SERVICE_MODES = {
    "service": SERVICE_APP,
    "stock_service": STOCK_APP,
    **{variant: f"rs-bench-{variant.replace('_', '-')}" for variant in agent_module.VARIANTS},
}
CONNECTIONS = """
    SELECT application_name, count(*), count(*) FILTER (WHERE state = 'active')
    FROM pg_stat_activity
    WHERE datname = %s AND backend_type = 'client backend' AND pid <> pg_backend_pid()
    GROUP BY application_name
"""
AGENT_CONNECTIONS = """
    SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s
"""


def wal_counters(conn: psycopg.Connection) -> tuple[int, int, int]:
    """PostgreSQL's WAL figures since its stats reset: (records, syncs to disk, bytes)."""
    query = "SELECT wal_records, wal_sync, wal_bytes FROM pg_stat_wal"
    records, syncs, written = conn.execute(query).fetchone()
    return int(records), int(syncs), int(written)


DATABASE_COUNTERS = (
    "xact_commit",
    "tup_inserted",
    "tup_updated",
    "tup_deleted",
    "tup_fetched",
    "tup_returned",
)


def database_counters(conn: psycopg.Connection, database_name: str) -> tuple[int, ...]:
    """This database's own counters from ``pg_stat_database`` (:data:`DATABASE_COUNTERS`): transactions
    committed and rows written and read, whoever else uses the server. Backends report them at most once a
    second, so a phase's figures are good to about a second's worth."""
    query = f"SELECT {', '.join(DATABASE_COUNTERS)} FROM pg_stat_database WHERE datname = %s"
    return tuple(int(value) for value in conn.execute(query, (database_name,)).fetchone())


def with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def parse_level(text: str) -> tuple[int, int]:
    """``"N"`` (N agents, one per process) or ``"N/P"`` (N agents in P processes) as ``(N, P)``."""
    agents, _, processes = text.strip().partition("/")
    count, spread = int(agents), int(processes or agents)
    if count < 1 or spread < 1 or count % spread:
        raise ValueError(f"agent level {text!r}: N/P needs N and P positive and N a multiple of P")
    return count, spread


class ConnectionSampler:
    """Samples the database's connections in a thread of its own, by ``application_name``.

    Connects once, on entry, so that a phase filling PostgreSQL's ``max_connections`` cannot lock it
    out. ``reset()`` starts a new measurement; ``figures(name)`` gives the maxima (and the mean) since
    then of the connections whose application is ``name``: open, and active (running a statement when
    sampled); ``figures(None)`` counts every connection.
    """

    def __init__(self, server: str, database_name: str, interval: float = 0.1) -> None:
        self.database_name, self.interval = database_name, interval
        self._conn = psycopg.connect(f"{server}/postgres", autocommit=True)
        self._lock = threading.Lock()
        self.reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def reset(self) -> None:
        with self._lock:
            self.samples = 0
            self._open_max: dict[str | None, int] = {}
            self._active_max: dict[str | None, int] = {}
            self._open_sum: dict[str | None, int] = {}

    def _sample(self) -> None:
        while not self._stop.is_set():
            rows = self._conn.execute(CONNECTIONS, (self.database_name,)).fetchall()
            totals = {None: (sum(r[1] for r in rows), sum(r[2] for r in rows))}
            totals.update({name: (opened, active) for name, opened, active in rows})
            with self._lock:
                for name, (opened, active) in totals.items():
                    self._open_max[name] = max(self._open_max.get(name, 0), opened)
                    self._active_max[name] = max(self._active_max.get(name, 0), active)
                    self._open_sum[name] = self._open_sum.get(name, 0) + opened
                self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._conn.close()

    def figures(self, name: str | None) -> dict[str, float]:
        with self._lock:
            return {
                "connections_max": self._open_max.get(name, 0),
                "active_connections_max": self._active_max.get(name, 0),
                "connections_mean": round(self._open_sum.get(name, 0) / self.samples, 1)
                if self.samples
                else 0,
            }


class Agents:
    """``processes`` spawned agent processes of ``per_process`` agents each, and their queues."""

    def __init__(
        self, processes: int, per_process: int, turns_per_thread: int, window: int, stages: bool = False
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.per_process = per_process
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(processes)]
        self.processes = [
            context.Process(
                target=agent_module.main,
                args=(
                    index,
                    list(range(index * per_process, (index + 1) * per_process)),
                    self.commands[index],
                    self.results,
                    turns_per_thread,
                    window,
                    stages,
                ),
                daemon=True,
            )
            for index in range(processes)
        ]
        for process in self.processes:
            process.start()
        try:
            self.collect("started", timeout=120 + 2 * processes, count=processes)
        except BaseException:
            self.close()
            raise

    def broadcast(self, command: tuple, count: int | None = None) -> None:
        for commands in self.commands[:count]:
            commands.put(command)

    def collect(self, kind: str, timeout: float, count: int) -> dict[int, Any]:
        """The answers of the first ``count`` processes, by process."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < count:
            try:
                message = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [p.pid for p in self.processes if not p.is_alive()]
                raise RuntimeError(
                    f"{count - len(answers)} agent processes did not answer {kind!r} in {timeout}s "
                    f"(exited: {dead})"
                ) from None
            if message[0] == "error":
                raise RuntimeError(f"agent process {message[1]} failed:\n{message[2]}")
            if message[0] != kind:
                raise RuntimeError(f"expected {kind!r} from agent processes, got {message!r}")
            answers[message[1]] = message[2] if len(message) > 2 else None
        return answers

    def close(self) -> None:
        self.broadcast(("stop",))
        for process in self.processes:
            process.join(timeout=10)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


class Monitor:
    """What the parent reads around a phase: the sampler, and a connection of its own for WAL figures
    and the agents' leftover connections. Both connect once, before any phase."""

    def __init__(self, server: str, database_name: str, sampler: ConnectionSampler) -> None:
        self.database_name, self.sampler = database_name, sampler
        self.conn = psycopg.connect(f"{server}/postgres", autocommit=True)

    def backend_pids(self, application: str) -> list[int]:
        """The server processes of this database's connections named ``application``."""
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
            (self.database_name, application),
        ).fetchall()
        return [int(row[0]) for row in rows]

    def agent_connections(self) -> int:
        return int(self.conn.execute(AGENT_CONNECTIONS, (self.database_name, AGENT_APP)).fetchone()[0])

    def wait_agents_gone(self, timeout: float = 30.0) -> int:
        """Wait until no agent connection is left (their backends exit just after the agents close them);
        returns how many are still there after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := self.agent_connections()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


class Neighbour:
    """A CPU-hungry process beside the benchmark (a busy loop, one core's worth), until the block ends."""

    def __enter__(self) -> Self:
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def __exit__(self, *exc_info: object) -> None:
        self.process.kill()
        self.process.wait()


def _phase(
    agents: Agents,
    level: tuple[int, int],
    mode: str,
    target: str,
    phase: str,
    duration: float,
    monitor: Monitor,
    service_pid: int,
    stages_dir: Path | None = None,
    neighbour: Neighbour | None = None,
    keep_stage_records: bool = False,
) -> dict[str, Any]:
    """One phase of ``mode``; ``service_pid``: the process whose CPU counts as the service's (the mode's
    service, when it has one); ``stages_dir``: where the services' workers write their stage records."""
    count, processes = level
    agents.broadcast(("prepare", mode, target, phase, count // processes), processes)
    prepared = agents.collect("ready", timeout=120 + 2 * count, count=processes)
    connect_errors = Counter(error for answer in prepared.values() for error in answer["errors"].values())
    ready = sum(len(answer["agents"]) for answer in prepared.values())
    start_at = time.time() + 0.3
    end_at = start_at + duration
    offset_ns = time.monotonic_ns() - time.time_ns()
    start_ns, end_ns = int(start_at * 1e9) + offset_ns, int(end_at * 1e9) + offset_ns
    agents.broadcast(("go", start_at, end_at), processes)
    time.sleep(max(0.0, start_at - time.time()))
    monitor.sampler.reset()
    wal_before = wal_counters(monitor.conn)
    database_before = database_counters(monitor.conn, monitor.database_name)
    neighbour_cpu = neighbour.cpu_seconds if neighbour is not None else float
    # This mode's own PostgreSQL backends (the cluster-wide figure holds whatever else the server runs).
    backends = monitor.backend_pids(SERVICE_MODES.get(mode, AGENT_APP))
    backends_before = {pid: cpu for pid in backends if (cpu := process_cpu_seconds(pid)) is not None}
    before = cpu_seconds(service_pid), postgres_cpu_seconds(), machine_cpu_seconds(), neighbour_cpu()
    time.sleep(max(0.0, end_at - time.time()))
    after = cpu_seconds(service_pid), postgres_cpu_seconds(), machine_cpu_seconds(), neighbour_cpu()
    backends_cpu = sum(
        cpu - backends_before[pid] for pid in backends_before if (cpu := process_cpu_seconds(pid)) is not None
    )
    wal_after = wal_counters(monitor.conn)
    database_after = database_counters(monitor.conn, monitor.database_name)
    connections = monitor.sampler.figures(SERVICE_MODES.get(mode, AGENT_APP))
    database_connections = monitor.sampler.figures(None)["connections_max"]
    (service_cpu, postgres_cpu, machine_cpu, neighbour_s) = (
        b - a for a, b in zip(before, after, strict=True)
    )
    machine_cpu -= neighbour_s  # the machine's busy time for the benchmark's own processes
    stats = agents.collect("done", timeout=duration + 120, count=processes)
    # A failed phase must not leave connections to the next one.
    leftover = monitor.wait_agents_gone() if mode in DIRECT_MODES else 0
    turn_errors = Counter(error for answer in stats.values() for error in answer["errors"].values())
    latencies = [value for answer in stats.values() for value in answer["latencies_ms"]]
    late = sum(answer["late_turns"] for answer in stats.values())
    agent_notes = [note for answer in stats.values() for note in answer.get("requests", ())]
    records: list[tuple[int, ...]] = []
    if stages_dir is not None and mode in SERVICE_MODES:
        time.sleep(0.6)  # the workers write their records every half second
        records = stages.read(stages_dir, mode, start_ns, end_ns, clear=True)
        if keep_stage_records:
            import json

            (stages_dir / f"raw-{phase}.json").write_text(
                json.dumps(
                    {
                        "records": records,
                        "agents": agent_notes,
                        "turns": {
                            str(k): v
                            for answer in stats.values()
                            for k, v in answer.get("turns_of", {}).items()
                        },
                    }
                )
            )
    return {
        "stage_records": records,
        # Agents each worker process served in this phase (a kept-alive connection stays on one worker).
        "agents_by_worker": stages.agents_by_worker(
            records, [note[0] for note in agent_notes], [note[2] for note in agent_notes]
        ),
        "agent_requests": agent_notes,
        "turns_by_agent": [n for answer in stats.values() for n in answer.get("turns_by_agent", ())],
        "latencies_ms": latencies,
        "late_turns": late,
        "agents_connected": ready,
        "agents_completed": ready - turn_errors.total(),
        "connect_failures": connect_errors.total(),
        "turn_failures": turn_errors.total(),
        "errors": connect_errors + turn_errors,
        "leftover_agent_connections": leftover,
        "service_cpu_s": service_cpu,
        "postgres_cpu_s": postgres_cpu,
        "backends_cpu_s": backends_cpu,
        "machine_cpu_s": machine_cpu,
        "wal": [after - before for before, after in zip(wal_before, wal_after, strict=True)],
        "database": [after - before for before, after in zip(database_before, database_after, strict=True)],
        "agents_cpu_s": sum(answer["cpu_s"] for answer in stats.values()),
        "all_turns": len(latencies) + late,
        # The connections this mode uses: the service's pool, or the agents' own.
        **connections,
        "database_connections_max": database_connections,
    }


def _setup_store(database: str) -> None:
    """The store's tables, created once for every in-process agent (``setup()`` is no per-agent work)."""
    from langgraph.store.postgres.aio import AsyncPostgresStore

    async def setup() -> None:
        async with AsyncPostgresStore.from_conn_string(database) as store:
            await store.setup()

    asyncio.run(setup())


def _warm_service(url: str, agents: int = 8, turns: int = 5) -> None:
    """A few turns through the service from several clients, so that every worker process has served
    before the first phase (a fresh worker's first requests are slower)."""
    from benchmarks._common import chat_graph, thread_config, user_input
    from reducing_saver.client import RemoteReducingSaver

    async def agent(number: int) -> None:
        async with await RemoteReducingSaver.aopen(url) as saver:
            graph = chat_graph(saver)
            for turn in range(turns):
                await graph.ainvoke(user_input(turn), thread_config(f"tp-service-warm-up-{number}"))

    async def warm() -> None:
        await asyncio.gather(*(agent(number) for number in range(agents)))

    asyncio.run(warm())


def _describe(level: dict[str, Any]) -> str:
    agents, processes = level["agents"], level["processes"]
    return f"{agents:>3} agents" + (f" in {processes} processes" if processes != agents else "")


def _failures(figures: dict[str, Any]) -> str:
    if not figures["errors"]:
        return ""
    errors = "; ".join(f"{count} x {error}" for error, count in figures["errors"].items())
    return f" [failed over the rounds: {errors}]"


#: Whether phases keep their raw stage records (``run(keep_stage_records=...)``).
KEEP_STAGE_RECORDS = [False]
#: Interleaved levels of more agents than this skip the direct modes (``run(direct_max_agents=...)``).
DIRECT_MAX_AGENTS = [0]


def run(
    service_url: str,
    service_pid: int,
    server: str,
    database: str,
    *,
    levels: list[tuple[int, int]],
    duration: float,
    rounds: int,
    turns_per_thread: int,
    window: int,
    stock: tuple[str, int] | None = None,
    variants: dict[str, tuple[str, int]] | None = None,
    stages_dir: Path | None = None,
    keep_stage_records: bool = False,
    direct_max_agents: int = 0,
    conditions: tuple[str, ...] = ("quiet",),
    modes: tuple[str, ...] = MODES,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every level, each mode in turn; ``stock``: ``(url, pid)`` of the stock-saver service, run as one
    more mode (``stock_service``), the floor under the service's; ``stages_dir``: where the services'
    workers write their stage records (``benchmarks.stages``), else none are read; ``conditions``:
    ``quiet``, and ``contended`` (each level again with a :class:`Neighbour` running)."""
    results = []
    started = time.monotonic()
    KEEP_STAGE_RECORDS[0] = keep_stage_records
    DIRECT_MAX_AGENTS[0] = direct_max_agents
    database_name = database.rsplit("/", 1)[1]
    _setup_store(database)
    services = {"service": (service_url, service_pid)}
    if stock is not None:
        services["stock_service"] = stock
    services.update(variants or {})
    modes = tuple(mode for mode in MODES if mode in modes and (mode in DIRECT_MODES or mode in services))
    for url, _ in services.values():
        _warm_service(url)
    agents: Agents | None = None
    with ConnectionSampler(server, database_name) as sampler:
        monitor = Monitor(server, database_name, sampler)
        try:
            if len(levels) > 1 and len({processes for _, processes in levels}) == 1:
                # One set of processes holds the largest level; the smaller ones use the first agents of each.
                processes = levels[0][1]
                agents = Agents(
                    processes,
                    max(count for count, _ in levels) // processes,
                    turns_per_thread,
                    window,
                    stages_dir is not None,
                )
                # A short phase of every mode first, not counted: the run's first phase found colder caches
                # (PostgreSQL's, the agents' and the services' first turns of the run) than the others.
                for mode in modes:
                    if (
                        mode not in DIRECT_MODES
                        or not DIRECT_MAX_AGENTS[0]
                        or levels[0][0] <= DIRECT_MAX_AGENTS[0]
                    ):
                        _run_phase(
                            agents,
                            levels[0],
                            mode,
                            services,
                            database,
                            monitor,
                            -1,
                            min(duration, 3.0),
                            stages_dir,
                            "warm-up",
                            None,
                        )
                for condition in conditions:
                    with Neighbour() if condition == "contended" else nullcontext() as neighbour:
                        done = _interleaved(
                            agents,
                            levels,
                            services,
                            database,
                            monitor,
                            modes=modes,
                            duration=duration,
                            rounds=rounds,
                            stages_dir=stages_dir,
                            condition=condition,
                            neighbour=neighbour,
                        )
                    for level in done:
                        _log_level(level, modes, log, started)
                    results += done
                levels = []
            for count, processes in levels:
                per_process = count // processes
                if agents is None or agents.per_process != per_process or len(agents.processes) < processes:
                    if agents is not None:
                        agents.close()
                    # As many processes as the largest level of this layout needs, spawned once.
                    spawn = max(p for n, p in levels if n // p == per_process)
                    agents = Agents(spawn, per_process, turns_per_thread, window, stages_dir is not None)
                for condition in conditions:
                    with Neighbour() if condition == "contended" else nullcontext() as neighbour:
                        level = _level(
                            agents,
                            (count, processes),
                            services,
                            database,
                            monitor,
                            modes=modes,
                            duration=duration,
                            rounds=rounds,
                            stages_dir=stages_dir,
                            condition=condition,
                            neighbour=neighbour,
                        )
                    results.append(level)
                    _log_level(level, modes, log, started)
        finally:
            if agents is not None:
                agents.close()
            monitor.conn.close()
    return {
        "duration_s_per_phase": duration,
        "rounds": rounds,
        "turns_per_thread": turns_per_thread,
        "window": window,
        "modes": list(modes),
        "conditions": list(conditions),
        "levels": results,
        "growth": growth(results, modes),
    }


def _log_level(
    level: dict[str, Any], modes: tuple[str, ...], log: Callable[[str], None], started: float
) -> None:
    cells = ", ".join(
        f"{mode} {level[mode]['turns_per_s']:.1f} turns/s p95 {level[mode]['p95_ms']:.0f} ms "
        f"({level[mode]['connections_max']} conns, {level[mode]['agents_completed']} agents){_failures(level[mode])}"
        for mode in modes
        if mode in level
    )
    log(
        f"  throughput {_describe(level)}, {level['condition']}: {cells} [{time.monotonic() - started:.0f} s]"
    )


def growth(levels: list[dict[str, Any]], modes: tuple[str, ...]) -> list[dict[str, Any]]:
    """For each condition, from its smallest level of several agents per process to its largest: turns/s
    and p95 at the largest over the smallest, per mode."""
    out = []
    for condition in dict.fromkeys(level["condition"] for level in levels):
        many = [
            level for level in levels if level["condition"] == condition and level["agents_per_process"] > 1
        ]
        if len(many) < 2:
            continue
        low, high = many[0], many[-1]
        out.append(
            {
                "condition": condition,
                "from_agents": low["agents"],
                "to_agents": high["agents"],
                **{
                    mode: {
                        "turns_per_s": ratio(high[mode]["turns_per_s"], low[mode]["turns_per_s"]),
                        "p95": ratio(high[mode]["p95_ms"], low[mode]["p95_ms"]),
                    }
                    for mode in modes
                    if mode in low and mode in high and low[mode]["turns"] and high[mode]["turns"]
                },
            }
        )
    return out


def _us_per(seconds: float, turns: int) -> float:
    """Microseconds per turn (0.0 when no turn counted)."""
    return round(seconds * 1e6 / turns, 1) if turns else 0.0


def _spread(values: list[int]) -> dict[str, float]:
    """Turns per agent over a phase: fewest, median, most (an unfair service spreads them)."""
    if not values:
        return {"min": 0, "median": 0, "max": 0}
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def _level(
    agents: Agents,
    level_spec: tuple[int, int],
    services: dict[str, tuple[str, int]],
    database: str,
    monitor: Monitor,
    *,
    modes: tuple[str, ...],
    duration: float,
    rounds: int,
    stages_dir: Path | None = None,
    condition: str = "quiet",
    neighbour: Neighbour | None = None,
) -> dict[str, Any]:
    count, processes = level_spec
    phases: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            phases[mode].append(
                _run_phase(
                    agents,
                    level_spec,
                    mode,
                    services,
                    database,
                    monitor,
                    round_index,
                    duration,
                    stages_dir,
                    condition,
                    neighbour,
                )
            )
    return _figures(level_spec, phases, duration=duration, stages_dir=stages_dir, condition=condition)


def _run_phase(
    agents: Agents,
    level_spec: tuple[int, int],
    mode: str,
    services: dict[str, tuple[str, int]],
    database: str,
    monitor: Monitor,
    round_index: int,
    duration: float,
    stages_dir: Path | None,
    condition: str,
    neighbour: Neighbour | None,
) -> dict[str, Any]:
    count, processes = level_spec
    target, pid = services.get(mode, (with_application_name(database, AGENT_APP), services["service"][1]))
    return _phase(
        agents,
        level_spec,
        mode,
        target,
        f"{count}-{processes}-{condition}-{mode}-{round_index}",
        duration,
        monitor,
        pid,
        stages_dir,
        neighbour,
        KEEP_STAGE_RECORDS[0],
    )


def _interleaved(
    agents: Agents,
    levels: list[tuple[int, int]],
    services: dict[str, tuple[str, int]],
    database: str,
    monitor: Monitor,
    *,
    modes: tuple[str, ...],
    duration: float,
    rounds: int,
    stages_dir: Path | None,
    condition: str,
    neighbour: Neighbour | None,
) -> list[dict[str, Any]]:
    """Levels of the same processes run round by round, each round every level and mode (the order
    reversed every other round), so that a machine whose other load drifts shifts every level alike."""
    phases: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {
        level: {mode: [] for mode in modes} for level in levels
    }
    for round_index in range(rounds):
        forward = round_index % 2 == 0
        for level in levels if forward else levels[::-1]:
            for mode in modes if forward else modes[::-1]:
                if mode in DIRECT_MODES and DIRECT_MAX_AGENTS[0] and level[0] > DIRECT_MAX_AGENTS[0]:
                    continue
                phases[level][mode].append(
                    _run_phase(
                        agents,
                        level,
                        mode,
                        services,
                        database,
                        monitor,
                        round_index,
                        duration,
                        stages_dir,
                        condition,
                        neighbour,
                    )
                )
    return [
        _figures(
            level,
            {mode: runs for mode, runs in phases[level].items() if runs},
            duration=duration,
            stages_dir=stages_dir,
            condition=condition,
        )
        for level in levels
    ]


def _figures(
    level_spec: tuple[int, int],
    phases: dict[str, list[dict[str, Any]]],
    *,
    duration: float,
    stages_dir: Path | None,
    condition: str,
) -> dict[str, Any]:
    count, processes = level_spec
    level: dict[str, Any] = {
        "agents": count,
        "processes": processes,
        "agents_per_process": count // processes,
        "condition": condition,
    }
    for mode, runs in phases.items():
        latencies = [value for run_ in runs for value in run_["latencies_ms"]]
        seconds = duration * len(runs)
        turns = len(latencies)
        figures = (
            summary(latencies) if latencies else {"n": 0, "median_ms": 0.0, "p95_ms": 0.0, "mean_ms": 0.0}
        )
        errors: Counter[str] = Counter()
        for run_ in runs:
            errors += run_["errors"]
        level[mode] = {
            "turns": turns,
            "turns_per_s": round(turns / seconds, 2),
            "median_ms": figures["median_ms"],
            "p95_ms": figures["p95_ms"],
            "p99_ms": round(percentile(latencies, 0.99), 3) if latencies else 0.0,
            "max_ms": round(max(latencies), 3) if latencies else 0.0,
            # Turns per agent in a phase (every round's agents): fewest, median, most.
            "turns_by_agent": _spread([n for r in runs for n in r["turns_by_agent"]]),
            # The agents that ran (and finished) the phase, the smallest of the rounds; turns/s are theirs.
            "agents_connected": min(r["agents_connected"] for r in runs),
            "agents_completed": min(r["agents_completed"] for r in runs),
            "connect_failures": max(r["connect_failures"] for r in runs),
            "turn_failures": max(r["turn_failures"] for r in runs),
            # Every failure of every round, by error: {error: agents}.
            "errors": dict(errors.most_common()),
            "leftover_agent_connections": max(r["leftover_agent_connections"] for r in runs),
            "connections_max": max(r["connections_max"] for r in runs),
            "active_connections_max": max(r["active_connections_max"] for r in runs),
            "connections_mean": round(sum(r["connections_mean"] for r in runs) / len(runs), 1),
            "database_connections_max": max(r["database_connections_max"] for r in runs),
            "turns_per_s_by_round": [round(len(r["latencies_ms"]) / duration, 2) for r in runs],
        }
        if mode in SERVICE_MODES and stages_dir is not None:
            client = {sent: (received, agent) for r in runs for sent, received, agent in r["agent_requests"]}
            level[mode]["stages"] = stages.summarize(
                (rec for r in runs for rec in r["stage_records"]), client
            )
            level[mode]["stages"]["agents_by_worker_by_round"] = [r["agents_by_worker"] for r in runs]
        if mode in SERVICE_MODES:
            cpu = sum(r["service_cpu_s"] for r in runs)
            level[mode]["service_cpu_us_per_turn"] = _us_per(cpu, turns)
            level[mode]["service_cpu_cores"] = round(cpu / seconds, 3)
        # Agents report CPU over every turn they ran; the other readings cover the phase's counted turns.
        all_turns = sum(r["all_turns"] for r in runs)
        level[mode]["agent_cpu_us_per_turn"] = _us_per(sum(r["agents_cpu_s"] for r in runs), all_turns)
        level[mode]["postgres_cpu_us_per_turn"] = _us_per(sum(r["postgres_cpu_s"] for r in runs), turns)
        # Of which this mode's own connections' backends (what a busy shared server cannot blur).
        level[mode]["postgres_backends_cpu_us_per_turn"] = _us_per(
            sum(r["backends_cpu_s"] for r in runs), turns
        )
        level[mode]["machine_cpu_us_per_turn"] = _us_per(sum(r["machine_cpu_s"] for r in runs), turns)
        records, syncs, written = (sum(r["wal"][i] for r in runs) for i in range(3))
        level[mode]["wal_per_turn"] = {
            "records": round(records / turns, 1) if turns else 0.0,
            "syncs": round(syncs / turns, 2) if turns else 0.0,
            "bytes": round(written / turns) if turns else 0,
        }
        level[mode]["database_per_turn"] = {
            name: round(sum(r["database"][i] for r in runs) / turns, 1) if turns else 0.0
            for i, name in enumerate(DATABASE_COUNTERS)
        }
        level[mode]["cpu_us_per_turn"] = round(
            level[mode]["agent_cpu_us_per_turn"]
            + level[mode]["postgres_cpu_us_per_turn"]
            + level[mode].get("service_cpu_us_per_turn", 0.0),
            1,
        )
    service = level["service"]
    level["ratios"] = {}
    for mode in (mode for mode in DIRECT_MODES if mode in level):
        level["ratios"].update(
            {
                f"service_vs_{mode}_turns_per_s": ratio(service["turns_per_s"], level[mode]["turns_per_s"]),
                f"service_vs_{mode}_p95": ratio(service["p95_ms"], level[mode]["p95_ms"]),
                f"service_vs_{mode}_connections_max": ratio(
                    service["connections_max"], level[mode]["connections_max"]
                ),
                f"service_vs_{mode}_machine_cpu_per_turn": ratio(
                    service["machine_cpu_us_per_turn"], level[mode]["machine_cpu_us_per_turn"]
                ),
            }
        )
    for variant in (variant for variant in agent_module.VARIANTS if variant in level):
        b = level[variant]
        level["ratios"].update(
            {
                f"{variant}_vs_service_turns_per_s": ratio(b["turns_per_s"], service["turns_per_s"]),
                f"{variant}_vs_service_p95": ratio(b["p95_ms"], service["p95_ms"]),
                f"{variant}_vs_service_machine_cpu_per_turn": ratio(
                    b["machine_cpu_us_per_turn"], service["machine_cpu_us_per_turn"]
                ),
                f"{variant}_vs_service_service_cpu_per_turn": ratio(
                    b["service_cpu_us_per_turn"], service["service_cpu_us_per_turn"]
                ),
            }
        )
    if "stock_service" in level:
        level["ratios"]["service_vs_stock_service_turns_per_s"] = ratio(
            service["turns_per_s"], level["stock_service"]["turns_per_s"]
        )
    if "stock_service" in level and "inprocess" in level:
        stock, inprocess = level["stock_service"], level["inprocess"]
        level["ratios"].update(
            {
                "stock_service_vs_inprocess_turns_per_s": ratio(
                    stock["turns_per_s"], inprocess["turns_per_s"]
                ),
                "stock_service_vs_inprocess_machine_cpu_per_turn": ratio(
                    stock["machine_cpu_us_per_turn"], inprocess["machine_cpu_us_per_turn"]
                ),
            }
        )
    return level
