"""Per-turn `graph.invoke` latency: through the service vs in-process ReducingSaver(PostgresSaver).

    .venv/bin/python -m benchmarks.turn_latency --database postgresql://postgres@127.0.0.1:5432/postgres

Starts `reducing-saver serve` on the given database, runs the same chat graph for --turns turns on
fresh threads through RemoteReducingSaver, in-process ReducingSaver and plain PostgresSaver, interleaved
so all see the same machine load, and prints medians, p95 and the ratio remote / in-process. It is the
latency section of the full suite (`python -m benchmarks`) on its own; the suite also creates and drops
a database of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from benchmarks.latency import figures, run_async, run_sync


def report(name: str, samples: dict[str, list[tuple[float, float]]]) -> None:
    remote, local, plain = (figures(samples[kind]) for kind in ("remote", "inprocess", "plain"))
    print(
        f"{name:5} remote median {remote['median_ms']:6.2f} ms p95 {remote['p95_ms']:6.2f} | "
        f"in-process median {local['median_ms']:6.2f} ms p95 {local['p95_ms']:6.2f} | "
        f"plain median {plain['median_ms']:6.2f} ms | "
        f"ratio remote/in-process {remote['median_ms'] / local['median_ms']:4.2f}x | agent CPU per turn "
        f"{remote['agent_cpu_ms_median']:.2f} vs {local['agent_cpu_ms_median']:.2f} ms"
    )


def main() -> None:
    from tests.support.server import run_service

    parser = argparse.ArgumentParser()
    parser.add_argument("--database", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1, help="the service's worker processes")
    parser.add_argument("--pool-size", type=int, default=2, help="the service's connections per worker")
    args = parser.parse_args()
    options = {"turns": args.turns, "rounds": args.rounds, "window": args.window}
    with tempfile.TemporaryDirectory() as folder, run_service(
        Path(folder), "--database", args.database, "--max-messages", str(args.window),
        "--workers", str(args.workers), "--pool-size", str(args.pool_size),
    ) as service:
        samples = run_sync(service.url, args.database, **options)
        report("sync", samples)
        samples = asyncio.run(run_async(service.url, args.database, **options))
        report("async", samples)


if __name__ == "__main__":
    main()
