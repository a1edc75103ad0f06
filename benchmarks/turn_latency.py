"""Per-turn `graph.invoke` latency: through the service vs the same features in-process.

    .venv/bin/python -m benchmarks.turn_latency [--database URL]

Starts `reducing-saver serve` on the given database (default: a database of its own on the suite's
PostgreSQL server, dropped afterwards), runs the same chat graph for --turns turns on
fresh threads through RemoteReducingSaver, in-process ReducingSaver(PostgresSaver) with an on_prune hook
writing pruned messages into a PostgresStore (async: AsyncPostgresSaver, AsyncPostgresStore) and plain
PostgresSaver, interleaved so all see the same machine load, and prints medians, p95 and the ratios
remote / in-process and remote / plain. It is the latency section of the full suite (`python -m
benchmarks`) on its own, without the stock-saver service (`benchmarks/stock_service.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from contextlib import nullcontext
from pathlib import Path

from benchmarks._common import scratch_database
from benchmarks.latency import figures, run_async, run_sync


def report(name: str, samples: dict[str, list[tuple[float, float]]]) -> None:
    remote, local, plain = (figures(samples[kind]) for kind in ("remote", "inprocess", "plain"))
    print(
        f"{name:5} remote median {remote['median_ms']:6.2f} ms p95 {remote['p95_ms']:6.2f} | "
        f"in-process + on_prune → store median {local['median_ms']:6.2f} ms p95 {local['p95_ms']:6.2f} | "
        f"plain median {plain['median_ms']:6.2f} ms p95 {plain['p95_ms']:6.2f} | "
        f"remote/in-process {remote['median_ms'] / local['median_ms']:4.2f}x "
        f"(p95 {remote['p95_ms'] / local['p95_ms']:4.2f}x), remote/plain "
        f"{remote['median_ms'] / plain['median_ms']:4.2f}x | agent CPU per turn "
        f"{remote['agent_cpu_ms_median']:.2f} vs {local['agent_cpu_ms_median']:.2f} ms"
    )


def main() -> None:
    from tests.support.server import run_service

    parser = argparse.ArgumentParser()
    parser.add_argument("--database", help="PostgreSQL URL (default: a scratch database, dropped afterwards)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1, help="the service's worker processes")
    parser.add_argument("--pool-size", type=int, default=2, help="the service's connections per worker")
    args = parser.parse_args()
    options = {"turns": args.turns, "rounds": args.rounds, "window": args.window}
    with (
        nullcontext(args.database) if args.database else scratch_database() as database,
        tempfile.TemporaryDirectory() as folder,
        run_service(
            Path(folder),
            "--database",
            database,
            "--max-messages",
            str(args.window),
            "--workers",
            str(args.workers),
            "--pool-size",
            str(args.pool_size),
        ) as service,
    ):
        samples = run_sync(service.url, database, **options)
        report("sync", samples)
        samples = asyncio.run(run_async(service.url, database, **options))
        report("async", samples)


if __name__ == "__main__":
    main()
