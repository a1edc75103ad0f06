"""The cost of encryption at rest: per-turn time and service CPU, ``--encryption required`` vs ``off``.

    .venv/bin/python -m benchmarks.encryption_cost [--rounds 60] [--turns 4] [--backend postgres|sqlite|memory]

Starts two ``reducing-saver serve`` processes, one per mode, each on a database of its own (``postgres``,
the default: a scratch PostgreSQL database, dropped afterwards; ``sqlite``: a file in a temporary folder;
``memory``: ``memory://``, the cost without a database's own work), with the same settings. Against each,
the suite's chat graph (``StateGraph(MessagesState)``, ~400-character messages) runs one thread through
``RemoteReducingSaver``, first ``--window`` turns to fill the window (from then on every turn cuts
messages, which go through the outbox into the store), then ``--rounds`` rounds of ``--turns`` turns,
one service then the other (the order alternates per round). Per turn: the wall time of
``graph.invoke`` and the service process's CPU time (``/proc/<pid>/task/*/schedstat``).

Prints the medians and their ratios required / off, and the median of the rounds' own ratios. On a
shared machine the speed drifts by more than the difference measured here within seconds; short
rounds, taken moments apart, see the same machine, so the median of their ratios is the figure to go
by (two services in the same mode differ by about 3% this way).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import chat_graph, run_time_seconds, scratch_database, thread_config, user_input
from reducing_saver.client import RemoteReducingSaver

MODES = ("off", "required")


@dataclass
class _Agent:
    """One chat thread against one service, and its per-turn samples."""

    saver: RemoteReducingSaver
    pid: int
    graph: Any = None
    config: Any = None
    turn: int = 0
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.graph = chat_graph(self.saver)
        self.config = thread_config(f"enc-{uuid.uuid4().hex[:8]}")

    def run(self, turns: int) -> tuple[float, float]:
        """``turns`` turns; their median wall and CPU milliseconds (also kept in ``walls``/``cpus``)."""
        walls, cpus = [], []
        for _ in range(turns):
            cpu, start = run_time_seconds(self.pid), time.perf_counter()
            self.graph.invoke(user_input(self.turn), self.config)
            walls.append((time.perf_counter() - start) * 1000)
            cpus.append((run_time_seconds(self.pid) - cpu) * 1000)
            self.turn += 1
        self.walls += walls
        self.cpus += cpus
        return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    from tests.support.encryption import new_key, ring_json
    from tests.support.server import run_service

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--turns", type=int, default=4, help="turns per round")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--backend", choices=("postgres", "sqlite", "memory"), default="postgres")
    args = parser.parse_args()
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        agents = {}
        for mode in MODES:
            if args.backend == "postgres":
                database = stack.enter_context(scratch_database())
            elif args.backend == "sqlite":
                database = f"sqlite:///{folder / mode}.db"
            else:
                database = "memory://"
            env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())} if mode != "off" else {}
            service = stack.enter_context(
                run_service(
                    folder,
                    "--database",
                    database,
                    "--max-messages",
                    str(args.window),
                    "--encryption",
                    mode,
                    env=env,
                )
            )
            saver = stack.enter_context(RemoteReducingSaver(service.url))
            agents[mode] = _Agent(saver, service.process.pid)
        for agent in agents.values():  # fill the window: every turn after this one cuts messages
            agent.run(args.window)
            agent.walls.clear()
            agent.cpus.clear()
        ratios: tuple[list[float], list[float]] = ([], [])  # each round's required / off
        for index in range(args.rounds):
            medians = {
                mode: agents[mode].run(args.turns) for mode in (MODES if index % 2 == 0 else MODES[::-1])
            }
            for kind in (0, 1):
                ratios[kind].append(medians["required"][kind] / medians["off"][kind])
    wall = {mode: statistics.median(agents[mode].walls) for mode in MODES}
    cpu = {mode: statistics.median(agents[mode].cpus) for mode in MODES}
    print(
        f"encryption on {args.backend} ({args.rounds} rounds x {args.turns} turns, interleaved): per-turn median "
        f"{wall['required']:.2f} ms required vs {wall['off']:.2f} ms off ({wall['required'] / wall['off']:.3f}x); "
        f"service CPU per turn {cpu['required']:.2f} vs {cpu['off']:.2f} ms ({cpu['required'] / cpu['off']:.3f}x); "
        f"median of the rounds' ratios: time {statistics.median(ratios[0]):.3f}x, "
        f"CPU {statistics.median(ratios[1]):.3f}x"
    )


if __name__ == "__main__":
    main()
