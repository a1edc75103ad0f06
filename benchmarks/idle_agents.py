"""Idle agents: what many open clients that make no calls cost the service.

``python -m benchmarks.idle_agents [--clients 1000]``: one process opens ``clients``
``RemoteReducingSaver`` clients to one service (``--workers 2 --pool-size 2`` by default), concurrently;
each reads its thread once (``aget_tuple``), then all sit idle. Read before they open, once all have
read, and after ``idle_seconds`` of idleness (past the 15 s after which the async client closes an idle
connection; the service keeps one 75 s): the service's resident memory (every process of it), its open connections (TCP sockets), the PostgreSQL connections
it holds (by ``application_name``) and the CPU it spends while the clients idle. The answer expected: no
PostgreSQL connection beyond the pool, memory that grows with the clients open and is reused by the
next ones (a second wave of as many clients opens after the first has closed), no CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import psycopg

from benchmarks._common import DEFAULT_SERVER, _children, cpu_seconds, scratch_database

APP = "rs-bench-idle"


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its live children (a server's workers)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
    except FileNotFoundError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE") + sum(rss_bytes(child) for child in _children(pid))


def sockets(pid: int) -> int:
    """Open sockets of process ``pid`` and its live children (listening ones included)."""
    count = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            except FileNotFoundError:
                pass
    except FileNotFoundError:
        return 0
    return count + sum(sockets(child) for child in _children(pid))


def postgres_connections(server: str, database_name: str) -> int:
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
            (database_name, APP),
        ).fetchone()
    return int(row[0])


def _reading(pid: int, server: str, database_name: str) -> dict[str, Any]:
    return {
        "service_rss_mb": round(rss_bytes(pid) / 2**20, 1),
        "service_sockets": sockets(pid),
        "postgres_connections": postgres_connections(server, database_name),
    }


async def _open_clients(url: str, clients: int, stack: AsyncExitStack) -> list[Any]:
    from benchmarks._common import thread_config
    from reducing_saver.client import RemoteReducingSaver

    async def one(number: int) -> Any:
        saver = await stack.enter_async_context(await RemoteReducingSaver.aopen(url))
        await saver.aget_tuple(thread_config(f"idle-{number}"))
        return saver

    # At most 100 opening at once: the service's accept queue is not what this measures.
    gate = asyncio.Semaphore(100)

    async def gated(number: int) -> Any:
        async with gate:
            return await one(number)

    return await asyncio.gather(*(gated(number) for number in range(clients)))


def run(
    url: str, pid: int, server: str, database: str, *, clients: int, idle_seconds: float
) -> dict[str, Any]:
    """Open ``clients`` clients to the service at ``url`` (process ``pid``), read once each, idle."""
    database_name = database.rsplit("/", 1)[1]

    async def measure() -> dict[str, Any]:
        before = _reading(pid, server, database_name)
        started = time.monotonic()
        async with AsyncExitStack() as stack:
            await _open_clients(url, clients, stack)
            open_s = time.monotonic() - started
            loaded = _reading(pid, server, database_name)
            cpu_before = cpu_seconds(pid)
            await asyncio.sleep(idle_seconds)
            idle_cpu = cpu_seconds(pid) - cpu_before
            idle = _reading(pid, server, database_name)
        closed = _reading(pid, server, database_name)
        # A second wave as large: memory freed by the first is reused, not added to.
        async with AsyncExitStack() as stack:
            await _open_clients(url, clients, stack)
            second = _reading(pid, server, database_name)
        return {
            "clients": clients,
            "open_and_read_s": round(open_s, 2),
            "idle_seconds": idle_seconds,
            "before": before,
            "all_open": loaded,
            "idle": idle,
            "clients_closed": closed,
            "second_wave_open": second,
            "idle_service_cpu_cores": round(idle_cpu / idle_seconds, 4),
            "rss_per_open_client_kb": round(
                (loaded["service_rss_mb"] - before["service_rss_mb"]) * 1024 / clients, 1
            ),
        }

    return asyncio.run(measure())


def lines(result: dict[str, Any]) -> list[str]:
    rows = [
        ("before", result["before"]),
        (f"{result['clients']:,} clients open, each read once", result["all_open"]),
        (f"after {result['idle_seconds']:g} s idle", result["idle"]),
        ("clients closed", result["clients_closed"]),
        (f"{result['clients']:,} other clients open", result["second_wave_open"]),
    ]
    out = [
        f"{label}: service {fig['service_rss_mb']:.1f} MB resident, {fig['service_sockets']} sockets, "
        f"{fig['postgres_connections']} PostgreSQL connections"
        for label, fig in rows
    ]
    out.append(
        f"service CPU while idle: {result['idle_service_cpu_cores'] * 100:.2f}% of a core; "
        f"{result['rss_per_open_client_kb']:.1f} KB resident per open client"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.idle_agents", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--pool-size", type=int, default=2)
    parser.add_argument("--postgres", default=DEFAULT_SERVER)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    from tests.support.server import run_service

    args.out.mkdir(parents=True, exist_ok=True)
    with scratch_database(args.postgres) as database:
        url = f"{database}?application_name={APP}"
        with run_service(
            args.out.resolve(),
            "--database",
            url,
            "--max-messages",
            "20",
            "--pool-size",
            str(args.pool_size),
            "--workers",
            str(args.workers),
        ) as service:
            result = run(
                service.url,
                service.process.pid,
                args.postgres,
                database,
                clients=args.clients,
                idle_seconds=args.idle_seconds,
            )
    (args.out / "idle_agents.json").write_text(json.dumps(result, indent=1) + "\n")
    for line in lines(result):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
