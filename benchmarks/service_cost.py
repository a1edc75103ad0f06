"""Service cost: the service process's CPU per request, by route, under concurrent load; and a profile.

The calls of real chat turns are recorded once (a ``StateGraph(MessagesState)`` run on a recording
``InMemorySaver``) and replayed through ``RemoteReducingSaver`` by ``concurrency`` coroutines, each on
threads of its own, one route at a time: ``checkpoints/put`` (the turn's puts, so the reducer prunes
and the outbox records as in a real chat), ``writes/put``, ``checkpoints/get`` (the latest checkpoint of
a replayed thread) and ``GET /healthz`` (the HTTP floor). Around each route's measured request count the
service's CPU time is read from /proc/<pid>/stat; the service's idle CPU rate (extraction polling) is
measured first and also reported subtracted.

Each route is set against a bare exchange under the same server: a no-op ASGI app under uvicorn
(``floors.bare_server``, the service's server options) that reads the request and answers as many bytes as
the service answered, loaded right after the route with the same requests (the bodies and headers
``RemoteReducingSaver`` sent for that route, recorded once through an httpx transport), the same count and
the same concurrency, from aiohttp as the client's async calls are, its process CPU read the same way. The
difference is the service's own work per request: validation, the reducer, the outbox, PostgreSQL calls,
metrics; per turn it counts the calls a turn makes. The profile is a ``py-spy record --gil -f raw`` of the
service while whole turns are replayed; the result keeps its top frames by own and by inclusive samples,
the samples by component, and the inclusive share of a few key functions.

Given the stock-saver service (``benchmarks/stock_service.py``), its routes are measured the same way
right after the service's, against the same bare exchange: the floor under the service's figures.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from langgraph.checkpoint.memory import InMemorySaver

from benchmarks._common import chat_graph, cpu_seconds, thread_config, user_input
from benchmarks.floors import bare_server
from benchmarks.storage import wait_extraction_drained
from reducing_saver.client import RemoteReducingSaver

ROUTES = ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get", "/healthz")
#: The route of each call a turn makes.
TURN_ROUTES = {"get": "/v1/checkpoints/get", "put": "/v1/checkpoints/put", "writes": "/v1/writes/put"}


class RecordingSaver(InMemorySaver):
    """An InMemorySaver that keeps a copy of every get_tuple, put and put_writes call, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def get_tuple(self, config):  # type: ignore[override]
        self.calls.append(("get", (copy.deepcopy(config),)))
        return super().get_tuple(config)

    def put(self, config, checkpoint, metadata, new_versions):  # type: ignore[override]
        self.calls.append(("put", copy.deepcopy((config, checkpoint, metadata, new_versions))))
        return super().put(config, checkpoint, metadata, new_versions)

    def put_writes(self, config, writes, task_id, task_path=""):  # type: ignore[override]
        self.calls.append(("writes", copy.deepcopy((config, writes, task_id, task_path))))
        return super().put_writes(config, writes, task_id, task_path)


def record_turns(turns: int) -> list[tuple[str, tuple]]:
    saver = RecordingSaver()
    graph = chat_graph(saver)
    config = thread_config("recorded")
    for turn in range(turns):
        graph.invoke(user_input(turn), config)
    return saver.calls


def _on_thread(args: tuple, thread_id: str) -> tuple:
    config = copy.copy(args[0])
    config["configurable"] = {**config["configurable"], "thread_id": thread_id}
    return (config, *args[1:])


async def _call(saver: Any, kind: str, args: tuple) -> None:
    if kind == "put":
        await saver.aput(*args)
    elif kind == "writes":
        await saver.aput_writes(*args)
    else:
        await saver.aget_tuple(*args)


async def _replay(
    saver: Any, calls: list[tuple[str, tuple]], kinds: set[str], count: int, concurrency: int, prefix: str
) -> list[str]:
    """Replay the recorded calls of ``kinds``, conversation by conversation, until ``count`` were sent."""
    selected = [(kind, args) for kind, args in calls if kind in kinds]
    sent = 0
    threads: list[str] = []

    async def worker(worker_id: int) -> None:
        nonlocal sent
        for pass_number in itertools.count():
            thread_id = f"{prefix}-{worker_id}-{pass_number}"
            threads.append(thread_id)
            for kind, args in selected:
                if sent >= count:
                    return
                sent += 1
                await _call(saver, kind, _on_thread(args, thread_id))

    await asyncio.gather(*(worker(index) for index in range(concurrency)))
    return threads


async def _replay_gets(saver: Any, threads: list[str], count: int, concurrency: int) -> None:
    ids = itertools.cycle(threads)
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < count:
            sent += 1
            await saver.aget_tuple({"configurable": {"thread_id": next(ids), "checkpoint_ns": ""}})

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _replay_health(url: str, count: int, concurrency: int) -> None:
    sent = 0
    async with httpx.AsyncClient(base_url=url) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < count:
                sent += 1
                (await client.get("/healthz")).raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _metric_counts(url: str) -> Counter[str]:
    """Requests answered so far, by route template, from the service's /metrics."""
    counts: Counter[str] = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("reducing_saver_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            route = labels.split('route="', 1)[1].split('"', 1)[0]
            counts[route] += int(float(value))
    return counts


#: The bare exchange: reads the request, answers ``x-answer-bytes`` bytes (the service's answer's size).
BARE_APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    size = next((int(value) for name, value in scope["headers"] if name == b"x-answer-bytes"), 0)
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"x" * size})
"""
#: Headers the HTTP client sets on its own; the bare replay lets aiohttp set them.
_CLIENT_SET = {"host", "content-length", "connection", "transfer-encoding"}


class RecordingTransport(httpx.AsyncBaseTransport):
    """An httpx transport keeping every exchange's request (method, headers, body) and answer size."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        answer = await response.aread()
        self.exchanges.append(
            {
                "path": request.url.path,
                "method": request.method,
                "headers": [
                    (name, value)
                    for name, value in request.headers.multi_items()
                    if name.lower() not in _CLIENT_SET
                ],
                "body": request.content,
                "answer_bytes": len(answer),
            }
        )
        return httpx.Response(response.status_code, headers=response.headers, content=answer)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _record_shapes(url: str, calls: list[tuple[str, tuple]]) -> dict[str, list[dict[str, Any]]]:
    """The requests each route's measurement sends, by route, recorded from one replayed conversation:
    its puts and writes, a get of its latest checkpoint (as the get route's), a health check."""
    recorder = RecordingTransport()
    thread_id = f"cost-shapes-{uuid.uuid4().hex[:6]}"
    async with await RemoteReducingSaver.aopen(url, async_transport=recorder) as saver:
        for kind, args in calls:
            if kind in ("put", "writes"):
                await _call(saver, kind, _on_thread(args, thread_id))
        await saver.aget_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
    async with httpx.AsyncClient(base_url=url, transport=recorder) as client:
        (await client.get("/healthz")).raise_for_status()
    shapes: dict[str, list[dict[str, Any]]] = {route: [] for route in ROUTES}
    for exchange in recorder.exchanges:
        if exchange["path"] in shapes:
            shapes[exchange["path"]].append(exchange)
    return shapes


async def _replay_bare(
    url: str, pid: int, shapes: list[dict[str, Any]], *, requests: int, concurrency: int
) -> dict[str, float]:
    """``requests`` of ``shapes`` (in turn) to the bare exchange from ``concurrency`` coroutines; its CPU."""
    import aiohttp

    cycle = itertools.cycle(shapes)
    sent = 0
    # As the client's session: aiohttp adds none of the headers the recorded ones leave out.
    skip = ("User-Agent", "Content-Type", "Accept-Encoding")
    async with aiohttp.ClientSession(skip_auto_headers=skip) as session:

        async def post(shape: dict[str, Any]) -> None:
            headers = [*shape["headers"], ("x-answer-bytes", str(shape["answer_bytes"]))]
            async with session.request(
                shape["method"], url, data=shape["body"] or None, headers=headers
            ) as answer:
                await answer.read()

        async def worker(count: int) -> None:
            nonlocal sent
            while sent < count:
                sent += 1
                await post(next(cycle))

        await worker(min(50, requests))  # warm up: connections, the server's first requests
        sent = 0
        wall_before, cpu_before = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(worker(requests) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - wall_before, cpu_seconds(pid) - cpu_before
    return {
        "bare_cpu_us_per_request": round(cpu * 1e6 / requests, 1),
        "bare_requests_per_s": round(requests / wall, 1),
        "request_bytes_mean": round(sum(len(shape["body"]) for shape in shapes) / len(shapes)),
        "answer_bytes_mean": round(sum(shape["answer_bytes"] for shape in shapes) / len(shapes)),
    }


async def _measure_routes(
    url: str,
    pid: int,
    calls: list[tuple[str, tuple]],
    *,
    requests: int,
    concurrency: int,
    idle_cpu_rate: float,
    bare_url: str,
    bare_pid: int,
) -> dict[str, Any]:
    routes: dict[str, Any] = {}
    run_id = uuid.uuid4().hex[:6]
    shapes = await _record_shapes(url, calls)
    async with RemoteReducingSaver(url) as saver:
        # Warm up every route (connections, caches, pydantic adapters) outside the measurements.
        warm = await _replay(saver, calls, {"put", "writes", "get"}, 30, 2, f"cost-warm-{run_id}")
        await _replay_gets(saver, warm, 10, 2)
        await _replay_health(url, 10, 2)
        put_threads: list[str] = []
        for route in ROUTES:
            metrics_before = _metric_counts(url)
            wall_before, cpu_before = time.perf_counter(), cpu_seconds(pid)
            if route == "/v1/checkpoints/put":
                put_threads = await _replay(saver, calls, {"put"}, requests, concurrency, f"cost-{run_id}")
            elif route == "/v1/writes/put":
                await _replay(saver, calls, {"writes"}, requests, concurrency, f"cost-{run_id}")
            elif route == "/v1/checkpoints/get":
                await _replay_gets(saver, put_threads, requests, concurrency)
            else:
                await _replay_health(url, requests, concurrency)
            wall, cpu = time.perf_counter() - wall_before, cpu_seconds(pid) - cpu_before
            counted = _metric_counts(url)[route] - metrics_before[route]
            routes[route] = {
                "requests": requests,
                "requests_counted_by_service": counted,
                "wall_s": round(wall, 3),
                "requests_per_s": round(requests / wall, 1),
                "cpu_s": round(cpu, 3),
                "cpu_us_per_request": round(cpu * 1e6 / requests, 1),
                "cpu_us_per_request_net_of_idle": round(
                    max(0.0, cpu - idle_cpu_rate * wall) * 1e6 / requests, 1
                ),
                "service_cpu_cores": round(cpu / wall, 3),
            }
            if route == "/v1/checkpoints/put":
                # The pruned messages these puts recorded are delivered to the store afterwards.
                drain_start = time.perf_counter()
                wait_extraction_drained(url, timeout=60.0)
                drain_wall = time.perf_counter() - drain_start
                total = cpu_seconds(pid) - cpu_before
                routes[route]["cpu_us_per_request_with_extraction"] = round(
                    max(0.0, total - idle_cpu_rate * (wall + drain_wall)) * 1e6 / requests, 1
                )
            # The same requests to the bare exchange, right after the route's: the same machine load.
            bare = await _replay_bare(
                bare_url, bare_pid, shapes[route], requests=requests, concurrency=concurrency
            )
            routes[route].update(bare)
            routes[route]["own_cpu_us_per_request"] = round(
                routes[route]["cpu_us_per_request"] - bare["bare_cpu_us_per_request"], 1
            )
    return routes


async def _replay_turns(url: str, calls: list[tuple[str, tuple]], seconds: float, concurrency: int) -> int:
    """Replay whole turns (get, puts, writes in their recorded order) for ``seconds``; returns requests."""
    deadline = time.monotonic() + seconds
    sent = 0
    run_id = uuid.uuid4().hex[:6]
    async with RemoteReducingSaver(url) as saver:

        async def worker(worker_id: int) -> None:
            nonlocal sent
            for pass_number in itertools.count():
                thread_id = f"prof-{run_id}-{worker_id}-{pass_number}"
                for kind, args in calls:
                    if time.monotonic() >= deadline:
                        return
                    sent += 1
                    await _call(saver, kind, _on_thread(args, thread_id))

        await asyncio.gather(*(worker(index) for index in range(concurrency)))
    return sent


ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def _frame_name(frame: str) -> str:
    """``func (/full/path/module.py:123)`` -> ``func (package/module.py)``: lines vary between samples."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/lib/python3.":
                path = path.split("/", 1)[-1]
            break
    else:
        path = path.removeprefix(ROOT)
    return f"{name} ({path})"


#: Where a sample's time goes: the innermost frame (leaf first) whose file matches a component names it.
COMPONENTS = (
    ("reducer + messages codec", ("service/reducer.py", "service/saver.py", "service/messages_codec.py")),
    ("outbox (recording pruned messages)", ("service/outbox.py",)),
    ("extraction delivery", ("service/extraction/", "langgraph/store/")),
    ("psycopg + pool", ("psycopg/", "psycopg_pool/")),
    (
        "PostgresSaver + serde",
        ("langgraph/checkpoint/", "service/savers.py", "service/serde.py", "service/backends.py"),
    ),
    (
        "request validation + JSON (pydantic, orjson, hotpath)",
        ("pydantic", "service/http/schemas.py", "service/http/hotpath.py", "orjson"),
    ),
    ("logging", ("logging/",)),
    (
        "metrics + request ids (observability.py)",
        ("prometheus_client/", "service/http/observability.py", "uuid.py"),
    ),
    ("auth + body guard (security.py)", ("service/security.py",)),
    ("other service code (app.py: ops, body size limit)", ("service/",)),
    (
        "thread-pool hop (anyio, threading, queue)",
        ("anyio/", "sniffio/", "threading.py", "concurrent/futures", "queue.py"),
    ),
    ("HTTP server (uvicorn, httptools)", ("uvicorn/", "httptools/", "h11/")),
    ("ASGI framework (starlette, fastapi)", ("starlette/", "fastapi/")),
    ("event loop (asyncio, uvloop)", ("asyncio/", "uvloop/")),
)


def _component(stack: list[str]) -> str:
    for frame in reversed(stack):
        for name, needles in COMPONENTS:
            if any(needle in frame for needle in needles):
                return name
    return "other"


#: Functions whose inclusive share the result always reports: the request's own work vs what wraps it.
KEY_FRAMES = (
    "HotPath._handle",  # validation, the saver call, encoding: the work a request asks for
    "ReducingSaver.put",
    "apply_reducer",
    "PostgresSaver.put",
    "PostgresSaver.get_tuple",
    "PostgresSaver.put_writes",
    "run_in_threadpool",  # the worker-thread hop
    "ObservabilityMiddleware.__call__",
    "Logger.log",  # the access log line
    "_route_template",
    "AuthMiddleware.__call__",
    "BodyGuard.problem",
    "HttpToolsProtocol.data_received",
    "RequestResponseCycle.send",
)


def parse_raw_profile(raw: str, top: int = 20) -> dict[str, Any]:
    """Top frames of py-spy's raw (collapsed stack) output: by own samples, by inclusive samples, and
    the samples by component (the innermost frame that belongs to a known component)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    components: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        count = int(count_text)
        stack = [frame for frame in stack_text.split(";") if frame]
        total += count
        names = [_frame_name(frame) for frame in stack]
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
        for function in {name.split(" (", 1)[0] for name in names}:
            functions[function] += count
        components[_component(stack)] += count

    def ranked(counter: Counter[str], limit: int) -> list[dict[str, Any]]:
        return [
            {"frame": name, "samples": samples, "pct": round(100 * samples / total, 1)}
            for name, samples in counter.most_common(limit)
        ]

    return {
        "samples": total,
        "top_own": ranked(own, top),
        # Frames on (nearly) every stack, the process's entry points, say nothing: left out.
        "top_inclusive": [entry for entry in ranked(inclusive, top + 15) if entry["pct"] < 90][:top],
        "components": {name: round(100 * samples / total, 1) for name, samples in components.most_common()}
        if total
        else {},
        "key_frames_inclusive_pct": {
            name: round(100 * functions[name] / total, 1) if total else 0.0 for name in KEY_FRAMES
        },
    }


def profile(
    url: str, pid: int, calls: list[tuple[str, tuple]], *, seconds: float, concurrency: int, out_dir: Path
) -> dict[str, Any]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    raw_path = out_dir / "service-profile.txt"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "py-spy.log"
        with log.open("wb") as log_file:
            recorder = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(max(1, round(seconds))),
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--output",
                    str(raw_path),
                    "--gil",
                    "--full-filenames",
                    "--subprocesses",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        time.sleep(0.5)  # let py-spy attach before the load starts
        requests = asyncio.run(_replay_turns(url, calls, seconds, concurrency))
        try:
            recorder.wait(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            recorder.kill()
            recorder.wait()
        output = log.read_text(errors="replace")
    if recorder.returncode != 0 or not raw_path.exists():
        return {"tool": "py-spy", "error": output.strip()[-2000:], "requests": requests}
    return {
        # --gil: only the thread holding the GIL is sampled, so waiting threads (the thread pool, psycopg's
        # pool workers, the event loop in epoll) do not drown the picture; C code running without the
        # GIL (libpq, socket syscalls) is not in it.
        "tool": "py-spy record --gil --format raw --rate 200",
        "seconds": seconds,
        "concurrency": concurrency,
        "requests": requests,
        "raw_file": raw_path.name,
        **parse_raw_profile(raw_path.read_text()),
    }


def _idle_rate(url: str, pid: int, seconds: float) -> float:
    """The process's CPU cores when no request comes (its background work: extraction polling)."""
    wait_extraction_drained(url, timeout=120.0)
    idle_before, idle_start = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - idle_before) / (time.perf_counter() - idle_start)


def run(
    url: str,
    pid: int,
    *,
    requests: int,
    concurrency: int,
    profile_seconds: float,
    out_dir: Path,
    idle_seconds: float,
    stock: tuple[str, int] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The routes' CPU per request against the bare exchange, per turn, and the profile.

    ``stock``: ``(url, pid)`` of the stock-saver service (``benchmarks/stock_service.py``), measured the
    same way right after the service: its own CPU per request is what the stock ``PostgresSaver`` call and
    the service's envelope (server, middleware, body decoding, worker-thread hop) cost without the
    service's own work, the floor under the per-request figures.
    """
    turns = 12
    calls = record_turns(turns)  # past the window of 20 messages: later puts prune
    per_turn = {kind: count / turns for kind, count in Counter(kind for kind, _ in calls).items()}

    def per_turn_sum(routes: dict[str, Any], key: str) -> float:
        return round(
            sum(per_turn.get(kind, 0) * routes[route][key] for kind, route in TURN_ROUTES.items()), 1
        )

    idle_rate = _idle_rate(url, pid, idle_seconds)
    with bare_server(BARE_APP) as (bare_url, bare):
        routes = asyncio.run(
            _measure_routes(
                url,
                pid,
                calls,
                requests=requests,
                concurrency=concurrency,
                idle_cpu_rate=idle_rate,
                bare_url=bare_url,
                bare_pid=bare.pid,
            )
        )
        stock_figures: dict[str, Any] | None = None
        if stock is not None:
            stock_url, stock_pid = stock
            stock_idle = _idle_rate(stock_url, stock_pid, idle_seconds)
            stock_routes = asyncio.run(
                _measure_routes(
                    stock_url,
                    stock_pid,
                    calls,
                    requests=requests,
                    concurrency=concurrency,
                    idle_cpu_rate=stock_idle,
                    bare_url=bare_url,
                    bare_pid=bare.pid,
                )
            )
            stock_figures = {
                "idle_cpu_cores": round(stock_idle, 4),
                "routes": stock_routes,
                "cpu_us_per_turn_from_routes": per_turn_sum(stock_routes, "cpu_us_per_request"),
                "own_cpu_us_per_turn": per_turn_sum(stock_routes, "own_cpu_us_per_request"),
            }
    for route, figures in routes.items():
        log(
            f"  service cost {route}: {figures['cpu_us_per_request']:.0f} us CPU/request, bare exchange "
            f"{figures['bare_cpu_us_per_request']:.0f} us"
        )
    prof = profile(url, pid, calls, seconds=profile_seconds, concurrency=concurrency, out_dir=out_dir)
    return {
        "requests_per_route": requests,
        "concurrency": concurrency,
        "idle_cpu_cores": round(idle_rate, 4),
        "calls_per_turn": per_turn,
        "routes": routes,
        "cpu_us_per_turn_from_routes": per_turn_sum(routes, "cpu_us_per_request"),
        "bare_cpu_us_per_turn": per_turn_sum(routes, "bare_cpu_us_per_request"),
        "own_cpu_us_per_turn": per_turn_sum(routes, "own_cpu_us_per_request"),
        "profile": prof,
        **({"stock_service": stock_figures} if stock_figures else {}),
    }
