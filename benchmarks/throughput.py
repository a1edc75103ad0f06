"""Throughput: N agent processes through one service vs the same agents each on its own AsyncPostgresSaver.

The agent processes are spawned once (as many as the largest count); for each agent count, the first N
of them alternate between the two modes for ``rounds`` rounds of ``duration`` seconds each
(``service``, ``direct``, ``direct``, ``service``, ...), all starting and stopping on the same wall-clock
instants; the others wait, idle. Meanwhile a sampler reads
``pg_stat_activity`` for the benchmark database every 100 ms: connections open and connections active
(running a statement), maxima over the phase. In service phases the service process's CPU time is read
from /proc around the phase, giving its CPU per turn; so is PostgreSQL's (every server process), and each
agent reports its own process CPU, so each mode's CPU per turn is accounted for: agents + service +
PostgreSQL. The whole machine's busy time per turn (/proc/stat) is kept too: it also holds what the
processes' own figures miss (the kernel's work for their sockets, the sampler). On one machine the modes
share its cores, so those sums set the ratio of turns/s.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import psycopg

from benchmarks import agent as agent_module
from benchmarks._common import cpu_seconds, machine_cpu_seconds, postgres_cpu_seconds, ratio, summary

MODES = ("service", "direct")
#: ``application_name`` of the service's connections and of the agents' own (set in their database URLs).
SERVICE_APP = "rs-bench-service"
AGENT_APP = "rs-bench-agent"
CONNECTIONS = """
    SELECT application_name, count(*), count(*) FILTER (WHERE state = 'active')
    FROM pg_stat_activity
    WHERE datname = %s AND backend_type = 'client backend' AND pid <> pg_backend_pid()
    GROUP BY application_name
"""


def wal_counters(server: str) -> tuple[int, int, int]:
    """PostgreSQL's WAL figures since its stats reset: (records, syncs to disk, bytes)."""
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        query = "SELECT wal_records, wal_sync, wal_bytes FROM pg_stat_wal"
        records, syncs, written = conn.execute(query).fetchone()
    return int(records), int(syncs), int(written)


def with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


class ConnectionSampler:
    """Samples the database's connections in a thread of its own, by ``application_name``.

    ``figures(name)`` gives the maxima (and the mean) of the connections whose application is ``name``:
    open, and active (running a statement when sampled); ``figures(None)`` counts every connection.
    """

    def __init__(self, server: str, database_name: str, interval: float = 0.1) -> None:
        self.server, self.database_name, self.interval = server, database_name, interval
        self.samples = 0
        self._open_max: dict[str | None, int] = {}
        self._active_max: dict[str | None, int] = {}
        self._open_sum: dict[str | None, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        with psycopg.connect(f"{self.server}/postgres", autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(CONNECTIONS, (self.database_name,)).fetchall()
                totals = {None: (sum(r[1] for r in rows), sum(r[2] for r in rows))}
                totals.update({name: (opened, active) for name, opened, active in rows})
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

    def figures(self, name: str | None) -> dict[str, float]:
        return {
            "connections_max": self._open_max.get(name, 0),
            "active_connections_max": self._active_max.get(name, 0),
            "connections_mean": round(self._open_sum.get(name, 0) / self.samples, 1) if self.samples else 0,
        }


class Agents:
    """N spawned agent processes and their queues."""

    def __init__(self, count: int, turns_per_thread: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(
                target=agent_module.main, args=(index, self.commands[index], self.results, turns_per_thread),
                daemon=True,
            )
            for index in range(count)
        ]
        for process in self.processes:
            process.start()

    def broadcast(self, command: tuple, count: int | None = None) -> None:
        for commands in self.commands[:count]:
            commands.put(command)

    def collect(self, kind: str, timeout: float, count: int) -> dict[int, Any]:
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < count:
            try:
                message = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [p.pid for p in self.processes if not p.is_alive()]
                raise RuntimeError(
                    f"{count - len(answers)} agents did not answer {kind!r} in {timeout}s "
                    f"(exited: {dead})"
                ) from None
            if message[0] == "error":
                raise RuntimeError(f"agent {message[1]} failed:\n{message[2]}")
            if message[0] != kind:
                raise RuntimeError(f"expected {kind!r} from agents, got {message!r}")
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


def _phase(agents: Agents, count: int, mode: str, target: str, phase: str, duration: float, server: str,
           database_name: str, service_pid: int) -> dict[str, Any]:
    agents.broadcast(("prepare", mode, target, phase), count)
    agents.collect("ready", timeout=120 + 2 * count, count=count)
    start_at = time.time() + 0.3
    end_at = start_at + duration
    with ConnectionSampler(server, database_name) as sampler:
        agents.broadcast(("go", start_at, end_at), count)
        time.sleep(max(0.0, start_at - time.time()))
        wal_before = wal_counters(server)
        before = cpu_seconds(service_pid), postgres_cpu_seconds(), machine_cpu_seconds()
        time.sleep(max(0.0, end_at - time.time()))
        after = cpu_seconds(service_pid), postgres_cpu_seconds(), machine_cpu_seconds()
        wal_after = wal_counters(server)
        (service_cpu, postgres_cpu, machine_cpu) = (b - a for a, b in zip(before, after, strict=True))
        stats = agents.collect("done", timeout=duration + 120, count=count)
    latencies = [value for answer in stats.values() for value in answer["latencies_ms"]]
    return {
        "latencies_ms": latencies,
        "late_turns": sum(answer["late_turns"] for answer in stats.values()),
        "service_cpu_s": service_cpu,
        "postgres_cpu_s": postgres_cpu,
        "machine_cpu_s": machine_cpu,
        "wal": [after - before for before, after in zip(wal_before, wal_after, strict=True)],
        "agents_cpu_s": sum(answer["cpu_s"] for answer in stats.values()),
        "all_turns": len(latencies) + sum(answer["late_turns"] for answer in stats.values()),
        # The connections this mode uses: the service's pool, or the agents' own.
        **sampler.figures(SERVICE_APP if mode == "service" else AGENT_APP),
        "database_connections_max": sampler.figures(None)["connections_max"],
    }


def run(service_url: str, service_pid: int, server: str, database: str, *, agent_counts: list[int],
        duration: float, rounds: int, turns_per_thread: int,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    levels = []
    started = time.monotonic()
    agents = Agents(max(agent_counts), turns_per_thread)
    try:
        for count in agent_counts:
            levels.append(_level(agents, count, service_url, service_pid, server, database, duration=duration,
                                 rounds=rounds))
            log(
                f"  throughput {count:>2} agents: service {levels[-1]['service']['turns_per_s']:.1f} turns/s "
                f"({levels[-1]['service']['connections_max']} conns), direct "
                f"{levels[-1]['direct']['turns_per_s']:.1f} turns/s ({levels[-1]['direct']['connections_max']} "
                f"conns) [{time.monotonic() - started:.0f} s]"
            )
    finally:
        agents.close()
    return {
        "duration_s_per_phase": duration,
        "rounds": rounds,
        "turns_per_thread": turns_per_thread,
        "levels": levels,
    }


def _us_per(seconds: float, turns: int) -> float:
    """Microseconds per turn (0.0 when no turn counted)."""
    return round(seconds * 1e6 / turns, 1) if turns else 0.0


def _level(agents: Agents, count: int, service_url: str, service_pid: int, server: str, database: str, *,
           duration: float, rounds: int) -> dict[str, Any]:
    database_name = database.rsplit("/", 1)[1]
    phases: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for round_index in range(rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            target = service_url if mode == "service" else with_application_name(database, AGENT_APP)
            phases[mode].append(
                _phase(agents, count, mode, target, f"{count}-{mode}-{round_index}", duration, server,
                       database_name, service_pid)
            )
    level: dict[str, Any] = {"agents": count}
    for mode, runs in phases.items():
        latencies = [value for run_ in runs for value in run_["latencies_ms"]]
        seconds = duration * len(runs)
        turns = len(latencies)
        figures = summary(latencies) if latencies else {"n": 0, "median_ms": 0.0, "p95_ms": 0.0, "mean_ms": 0.0}
        level[mode] = {
            "turns": turns,
            "turns_per_s": round(turns / seconds, 2),
            "median_ms": figures["median_ms"],
            "p95_ms": figures["p95_ms"],
            "connections_max": max(r["connections_max"] for r in runs),
            "active_connections_max": max(r["active_connections_max"] for r in runs),
            "connections_mean": round(sum(r["connections_mean"] for r in runs) / len(runs), 1),
            "database_connections_max": max(r["database_connections_max"] for r in runs),
            "turns_per_s_by_round": [round(len(r["latencies_ms"]) / duration, 2) for r in runs],
        }
        if mode == "service":
            cpu = sum(r["service_cpu_s"] for r in runs)
            level[mode]["service_cpu_us_per_turn"] = _us_per(cpu, turns)
            level[mode]["service_cpu_cores"] = round(cpu / seconds, 3)
        # Agents report CPU over every turn they ran; the other readings cover the phase's counted turns.
        all_turns = sum(r["all_turns"] for r in runs)
        level[mode]["agent_cpu_us_per_turn"] = _us_per(sum(r["agents_cpu_s"] for r in runs), all_turns)
        level[mode]["postgres_cpu_us_per_turn"] = _us_per(sum(r["postgres_cpu_s"] for r in runs), turns)
        level[mode]["machine_cpu_us_per_turn"] = _us_per(sum(r["machine_cpu_s"] for r in runs), turns)
        records, syncs, written = (sum(r["wal"][i] for r in runs) for i in range(3))
        level[mode]["wal_per_turn"] = {
            "records": round(records / turns, 1) if turns else 0.0,
            "syncs": round(syncs / turns, 2) if turns else 0.0,
            "bytes": round(written / turns) if turns else 0,
        }
        level[mode]["cpu_us_per_turn"] = round(
            level[mode]["agent_cpu_us_per_turn"]
            + level[mode]["postgres_cpu_us_per_turn"]
            + level[mode].get("service_cpu_us_per_turn", 0.0),
            1,
        )
    level["ratios"] = {
        "service_vs_direct_turns_per_s": ratio(level["service"]["turns_per_s"], level["direct"]["turns_per_s"]),
        "service_vs_direct_p95": ratio(level["service"]["p95_ms"], level["direct"]["p95_ms"]),
        "service_vs_direct_connections_max": ratio(
            level["service"]["connections_max"], level["direct"]["connections_max"]
        ),
    }
    return level
