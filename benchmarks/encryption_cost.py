"""The cost of encryption at rest: per-turn time and service CPU, ``--encryption required`` vs ``off``.

    .venv/bin/python -m benchmarks.encryption_cost [--turns 20] [--rounds 6] [--backend postgres|sqlite|memory]

Starts two ``reducing-saver serve`` processes, one per mode, each on a database of its own (``postgres``,
the default: a scratch PostgreSQL database, dropped afterwards; ``sqlite``: a file in a temporary folder;
``memory``: ``memory://``, the cost without a database's own work), with the same settings. Each round
runs the suite's chat graph (``StateGraph(MessagesState)``, ~400-character messages) for ``--turns``
turns on a fresh thread through
``RemoteReducingSaver``, first against one service then the other (the order alternates per round), so
both see the same machine load. Per turn: the wall time of ``graph.invoke`` and the service process's CPU
time (``/proc/<pid>/task/*/schedstat``). Prints the medians and the ratios required / off, and the median
of each round's own ratio (the two modes' medians of one round, taken moments apart: steadier when the
machine's speed drifts).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from benchmarks._common import chat_graph, run_time_seconds, scratch_database, thread_config, user_input
from reducing_saver.client import RemoteReducingSaver

MODES = ("off", "required")


def _round(url: str, pid: int, turns: int) -> tuple[list[float], list[float]]:
    """Per-turn wall and service CPU milliseconds of one fresh thread."""
    walls, cpus = [], []
    with RemoteReducingSaver(url) as saver:
        graph = chat_graph(saver)
        config = thread_config(f"enc-{uuid.uuid4().hex[:8]}")
        for turn in range(turns):
            cpu, start = run_time_seconds(pid), time.perf_counter()
            graph.invoke(user_input(turn), config)
            walls.append((time.perf_counter() - start) * 1000)
            cpus.append((run_time_seconds(pid) - cpu) * 1000)
    return walls, cpus


def main() -> None:
    from tests.support.encryption import new_key, ring_json
    from tests.support.server import run_service

    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--backend", choices=("postgres", "sqlite", "memory"), default="postgres")
    args = parser.parse_args()
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        services = {}
        for mode in MODES:
            database = {
                "postgres": lambda: stack.enter_context(scratch_database()),
                "sqlite": lambda: f"sqlite:///{folder / mode}.db",
                "memory": lambda: "memory://",
            }[args.backend]()
            env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())} if mode != "off" else {}
            services[mode] = stack.enter_context(
                run_service(
                    folder, "--database", database, "--max-messages", str(args.window), "--encryption", mode,
                    env=env,
                )
            )
        for mode in MODES:  # warm-up: imports, connections, prepared paths
            _round(services[mode].url, services[mode].process.pid, 3)
        samples: dict[str, tuple[list[float], list[float]]] = {mode: ([], []) for mode in MODES}
        paired: tuple[list[float], list[float]] = ([], [])  # each round's ratio of medians, required / off
        for index in range(args.rounds):
            this_round = {}
            for mode in MODES if index % 2 == 0 else reversed(MODES):
                walls, cpus = _round(services[mode].url, services[mode].process.pid, args.turns)
                samples[mode][0].extend(walls)
                samples[mode][1].extend(cpus)
                this_round[mode] = (statistics.median(walls), statistics.median(cpus))
            for kind in (0, 1):
                paired[kind].append(this_round["required"][kind] / this_round["off"][kind])
    wall = {mode: statistics.median(samples[mode][0]) for mode in MODES}
    cpu = {mode: statistics.median(samples[mode][1]) for mode in MODES}
    print(
        f"encryption on {args.backend} ({args.rounds} rounds x {args.turns} turns, interleaved): per-turn median "
        f"{wall['required']:.2f} ms required vs {wall['off']:.2f} ms off ({wall['required'] / wall['off']:.3f}x); "
        f"service CPU per turn {cpu['required']:.2f} vs {cpu['off']:.2f} ms ({cpu['required'] / cpu['off']:.3f}x); "
        f"median of the rounds' ratios: time {statistics.median(paired[0]):.3f}x, "
        f"CPU {statistics.median(paired[1]):.3f}x"
    )

if __name__ == "__main__":
    main()
