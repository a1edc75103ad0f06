"""Group commit's ceiling: what the machine spends a put when puts share their transaction.

``python -m benchmarks.group_commit [--puts 3000] [--group 4] [--rounds 3]``: the puts of recorded chat
turns (``service_cost.record_turns``) are written to a scratch database through a stock
``PostgresSaver`` on one connection, thread after thread, three ways, interleaved round by round:

- ``each``: one transaction a put, as the service writes them (PostgresSaver's pipeline, one sync);
- ``shared_commit``: ``group`` puts a transaction (``conn.transaction()`` around them), each put still
  its own pipeline and round trip: what a shared commit alone saves;
- ``shared_pipeline``: ``group`` puts in one pipeline and one transaction, sent together and synced
  once (PostgresSaver on a pipeline syncs after each put: here it does not): a shared commit and one
  round trip a group, the most a writer batching puts across requests could save on these statements.

For each: this process's CPU a put and PostgreSQL's (its every process, from ``/proc``; their sum is what
the comparison uses), the whole machine's (``/proc/stat``, other work included), the wall time, and the
WAL records and syncs a put (``pg_stat_wal``); the median of the rounds. What group commit could save a
turn is the difference a put times the service's transactions a turn (the throughput section's), for
groups of ``group`` puts: a ceiling, as a service batching puts across requests would also pay to
gather each group and to hold its first put until the group commits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import psycopg
from langgraph.checkpoint.postgres import PostgresSaver
from psycopg.rows import dict_row

from benchmarks._common import DEFAULT_SERVER, machine_cpu_seconds, postgres_cpu_seconds, scratch_database
from benchmarks.service_cost import _on_thread, record_turns

MODES = ("each", "shared_commit", "shared_pipeline")


def _wal(conn: psycopg.Connection) -> tuple[int, int]:
    """The cluster's WAL records and syncs so far. A backend reports its figures when it is next idle, at
    most once a second unless told to: this connection, the writer, is told to first."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute("SELECT wal_records, wal_sync FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row["wal_records"]), int(row["wal_sync"])


def _puts(recorded: list[tuple[str, tuple]], count: int, prefix: str) -> list[tuple]:
    """``count`` puts of the recorded turns, conversation after conversation, each on a thread of its own."""
    turn = [args for kind, args in recorded if kind == "put"]
    return [_on_thread(turn[index % len(turn)], f"{prefix}-{index // len(turn)}") for index in range(count)]


class _UnsyncedSaver(PostgresSaver):
    """PostgresSaver on a pipeline it does not sync after each put: the puts of a group reach PostgreSQL
    together, and their results come back when the pipeline ends."""

    @contextmanager
    def _cursor(self, *, pipeline: bool = False) -> Iterator[Any]:
        with self.lock, self.conn.cursor(binary=True, row_factory=dict_row) as cur:  # type: ignore[union-attr]
            yield cur


def _write(conn: psycopg.Connection, mode: str, puts: list[tuple], group: int) -> None:
    if mode == "each":
        saver = PostgresSaver(conn)
        for args in puts:
            saver.put(*args)
        return
    for start in range(0, len(puts), group):
        if mode == "shared_commit":
            with conn.transaction():
                saver = PostgresSaver(conn)
                for args in puts[start : start + group]:
                    saver.put(*args)
        else:
            with conn.pipeline() as pipe, conn.transaction():
                saver = _UnsyncedSaver(conn, pipe)
                for args in puts[start : start + group]:
                    saver.put(*args)


def _measure(conn: psycopg.Connection, write: Callable[[], None], puts: int) -> dict[str, float]:
    """What writing ``puts`` puts took, a put."""
    wal_before = _wal(conn)
    machine, postgres, own = machine_cpu_seconds(), postgres_cpu_seconds(), time.process_time()
    started = time.perf_counter()
    write()
    elapsed = time.perf_counter() - started
    own = time.process_time() - own
    postgres, machine = postgres_cpu_seconds() - postgres, machine_cpu_seconds() - machine
    wal_after = _wal(conn)
    return {
        "client_and_postgres_us": (own + postgres) / puts * 1e6,
        "client_us": own / puts * 1e6,
        "postgres_us": postgres / puts * 1e6,
        "machine_us": machine / puts * 1e6,
        "wall_us": elapsed / puts * 1e6,
        "wal_records": (wal_after[0] - wal_before[0]) / puts,
        "wal_syncs": (wal_after[1] - wal_before[1]) / puts,
    }


def run(database: str, *, puts: int, group: int, rounds: int) -> dict[str, Any]:
    """The three modes, ``rounds`` times each, on ``database`` (its checkpoint tables set up here)."""
    recorded = record_turns(12)
    by_mode: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with psycopg.connect(database, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        PostgresSaver(conn).setup()
        _write(conn, "each", _puts(recorded, min(puts, 200), "warm"), group)  # plans prepared, caches warm
        for number in range(rounds):
            order = MODES[number % len(MODES) :] + MODES[: number % len(MODES)]
            for mode in order:
                batch = _puts(recorded, puts, f"{mode}-{number}")
                by_mode[mode].append(_measure(conn, partial(_write, conn, mode, batch, group), puts))
        stored = {
            mode: conn.execute(
                "SELECT count(*) AS n FROM checkpoints WHERE thread_id LIKE %s", (f"{mode}-%",)
            ).fetchone()["n"]
            for mode in MODES
        }
    medians = {
        mode: {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}
        for mode, runs in by_mode.items()
    }
    each = medians["each"]["client_and_postgres_us"]
    return {
        "puts": puts,
        "group": group,
        "rounds": rounds,
        "checkpoints_stored": stored,
        "medians": medians,
        "runs": by_mode,
        "saved_us_a_put": {
            mode: round(each - medians[mode]["client_and_postgres_us"], 3) for mode in MODES if mode != "each"
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.group_commit", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--puts", type=int, default=3000, help="puts a mode writes each round (%(default)s)")
    parser.add_argument("--group", type=int, default=4, help="puts a shared transaction holds (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each writing every mode (%(default)s)")
    parser.add_argument(
        "--server", default=DEFAULT_SERVER, help="PostgreSQL server of the scratch database (%(default)s)"
    )
    parser.add_argument("--database", help="an empty database's URL to write to, instead of a scratch one")
    args = parser.parse_args(argv)
    if args.puts < 1 or args.group < 1 or args.rounds < 1:
        parser.error("--puts, --group and --rounds must be at least 1")
    with nullcontext(args.database) if args.database else scratch_database(args.server) as database:
        result = run(database, puts=args.puts, group=args.group, rounds=args.rounds)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
