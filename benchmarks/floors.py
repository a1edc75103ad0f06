"""Floors: what any per-call HTTP checkpointer pays on this machine before the service does any work.

Three measurements, in the same run as the latency section they bound:

* ``exchange``: one 4 KB POST from aiohttp (the async client's library) to a bare ASGI app under uvicorn
  (the service's server) that reads the body and answers ``{"ok": 1}``: wall time, and the CPU it costs the
  client and the server per request. No per-call design can answer faster.
* ``calls``: the checkpointer calls a turn of the suite's chat graph makes, counted on an in-memory saver,
  and how many of them LangGraph makes one after another: the ``get_tuple`` that opens the turn and the
  chain of ``put`` calls (each put waits for the previous one), while ``put_writes`` run beside them.
* ``idle_wake``: a ``PostgresSaver.get_tuple`` back to back and after the connection sat idle a few
  milliseconds, as a turn's calls do while the agent computes and another process is on the line.

``floor_ratio_async`` turns the first two and the latency section's in-process async median into the
lowest remote / in-process ratio any per-call service could reach here.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks._common import chat_graph, percentile, run_time_seconds, thread_config, user_input

APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": 1}'})
"""
BODY = b"x" * 4096
HEADERS = {"content-type": "application/json", "user-agent": "bench"}
IDLE_GAP_S = 0.005


@contextmanager
def bare_server(app: str = APP) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``app`` (the source of a module defining ``app``; default ``APP``) under uvicorn on a free port, with
    the service's server options (no access log): yields ``(url, process)``, stops it afterwards."""
    from tests.support.server import free_port, wait_ready

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "bench_app.py").write_text(app)
        log = Path(folder, "uvicorn.log")
        with log.open("wb") as out:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "bench_app:app",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                ],
                cwd=folder,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_ready(base, server, log, timeout=20.0)  # APP answers every path, /readyz included
            yield f"{base}/v1/x", server
        finally:
            server.terminate()
            server.wait()


async def _exchange(url: str, server_pid: int, requests: int) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession(headers=HEADERS) as session:

        async def post() -> None:
            async with session.post(url, data=BODY) as answer:
                await answer.read()

        for _ in range(min(200, requests)):
            await post()
        walls: list[float] = []
        client_cpu, server_cpu = time.process_time(), run_time_seconds(server_pid)
        for _ in range(requests):
            started = time.perf_counter()
            await post()
            walls.append((time.perf_counter() - started) * 1e6)
        client_cpu, server_cpu = time.process_time() - client_cpu, run_time_seconds(server_pid) - server_cpu
    return {
        "requests": requests,
        "median_us": round(statistics.median(walls), 1),
        "p95_us": round(percentile(walls, 0.95), 1),
        "client_cpu_us": round(client_cpu / requests * 1e6, 1),
        "server_cpu_us": round(server_cpu / requests * 1e6, 1),
    }


def exchange(requests: int) -> dict[str, float]:
    """Wall time (median, p95) and client and server CPU of one bare 4 KB POST, in microseconds."""
    with bare_server() as (url, server):
        return asyncio.run(_exchange(url, server.pid, requests))


def calls(turns: int = 4) -> dict[str, Any]:
    """The checkpointer calls per turn of the chat graph (async), and how many LangGraph makes in sequence."""
    from langgraph.checkpoint.memory import InMemorySaver

    counted: Counter[str] = Counter()

    class Counting(InMemorySaver):
        async def aget_tuple(self, config: Any) -> Any:
            counted["get_tuple"] += 1
            return await super().aget_tuple(config)

        async def aput(self, *args: Any) -> Any:
            counted["put"] += 1
            return await super().aput(*args)

        async def aput_writes(self, *args: Any, **kwargs: Any) -> None:
            counted["put_writes"] += 1
            await super().aput_writes(*args, **kwargs)

    async def run() -> None:
        graph = chat_graph(Counting())
        config = thread_config(f"floor-{uuid.uuid4().hex}")
        for turn in range(turns):
            await graph.ainvoke(user_input(turn), config)

    asyncio.run(run())
    per_turn = {name: counted[name] / turns for name in ("get_tuple", "put", "put_writes")}
    return {
        **per_turn,
        "total": sum(per_turn.values()),
        "sequential": per_turn["get_tuple"] + per_turn["put"],
    }


def idle_wake(database: str, samples: int) -> dict[str, float]:
    """Median ``get_tuple`` wall time on one connection, back to back and after ``IDLE_GAP_S`` idle."""
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(database) as saver:
        saver.setup()
        config = {"configurable": {"thread_id": f"floor-{uuid.uuid4().hex}", "checkpoint_ns": ""}}
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"messages": "x" * 4000}
        checkpoint["channel_versions"] = {"messages": "1"}
        saver.put(config, checkpoint, {}, {"messages": "1"})

        def timed(gap: float) -> float:
            walls = []
            for _ in range(samples):
                if gap:
                    time.sleep(gap)
                started = time.perf_counter()
                saver.get_tuple(config)
                walls.append((time.perf_counter() - started) * 1e6)
            return round(statistics.median(walls), 1)

        timed(0.0)  # warm up: the prepared statement, the backend's caches
        return {
            "back_to_back_us": timed(0.0),
            "after_idle_us": timed(IDLE_GAP_S),
            "idle_gap_ms": IDLE_GAP_S * 1e3,
        }


def floor_ratio(exchange_us: float, sequential_calls: float, inprocess_median_ms: float) -> float:
    """The lowest remote / in-process turn ratio a per-call service could reach: the in-process turn plus
    one bare exchange per sequential call, the service's own work taken as free and PostgreSQL's as cheap
    as in-process."""
    return round(1 + sequential_calls * exchange_us / 1000 / inprocess_median_ms, 3)


def run(database: str, inprocess_median_ms: float, *, requests: int, samples: int) -> dict[str, Any]:
    """The three floors, and ``floor_ratio_async`` against the latency section's in-process async median."""
    bare, counted = exchange(requests), calls()
    return {
        "exchange": bare,
        "calls_per_turn": counted,
        "idle_wake": idle_wake(database, samples),
        "floor_ratio_async": floor_ratio(bare["median_us"], counted["sequential"], inprocess_median_ms),
    }
