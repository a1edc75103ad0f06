"""The service under uvicorn and under granian, side by side: per-turn latency and the server's CPU.

    .venv/bin/pip install granian   # or the bench extra
    .venv/bin/python -m benchmarks.asgi_servers [--rounds 15] [--granian st mt mt2]

Creates a PostgreSQL database of its own (dropped afterwards) and starts, at once and on that database,
the real ``reducing-saver serve`` (uvicorn, one process) and the same app under granian, one server per
granian variant (``GRANIAN_VARIANTS``), each built by ``reducing_saver.service.http.app:app_from_env`` from the
same settings (``--max-messages 20 --pool-size 2``), its lifespan run before ``/readyz`` answers 200.

Then the suite's chat graph runs through ``RemoteReducingSaver`` to every server, sync (``invoke``) and
async (``ainvoke``): each round gives every server a fresh thread of ``--turns`` turns, the servers taking
turns turn by turn (the order rotates every round), so all see the same machine load. Per server and mode
it prints the median and p95 turn, their ratio to uvicorn's, and the server's CPU per turn (user + system
time of its processes, granian's supervisor included, from /proc around the measured phase).

Last, the bare exchange of ``benchmarks/floors.py`` under each server: aiohttp posting 4 KB to a no-op
ASGI app, the servers taking turns in blocks of requests; median and p95 microseconds and the server's CPU
per request. Absolute times on a shared machine drift between runs; compare the ratios, which come from
the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import (
    chat_graph,
    cpu_seconds,
    percentile,
    scratch_database,
    summary,
    thread_config,
    tree_run_time_seconds,
    user_input,
)

#: granian's options for one worker serving the app: uvloop, HTTP/1 only, its access log off (the
#: service logs access itself), then per variant the Rust runtime's mode and threads. ``--task-impl rust``
#: is left out: the service's lifespan fails on shutdown with it (asyncio.all_tasks cannot read its tasks).
GRANIAN_COMMON = [
    "--interface",
    "asgi",
    "--workers",
    "1",
    "--loop",
    "uvloop",
    "--http",
    "1",
    "--no-access-log",
]
GRANIAN_VARIANTS: dict[str, list[str]] = {
    "st": ["--runtime-mode", "st", "--runtime-threads", "1"],
    "mt": ["--runtime-mode", "mt", "--runtime-threads", "1"],  # what granian picks for ASGI by default
    "mt2": ["--runtime-mode", "mt", "--runtime-threads", "2"],
}
WINDOW = 20
POOL_SIZE = 2
EXCHANGE_BLOCK = 50


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]


def _environment() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
        "PYTHONPATH": root,
    }


@contextmanager
def _started(name: str, command: list[str], folder: Path, env: dict[str, str], port: int) -> Iterator[Server]:
    from tests.support.server import run_ready

    url = f"http://127.0.0.1:{port}"
    with run_ready(command, url, folder / f"{name}.log", env=env, cwd=folder, stop_timeout=20) as process:
        yield Server(name, url, process)


@contextmanager
def service_servers(database: str, variants: list[str], folder: Path) -> Iterator[list[Server]]:
    """``reducing-saver serve`` (uvicorn) and the app under granian per variant, all on ``database``."""
    from tests.support.server import free_port

    cli = str(Path(sys.executable).with_name("reducing-saver"))
    flags = {"database": database, "max_messages": WINDOW, "pool_size": POOL_SIZE}
    granian_env = {**_environment(), "REDUCING_SAVER_SERVE_FLAGS": json.dumps(flags)}
    with ExitStack() as stack:
        port = free_port()
        servers = [
            stack.enter_context(
                _started(
                    "uvicorn",
                    [
                        cli,
                        "serve",
                        "--port",
                        str(port),
                        "--database",
                        database,
                        "--max-messages",
                        str(WINDOW),
                        "--pool-size",
                        str(POOL_SIZE),
                    ],
                    folder,
                    _environment(),
                    port,
                )
            )
        ]
        for variant in variants:
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "granian",
                *GRANIAN_COMMON,
                *GRANIAN_VARIANTS[variant],
                "--factory",
                "reducing_saver.service.http.app:app_from_env",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            servers.append(
                stack.enter_context(_started(f"granian-{variant}", command, folder, granian_env, port))
            )
        yield servers


@contextmanager
def bare_servers(variants: list[str], folder: Path) -> Iterator[list[Server]]:
    """The no-op app of ``benchmarks/floors.py`` under uvicorn (as floors starts it) and each granian variant."""
    from benchmarks.floors import APP
    from tests.support.server import free_port

    Path(folder, "bench_app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    with ExitStack() as stack:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "bench_app:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        servers = [stack.enter_context(_started("bare-uvicorn", command, folder, env, port))]
        for variant in variants:
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "granian",
                *GRANIAN_COMMON,
                *GRANIAN_VARIANTS[variant],
                "--log-level",
                "warning",
                "--port",
                str(port),
                "bench_app:app",
            ]
            servers.append(
                stack.enter_context(_started(f"bare-granian-{variant}", command, folder, env, port))
            )
        yield servers


def _rotated(items: list[Any], index: int) -> list[Any]:
    shift = index % len(items)
    return items[shift:] + items[:shift]


def _turns_sync(
    servers: list[Server], *, turns: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per server, every measured turn's wall time (ms), and its CPU seconds over the measured phase."""
    from reducing_saver.client import RemoteReducingSaver

    walls: dict[str, list[float]] = {server.name: [] for server in servers}
    with ExitStack() as stack:
        graphs = {s.name: chat_graph(stack.enter_context(RemoteReducingSaver(s.url))) for s in servers}
        for graph in graphs.values():  # warm up: connections, first-call caches
            config = thread_config(f"warm-{uuid.uuid4().hex}")
            for turn in range(3):
                graph.invoke(user_input(turn), config)
        cpu = {s.name: cpu_seconds(s.process.pid) for s in servers}
        for round_index in range(rounds):
            threads = {name: thread_config(f"asgi-{name}-{uuid.uuid4().hex}") for name in graphs}
            order = _rotated(list(graphs), round_index)
            for turn in range(turns):
                for name in order:
                    started = time.perf_counter()
                    graphs[name].invoke(user_input(turn), threads[name])
                    walls[name].append((time.perf_counter() - started) * 1000)
        cpu = {s.name: cpu_seconds(s.process.pid) - cpu[s.name] for s in servers}
    return walls, cpu


async def _turns_async(
    servers: list[Server], *, turns: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    from reducing_saver.client import RemoteReducingSaver

    walls: dict[str, list[float]] = {server.name: [] for server in servers}
    async with AsyncExitStack() as stack:
        graphs = {
            s.name: chat_graph(await stack.enter_async_context(RemoteReducingSaver(s.url))) for s in servers
        }
        for graph in graphs.values():
            config = thread_config(f"warm-{uuid.uuid4().hex}")
            for turn in range(3):
                await graph.ainvoke(user_input(turn), config)
        cpu = {s.name: cpu_seconds(s.process.pid) for s in servers}
        for round_index in range(rounds):
            threads = {name: thread_config(f"asgi-{name}-{uuid.uuid4().hex}") for name in graphs}
            order = _rotated(list(graphs), round_index)
            for turn in range(turns):
                for name in order:
                    started = time.perf_counter()
                    await graphs[name].ainvoke(user_input(turn), threads[name])
                    walls[name].append((time.perf_counter() - started) * 1000)
        cpu = {s.name: cpu_seconds(s.process.pid) - cpu[s.name] for s in servers}
    return walls, cpu


async def _exchanges(servers: list[Server], requests: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per server, every bare POST's wall time (µs), and its CPU seconds over the measured phase."""
    import aiohttp

    from benchmarks.floors import BODY, HEADERS

    walls: dict[str, list[float]] = {server.name: [] for server in servers}
    async with AsyncExitStack() as stack:
        sessions = {
            s.name: await stack.enter_async_context(aiohttp.ClientSession(headers=HEADERS)) for s in servers
        }
        urls = {s.name: f"{s.url}/v1/x" for s in servers}

        async def post(name: str) -> None:
            async with sessions[name].post(urls[name], data=BODY) as answer:
                await answer.read()

        for name in sessions:
            for _ in range(200):
                await post(name)
        cpu = {s.name: tree_run_time_seconds(s.process.pid) for s in servers}
        for block in range(max(1, requests // EXCHANGE_BLOCK)):
            for name in _rotated(list(sessions), block):
                for _ in range(EXCHANGE_BLOCK):
                    started = time.perf_counter()
                    await post(name)
                    walls[name].append((time.perf_counter() - started) * 1e6)
        cpu = {s.name: tree_run_time_seconds(s.process.pid) - cpu[s.name] for s in servers}
    return walls, cpu


def _print_turns(mode: str, walls: dict[str, list[float]], cpu: dict[str, float]) -> dict[str, Any]:
    base = summary(walls["uvicorn"])
    base_cpu = cpu["uvicorn"] / len(walls["uvicorn"]) * 1000
    rows: dict[str, Any] = {}
    for name, values in walls.items():
        figures = summary(values)
        cpu_ms = cpu[name] / len(values) * 1000
        rows[name] = {
            **figures,
            "server_cpu_ms_per_turn": round(cpu_ms, 3),
            "median_vs_uvicorn": round(figures["median_ms"] / base["median_ms"], 3),
            "p95_vs_uvicorn": round(figures["p95_ms"] / base["p95_ms"], 3),
            "cpu_vs_uvicorn": round(cpu_ms / base_cpu, 3) if base_cpu else float("nan"),
        }
        row = rows[name]
        print(
            f"{mode:5} {name:12} n={figures['n']:4}  median {figures['median_ms']:6.2f} ms "
            f"({row['median_vs_uvicorn']:5.3f}x)  p95 {figures['p95_ms']:6.2f} ms ({row['p95_vs_uvicorn']:5.3f}x)  "
            f"server CPU {cpu_ms:5.2f} ms/turn ({row['cpu_vs_uvicorn']:5.3f}x)"
        )
    return rows


def _print_exchanges(walls: dict[str, list[float]], cpu: dict[str, float]) -> dict[str, Any]:
    base_median = statistics.median(walls["bare-uvicorn"])
    base_cpu = cpu["bare-uvicorn"] / len(walls["bare-uvicorn"]) * 1e6
    rows: dict[str, Any] = {}
    for name, values in walls.items():
        median, p95 = statistics.median(values), percentile(values, 0.95)
        cpu_us = cpu[name] / len(values) * 1e6
        rows[name] = {
            "n": len(values),
            "median_us": round(median, 1),
            "p95_us": round(p95, 1),
            "server_cpu_us": round(cpu_us, 1),
            "median_vs_uvicorn": round(median / base_median, 3),
            "cpu_vs_uvicorn": round(cpu_us / base_cpu, 3) if base_cpu else float("nan"),
        }
        print(
            f"bare  {name:19} n={len(values):5}  median {median:6.1f} us ({rows[name]['median_vs_uvicorn']:5.3f}x)  "
            f"p95 {p95:6.1f} us  server CPU {cpu_us:5.1f} us/request ({rows[name]['cpu_vs_uvicorn']:5.3f}x)"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20, help="turns per thread")
    parser.add_argument("--rounds", type=int, default=15, help="threads per server and mode")
    parser.add_argument(
        "--granian", nargs="+", choices=list(GRANIAN_VARIANTS), default=list(GRANIAN_VARIANTS)
    )
    parser.add_argument("--requests", type=int, default=3000, help="bare exchanges per server (0: none)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if importlib.util.find_spec("granian") is None:
        sys.exit("granian is not installed: pip install granian (or the bench extra)")

    results: dict[str, Any] = {
        "turns": args.turns,
        "rounds": args.rounds,
        "granian": {variant: GRANIAN_COMMON + GRANIAN_VARIANTS[variant] for variant in args.granian},
    }
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as folder, scratch_database() as database:
        with service_servers(database, args.granian, Path(folder)) as servers:
            walls, cpu = asyncio.run(_turns_async(servers, turns=args.turns, rounds=args.rounds))
            results["async"] = _print_turns("async", walls, cpu)
            walls, cpu = _turns_sync(servers, turns=args.turns, rounds=args.rounds)
            results["sync"] = _print_turns("sync", walls, cpu)
        if args.requests:
            with bare_servers(args.granian, Path(folder)) as servers:
                walls, cpu = asyncio.run(_exchanges(servers, args.requests))
                results["bare"] = _print_exchanges(walls, cpu)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
