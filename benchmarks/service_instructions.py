"""The service's own work per request, in process: CPU time, instruction counts or a profile, per route.

``service_cost`` measures a running service from outside, against a bare exchange under the same server;
on a loaded machine those figures move with the load. This replays the same kind of requests (the puts,
writes and latest-checkpoint gets of recorded chat turns, as ``RemoteReducingSaver`` sends them) straight
into the app's ASGI callable, with no server and no socket, so what it measures is the service's code:
the middleware, the hot path, the operations, the reducer, the backend, the worker-thread hop.

Modes:

* ``cpu``: the process's CPU time per request (every thread), the best and the median of ``--rounds``.
* ``callgrind``: the same replay under ``valgrind --tool=callgrind``, instructions per request per route
  (repeatable to a fraction of a percent whatever else the machine runs). Needs valgrind and a C
  compiler (a small shim turns the measurement on and off around each route).
* ``profile``: cProfile of each route's requests, with the saver calls run on the event loop's thread
  (cProfile sees one thread), top functions by own and inclusive time.

    python -m benchmarks.service_instructions --mode cpu
    python -m benchmarks.service_instructions --mode callgrind --database postgresql://postgres@127.0.0.1/db
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROUTES = ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get")
WINDOW = 20  # the benchmark suite's --max-messages

_SHIM = r"""
#include <valgrind/callgrind.h>
void rs_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void rs_zero(void) { CALLGRIND_ZERO_STATS; }
void rs_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def _settings(database: str) -> Any:
    from reducing_saver.service.configuration.settings import Settings

    # No delivery from this process: its polling is not per-request work (the outbox rows still are).
    return Settings(database=database, max_messages=WINDOW, extract=False, log_level="info")


async def _open_app(database: str) -> Any:
    from reducing_saver.service.http.app import create_app
    from reducing_saver.service.http.observability import configure_logging

    settings = _settings(database)
    configure_logging(settings, stream=open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process
    app = create_app(settings)
    await asyncio.get_running_loop().run_in_executor(None, app.state.service.open)
    return app


async def _record(conversations: int, calls: list[tuple[str, tuple]]) -> dict[str, list[dict[str, Any]]]:
    """Every request ``RemoteReducingSaver`` sends for ``conversations`` replayed conversations, by route:
    their puts and writes, then gets of each one's latest checkpoint (as many as the writes)."""
    import httpx

    from benchmarks.service_cost import RecordingTransport, _call, _on_thread
    from reducing_saver.client import RemoteReducingSaver

    app = await _open_app("memory://")
    recorder = RecordingTransport()
    recorder.inner = httpx.ASGITransport(app)  # type: ignore[assignment]
    gets_each = sum(kind == "writes" for kind, _ in calls)
    threads = [f"instr-{uuid.uuid4().hex[:8]}-{index}" for index in range(conversations)]
    async with await RemoteReducingSaver.aopen("http://service", async_transport=recorder) as saver:
        for thread_id in threads:
            for kind, args in calls:
                if kind in ("put", "writes"):
                    await _call(saver, kind, _on_thread(args, thread_id))
        for _ in range(gets_each):  # a read can repeat: as many gets as writes
            for thread_id in threads:
                await saver.aget_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
    app.state.service.close()
    shapes: dict[str, list[dict[str, Any]]] = {route: [] for route in ROUTES}
    for exchange in recorder.exchanges:
        if exchange["path"] in shapes:
            shapes[exchange["path"]].append(exchange)
    return shapes


def _scope(exchange: dict[str, Any]) -> dict[str, Any]:
    body = exchange["body"]
    headers = [(name.lower().encode(), value.encode()) for name, value in exchange["headers"]]
    headers += [(b"host", b"service"), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": exchange["method"], "scheme": "http", "path": exchange["path"],
        "raw_path": exchange["path"].encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080), "state": {},
    }


async def _replay(app: Any, requests: list[tuple[dict[str, Any], bytes]]) -> None:
    for scope, body in requests:
        status = 0

        async def receive(body: bytes = body) -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(dict(scope), receive, send)
        if status >= 300:
            raise RuntimeError(f"{scope['path']} answered {status}")


def _batches(shapes: dict[str, list[dict[str, Any]]], rounds: int) -> dict[str, list[list[tuple[dict, bytes]]]]:
    """The requests of each route split into ``rounds + 1`` batches (the first warms up): no request repeats."""
    out: dict[str, list[list[tuple[dict, bytes]]]] = {}
    for route, exchanges in shapes.items():
        # Whole conversations per batch, so each batch's puts and gets look alike.
        requests = [(_scope(exchange), exchange["body"]) for exchange in exchanges]
        size = len(requests) // (rounds + 1)
        out[route] = [requests[index * size:(index + 1) * size] for index in range(rounds + 1)]
    return out


async def _measure(database: str, shapes: dict[str, list[dict[str, Any]]], *, mode: str, rounds: int,
                   top: int) -> dict[str, Any]:
    app = await _open_app(database)
    batches = _batches(shapes, rounds)
    # Warm up every route (imports, caches, adapters) with the first batch of each.
    for route in ROUTES:
        await _replay(app, batches[route][0])
    results: dict[str, Any] = {}
    if mode == "callgrind":
        shim = _load_shim()
        shim.rs_start()
        for route in ROUTES:
            for batch in batches[route][1:]:
                shim.rs_zero()
                await _replay(app, batch)
                shim.rs_dump(f"{route} {len(batch)}".encode())
    elif mode == "profile":
        results = await _profile(app, batches, top)
    else:
        for route in ROUTES:
            per_request = []
            for batch in batches[route][1:]:
                before = time.process_time()
                await _replay(app, batch)
                per_request.append((time.process_time() - before) * 1e6 / len(batch))
            results[route] = {
                "requests": len(batches[route][1]),
                "cpu_us_best": round(min(per_request), 1),
                "cpu_us_median": round(statistics.median(per_request), 1),
            }
    app.state.service.close()
    return results


async def _profile(app: Any, batches: dict[str, list[list[tuple[dict, bytes]]]], top: int) -> dict[str, Any]:
    import cProfile
    import pstats

    from reducing_saver.service.storage import SaverPool

    async def inline(self: Any, fn: Any) -> Any:  # cProfile sees one thread: run the saver calls here
        with self.borrow() as saver, self._wrap_exceptions():
            return fn(saver)

    SaverPool.call = inline  # type: ignore[method-assign]
    results: dict[str, Any] = {}
    for route in ROUTES:
        profiler = cProfile.Profile()
        requests = [request for batch in batches[route][1:] for request in batch]
        profiler.enable()
        await _replay(app, requests)
        profiler.disable()
        stats = pstats.Stats(profiler)
        rows = []
        for (filename, line, name), (_, calls, own, inclusive, _) in stats.stats.items():  # type: ignore[attr-defined]
            where = filename.split("site-packages/")[-1].split("/perf/")[-1]
            rows.append((own, inclusive, calls, f"{name} ({where}:{line})"))
        per = 1e6 / len(requests)
        results[route] = {
            "requests": len(requests),
            "top_own_us": [[round(own * per, 1), calls // len(requests) if calls >= len(requests) else
                            round(calls / len(requests), 2), name]
                           for own, _, calls, name in sorted(rows, reverse=True)[:top]],
            "top_inclusive_us": [[round(inclusive * per, 1), name]
                                 for _, inclusive, _, name in sorted(rows, key=lambda row: -row[1])[:top]],
        }
    return results


def _load_shim() -> Any:
    folder = Path(tempfile.mkdtemp(prefix="rs-callgrind-"))
    (folder / "shim.c").write_text(_SHIM)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(folder / "shim.so"), str(folder / "shim.c")],
                   check=True)
    shim = ctypes.CDLL(str(folder / "shim.so"))
    shim.rs_dump.argtypes = [ctypes.c_char_p]
    return shim


def _callgrind(argv: list[str], keep: str | None) -> dict[str, Any]:
    """Run this module under callgrind (``--inner``) and read the instructions of each route's dumps
    (kept in ``keep``, for ``callgrind_annotate``, when given)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("callgrind mode needs valgrind")
    with tempfile.TemporaryDirectory() as temporary:
        folder = keep or temporary
        Path(folder).mkdir(parents=True, exist_ok=True)
        out = Path(folder) / "callgrind.out"
        subprocess.run(
            [valgrind, "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
             sys.executable, "-m", "benchmarks.service_instructions", *argv, "--inner"],
            check=True, stderr=subprocess.DEVNULL,
        )
        figures: dict[str, list[float]] = {}
        for dump in sorted(Path(folder).glob("callgrind.out.*")):
            text = dump.read_text(errors="replace")
            trigger = next((line for line in text.splitlines() if line.startswith("desc: Trigger:")), "")
            if "Client Request:" not in trigger:
                continue
            route, count = trigger.split("Client Request:", 1)[1].strip().rsplit(" ", 1)
            total = next(int(line.split()[1]) for line in text.splitlines()
                         if line.startswith(("summary:", "totals:")))
            figures.setdefault(route, []).append(total / int(count))
    return {
        route: {
            "instructions_best": round(min(values)),
            "instructions_median": round(statistics.median(values)),
            "spread_pct": round(100 * (max(values) - min(values)) / min(values), 2),
        }
        for route, values in figures.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--database", default="memory://")
    parser.add_argument("--mode", choices=("cpu", "callgrind", "profile"), default="cpu")
    parser.add_argument("--conversations", type=int, default=8, help="recorded conversations of 12 turns each")
    parser.add_argument("--rounds", type=int, default=3, help="measured batches per route (after one warm-up)")
    parser.add_argument("--top", type=int, default=25, help="profile: functions shown")
    parser.add_argument("--keep", help="callgrind: keep the dumps in this folder (for callgrind_annotate)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "callgrind" and not args.inner:
        argv = [arg for arg in sys.argv[1:] if arg != "--inner"]
        print(json.dumps(_callgrind(argv, args.keep), indent=1))
        return
    from benchmarks.service_cost import record_turns

    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    calls = record_turns(12)
    shapes = runner(_record(args.conversations, calls))
    results = runner(_measure(args.database, shapes, mode=args.mode, rounds=args.rounds, top=args.top))
    if args.mode != "callgrind":
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
