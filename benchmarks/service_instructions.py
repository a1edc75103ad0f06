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
* ``groups``: callgrind, the instructions of each route split into groups of functions (:data:`GROUPS`:
  middleware, body decoding, validation, the operation, extension scan, codec, reducer, outbox, the
  service's saver layer, the stock LangGraph saver methods, answer encoding, the rest), each request's
  instructions going to the innermost group running, with the saver calls on the loop's thread (one
  conversation a batch, one batch a group); then the stock saver alone (``InMemorySaver`` or
  ``PostgresSaver`` with the service's verbatim serde) making the same calls.
* ``stock``: the CPU time of those stock saver calls (on PostgreSQL also ``AsyncPostgresSaver`` on the
  event loop).
* ``statements``: on PostgreSQL, the statements each route's requests send (counted in the process, by
  their first words) and the transactions they commit (``pg_stat_database.xact_commit`` of the database,
  read before and after each route's batches, after PostgreSQL's one-second stats interval).
* ``delivery``: on PostgreSQL, the deliverer alone: rounds of ``--namespaces`` threads' pruned messages
  (two each) recorded, then claimed and delivered by the default extractor into the backend's store; the
  CPU time per delivered message (best and median of ``--rounds``), the statements a claim sends, and per
  message the WAL of the recording and of the delivery: records, bytes (full-page images apart) and
  B-tree tuples inserted, of the outbox's table and indexes and of the whole database's relations, and
  the outbox table's updates and HOT updates (read back with ``pg_walinspect``, which the mode creates
  in the database: a superuser's database of its own).
* ``hop``: the worker-thread hop alone: a no-op through ``SaverPool.call`` and ``loop.run_in_executor``
  against an inline call, wall and CPU time per call.

``--inline`` (cpu, callgrind) runs the saver calls on the loop's thread: against the default, the cost of
the worker-thread hop.

    python -m benchmarks.service_instructions --mode cpu
    python -m benchmarks.service_instructions --mode callgrind --database postgresql://postgres@127.0.0.1/db
    python -m benchmarks.service_instructions --mode groups --database postgresql://postgres@127.0.0.1/db
    python -m benchmarks.service_instructions --mode statements --database postgresql://postgres@127.0.0.1/db
    python -m benchmarks.service_instructions --mode delivery --database postgresql://postgres@127.0.0.1/db
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROUTES = ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get")
WINDOW = 20  # the benchmark suite's --max-messages

_SHIM = r"""
#include <valgrind/callgrind.h>
void rs_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void rs_zero(void) { CALLGRIND_ZERO_STATS; }
void rs_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
void rs_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def _settings(database: str) -> Any:
    from reducing_saver.service.configuration.settings import Settings

    # No delivery from this process: its polling is not per-request work (the outbox rows still are).
    return Settings(database=database, max_messages=WINDOW, extract=False, log_level="info")


async def _open_app(database: str) -> Any:
    from reducing_saver.service.http.app import create_app
    from reducing_saver.service.http.observability import configure_logging

    settings = _settings(database)
    configure_logging(settings, stream=open(os.devnull, "w"))  # noqa: ASYNC230, SIM115 - lives as long as the process
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
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": exchange["method"],
        "scheme": "http",
        "path": exchange["path"],
        "raw_path": exchange["path"].encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "state": {},
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


def _batches(
    shapes: dict[str, list[dict[str, Any]]], rounds: int
) -> dict[str, list[list[tuple[dict, bytes]]]]:
    """The requests of each route split into ``rounds + 1`` batches (the first warms up): no request repeats."""
    out: dict[str, list[list[tuple[dict, bytes]]]] = {}
    for route, exchanges in shapes.items():
        # Whole conversations per batch, so each batch's puts and gets look alike.
        requests = [(_scope(exchange), exchange["body"]) for exchange in exchanges]
        size = len(requests) // (rounds + 1)
        out[route] = [requests[index * size : (index + 1) * size] for index in range(rounds + 1)]
    return out


async def _measure(
    database: str,
    shapes: dict[str, list[dict[str, Any]]],
    *,
    mode: str,
    rounds: int,
    top: int,
    inline: bool = False,
) -> dict[str, Any]:
    app = await _open_app(database)
    if inline:  # the saver calls on the loop's thread: without the worker-thread hop
        from reducing_saver.service.storage import SaverPool

        async def on_loop(self: Any, fn: Any) -> Any:
            with self.borrow() as saver, self._wrap_exceptions():
                return fn(saver)

        SaverPool.call = on_loop  # type: ignore[method-assign]
    batches = _batches(shapes, rounds)
    results: dict[str, Any] = {}
    if mode == "stock":
        results = await _stock_cpu(app, batches, database, rounds)
        app.state.service.close()
        return results
    if mode == "statements":
        results = await _statements(app, batches, database)
        app.state.service.close()
        return results
    if mode == "groups":
        shim = _load_shim()
        shim.rs_start()
        await _groups(app, batches, shim, database)
        app.state.service.close()
        return results
    # Warm up every route (imports, caches, adapters) with the first batch of each.
    for route in ROUTES:
        await _replay(app, batches[route][0])
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


def _statement_kind(query: Any, cursor: Any = None) -> str:
    """A statement's first words, enough to tell the service's statements apart."""
    text = query.as_string(cursor) if hasattr(query, "as_string") else query
    if isinstance(text, bytes):
        text = text.decode()
    if not str(text).strip():
        return "(empty: psycopg_pool's connection check)"
    words = " ".join(str(text).split()).split(" ")
    head = " ".join(words[:2])
    # A WITH statement's own verb comes after its CTEs: look at all of it.
    scope = words if words[0] == "WITH" else words[:12]
    for keyword in ("INTO", "FROM", "UPDATE"):
        if keyword in scope:
            at = words.index(keyword)
            return f"{head} .. {keyword} {words[at + 1] if at + 1 < len(words) else ''}".strip()
    return " ".join(words[:4])


@contextlib.contextmanager
def _counting_statements(counts: collections.Counter[str]) -> Iterator[None]:
    """While it runs, every statement a psycopg cursor sends is counted in ``counts`` by its kind
    (``executemany``: once per parameter set)."""
    import psycopg

    execute, executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany

    def counted_execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        counts[_statement_kind(query, self)] += 1
        return execute(self, query, *args, **kwargs)

    def counted_executemany(self: Any, query: Any, params_seq: Any, *args: Any, **kwargs: Any) -> Any:
        params_seq = list(params_seq)
        counts[_statement_kind(query, self)] += len(params_seq)
        return executemany(self, query, params_seq, *args, **kwargs)

    psycopg.Cursor.execute, psycopg.Cursor.executemany = counted_execute, counted_executemany  # type: ignore[method-assign]
    try:
        yield
    finally:
        psycopg.Cursor.execute, psycopg.Cursor.executemany = execute, executemany  # type: ignore[method-assign]


async def _statements(
    app: Any, batches: dict[str, list[list[tuple[dict, bytes]]]], database: str
) -> dict[str, Any]:
    """``statements`` mode: per route, the statements sent and the transactions committed per request."""
    import psycopg

    if database.startswith("memory"):
        raise SystemExit("statements mode needs --database postgresql://...")
    counts: collections.Counter[str] = collections.Counter()
    name = database.rsplit("/", 1)[1].split("?")[0]
    server = database.rsplit("/", 1)[0]
    monitor = psycopg.connect(f"{server}/postgres", autocommit=True)

    def committed() -> int:
        time.sleep(1.2)  # backends report their counters at most once a second
        row = monitor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)
        ).fetchone()
        return int(row[0])

    for route in ROUTES:  # the warm-up batch, uncounted
        await _replay(app, batches[route][0])
    results: dict[str, Any] = {}
    try:
        with _counting_statements(counts):
            for route in ROUTES:
                requests = [request for batch in batches[route][1:] for request in batch]
                counts.clear()
                before = committed()
                await _replay(app, requests)
                transactions = committed() - before
                results[route] = {
                    "requests": len(requests),
                    "transactions": round(transactions / len(requests), 2),
                    "statements": round(sum(counts.values()) / len(requests), 2),
                    "by_statement": {
                        kind: round(count / len(requests), 2) for kind, count in counts.most_common()
                    },
                }
    finally:
        monitor.close()
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
            "top_own_us": [
                [
                    round(own * per, 1),
                    calls // len(requests) if calls >= len(requests) else round(calls / len(requests), 2),
                    name,
                ]
                for own, _, calls, name in sorted(rows, reverse=True)[:top]
            ],
            "top_inclusive_us": [
                [round(inclusive * per, 1), name]
                for _, inclusive, _, name in sorted(rows, key=lambda row: -row[1])[:top]
            ],
        }
    return results


# -- groups: where a request's instructions go ----------------------------------------------------

#: Groups of the ``groups`` mode, each a set of functions; a request's instructions go to the innermost
#: group running (exclusive), the rest (Starlette's entry, glue, the replay itself) to ``other``.
GROUPS = (
    "observability",
    "security middleware",
    "hot path",
    "msgpack decode",
    "validation",
    "operation",
    "extension scan",
    "messages codec",
    "reducer",
    "outbox",
    "saver extras",
    "stock saver",
    "answer encoding",
    "encryption",
)


def _group_targets() -> dict[str, list[tuple[Any, str]]]:
    """(owner, attribute) of each group's functions."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.checkpoint.postgres import PostgresSaver
    from pydantic import TypeAdapter

    from reducing_saver.reducer import ReducingSaver
    from reducing_saver.service.encryption.saver import EncryptingSaver
    from reducing_saver.service.extraction.recorder import Memory
    from reducing_saver.service.http import auth, guard, hotpath, msgpack_body, observability
    from reducing_saver.service.messages_codec import SafeMessagesCodec
    from reducing_saver.service.operations import saver as ops
    from reducing_saver.service.storage.inmemory.saver import InMemoryLifecycleSaver
    from reducing_saver.service.storage.postgres.saver import PostgresLifecycleSaver

    return {
        "observability": [
            (observability.ObservabilityMiddleware, "__call__"),
            *[(observability.MeasuringCodec, name) for name in ("decode", "encode")],
        ],
        "security middleware": [
            (auth.AuthMiddleware, "__call__"),
            (guard.BodySizeLimit, "__call__"),
            (guard.BodyGuard, "__call__"),
        ],
        "hot path": [(hotpath.HotPath, "__call__")],
        "msgpack decode": [(msgpack_body, "decode")],
        "validation": [(TypeAdapter, "validate_python"), (TypeAdapter, "validate_json")],
        "operation": [(ops, "put_checkpoint"), (ops, "put_writes"), (ops, "get_checkpoint")],
        "extension scan": [(ops, "_check_extensions")],
        "messages codec": [(SafeMessagesCodec, "decode"), (SafeMessagesCodec, "encode")],
        "reducer": [(ReducingSaver, "_reduce")],
        "outbox": [(Memory, "record"), (Memory, "with_checkpoint")],
        "saver extras": [
            (cls, name)
            for cls in (InMemoryLifecycleSaver, PostgresLifecycleSaver)
            for name in ("put", "put_writes", "get_tuple")
        ],
        "stock saver": [
            (InMemorySaver, "put"),
            (InMemorySaver, "put_writes"),
            (InMemorySaver, "get_tuple"),
            (PostgresSaver, "put"),
            (PostgresSaver, "put_writes"),
            (PostgresSaver, "get_tuple"),
            (PostgresSaver, "_load_checkpoint_tuple"),
        ],
        "answer encoding": [(hotpath, "ormsgpack"), (ops, "_tuple_out")],
        # Under --encryption (REDUCING_SAVER_ENCRYPTION): sealing and opening around the backend's calls.
        "encryption": [
            (EncryptingSaver, "put"),
            (EncryptingSaver, "put_writes"),
            (EncryptingSaver, "get_tuple"),
        ],
    }


class _Attribution:
    """Wrappers that keep callgrind collecting only while ``target`` is the innermost group running."""

    def __init__(self, shim: Any) -> None:
        self.shim = shim
        self.stack: list[str] = []
        self.target: str | None = None
        self.on = False
        self.toggles = 0

    def _sync(self) -> None:
        want = self.target is not None and (self.stack[-1] if self.stack else "other") == self.target
        if want != self.on:
            self.shim.rs_toggle()
            self.on = want
            self.toggles += 1

    def enter(self, group: str) -> None:
        self.stack.append(group)
        self._sync()

    def leave(self) -> None:
        self.stack.pop()
        self._sync()

    def wrap(self, group: str, fn: Any) -> Any:
        import contextlib
        import functools
        import inspect
        import types

        this = self
        if isinstance(fn, types.ModuleType):  # ormsgpack: its packb
            packb = this.wrap(group, fn.packb)
            return types.SimpleNamespace(packb=packb)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                this.enter(group)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    this.leave()

            return wrapped_async
        if getattr(fn, "__wrapped__", None) is not None and inspect.isgeneratorfunction(fn.__wrapped__):

            @contextlib.contextmanager
            def wrapped_cm(*args: Any, **kwargs: Any) -> Any:  # a @contextmanager: its entry and exit
                this.enter(group)
                try:
                    manager = fn(*args, **kwargs)
                    manager.__enter__()
                finally:
                    this.leave()
                try:
                    yield
                except BaseException:
                    this.enter(group)
                    try:
                        if not manager.__exit__(*sys.exc_info()):
                            raise
                    finally:
                        this.leave()
                else:
                    this.enter(group)
                    try:
                        manager.__exit__(None, None, None)
                    finally:
                        this.leave()

            return wrapped_cm

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            this.enter(group)
            try:
                return fn(*args, **kwargs)
            finally:
                this.leave()

        return wrapped


async def _groups(
    app: Any, batches: dict[str, list[list[tuple[dict, bytes]]]], shim: Any, database: str
) -> None:
    """Per route, one batch (one conversation) each: the whole replay with the saver call on the loop's
    thread (as in ``profile``: callgrind collects one thread here; ``callgrind`` mode's figure less this
    one is the worker-thread hop), the replay into a no-op app (the harness), one batch per group
    (exclusive), then the stock saver alone on the same calls. Dumps are named ``route part count``."""
    from reducing_saver.service.storage import SaverPool

    captured: dict[str, list[tuple[str, tuple]]] = {route: [] for route in ROUTES}
    _capture_stock_calls(captured, batches)
    for route in ROUTES:  # (the warm-up, with the calls to replay into the stock saver captured)
        captured["now"] = captured[route]  # type: ignore[assignment]
        await _replay(app, batches[route][0])
    captured.pop("now")
    _uncapture()

    async def inline(self: Any, fn: Any) -> Any:
        with self.borrow() as saver, self._wrap_exceptions():
            return fn(saver)

    pooled = SaverPool.call
    SaverPool.call = inline  # type: ignore[method-assign]

    async def noop(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    attribution = _Attribution(shim)
    targets = _group_targets()
    originals = {
        (owner, name): getattr(owner, name) for entries in targets.values() for owner, name in entries
    }
    hotpath = _find_hotpath(app)
    for route in ROUTES:
        if route == ROUTES[2]:
            # The warm-up read threads not yet written: each thread's first read since its puts is a full
            # one; in a chat a run's read follows its thread's last put, which keeps the latest-checkpoint
            # cache (PostgreSQL) current. Those first reads, unmeasured.
            for batch in batches[route][1:]:
                await _replay(app, batch)
        parts = iter(batches[route][1:])
        for part in ("inline", "harness", *GROUPS, "other"):
            batch = next(parts)
            if part in ("inline", "harness"):
                shim.rs_zero()
                shim.rs_toggle()
                await _replay(noop if part == "harness" else app, batch)
                shim.rs_toggle()
                shim.rs_dump(f"{route} {part} {len(batch)}".encode())
                continue
            for group, entries in targets.items():
                for owner, name in entries:
                    setattr(owner, name, attribution.wrap(group, originals[owner, name]))
            saved_routes = hotpath.routes
            hotpath.routes = {
                path: (adapter, attribution.wrap("operation", op), ok)
                for path, (adapter, op, ok) in saved_routes.items()
            }
            attribution.target, attribution.toggles = part, 0
            shim.rs_zero()
            attribution.enter("other")
            await _replay(app, batch)
            attribution.leave()
            attribution.target = None
            attribution._sync()
            shim.rs_dump(f"{route} {part} {len(batch)} toggles={attribution.toggles}".encode())
            hotpath.routes = saved_routes
            for (owner, name), original in originals.items():
                setattr(owner, name, original)
    SaverPool.call = pooled  # type: ignore[method-assign]
    # The toggles' own cost: empty pairs.
    shim.rs_zero()
    for _ in range(1000):
        shim.rs_toggle()
        shim.rs_toggle()
    shim.rs_dump(b"calibration toggles 1000")
    _stock(captured, database, shim, len(batches[ROUTES[2]][1]))


_STOCK_METHODS = {
    "/v1/checkpoints/put": "put",
    "/v1/writes/put": "put_writes",
    "/v1/checkpoints/get": "get_tuple",
}
_patched: list[tuple[Any, str, Any]] = []


def _capture_stock_calls(captured: dict[str, Any], batches: Any) -> None:
    """Keep the arguments the stock saver methods get during the warm-up (in ``captured["now"]``)."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.checkpoint.postgres import PostgresSaver

    for cls in (InMemorySaver, PostgresSaver):
        for name in ("put", "put_writes", "get_tuple"):
            original = getattr(cls, name)

            def keep(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
                captured["now"].append((_name, args))
                return _original(self, *args)

            _patched.append((cls, name, original))
            setattr(cls, name, keep)


def _uncapture() -> None:
    for cls, name, original in _patched:
        setattr(cls, name, original)
    _patched.clear()


def _stock_calls(
    captured: dict[str, Any], route: str, prefix: str, latest_thread: str, gets: int
) -> list[tuple[str, tuple]]:
    """The stock saver calls ``route``'s requests made, on threads renamed ``prefix`` + their id; for the
    latest-checkpoint read, ``gets`` reads of the latest checkpoint of the thread the puts wrote."""
    calls = [(name, args) for name, args in captured[route] if name == _STOCK_METHODS[route]]
    if route == ROUTES[2]:
        calls = [("get_tuple", ({"configurable": {"thread_id": latest_thread, "checkpoint_ns": ""}},))] * gets
    renamed = []
    for name, args in calls:
        configurable = {**args[0]["configurable"]}
        configurable["thread_id"] = prefix + str(configurable["thread_id"])
        renamed.append((name, ({**args[0], "configurable": configurable}, *args[1:])))
    return renamed


def _stock(
    captured: dict[str, list[tuple[str, tuple]]], database: str, shim: Any, gets: int, rounds: int = 1
) -> dict[str, Any]:
    """The stock saver (``InMemorySaver``, ``PostgresSaver`` on one connection, both with the service's
    verbatim serde: the client's bytes in, the same bytes out) making the same calls on fresh threads:
    the part of a request no service can avoid. A warm-up on threads of their own, then ``rounds``
    measured on others (callgrind dumps with ``shim``; the CPU time per call, best and median)."""
    from langgraph.checkpoint.memory import InMemorySaver

    from reducing_saver.service.storage.serde import VerbatimSerde

    if database.startswith("memory"):
        saver: Any = InMemorySaver(serde=VerbatimSerde())
    else:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row

        connection = psycopg.connect(database, autocommit=True, prepare_threshold=0, row_factory=dict_row)
        saver = PostgresSaver(connection, serde=VerbatimSerde())
    puts = [(name, args) for name, args in captured[ROUTES[0]] if name == "put"]
    latest_thread = str(puts[-1][1][0]["configurable"]["thread_id"])
    timings: dict[str, list[float]] = {route: [] for route in ROUTES}
    for prefix in ("stock-warm-", *(f"stock-{index}-" for index in range(rounds))):
        measured = prefix != "stock-warm-"
        for route in ROUTES:
            calls = _stock_calls(captured, route, prefix, latest_thread, gets)
            if shim is not None:
                shim.rs_zero()
            used = time.process_time()
            for name, args in calls:
                if measured and shim is not None:
                    shim.rs_toggle()
                getattr(saver, name)(*args)
                if measured and shim is not None:
                    shim.rs_toggle()
            if measured:
                timings[route].append((time.process_time() - used) * 1e6 / len(calls))
                if shim is not None:
                    shim.rs_dump(f"{route} stock-alone {len(calls)}".encode())
    return {
        route: {"cpu_us_best": round(min(values), 1), "cpu_us_median": round(statistics.median(values), 1)}
        for route, values in timings.items()
    }


async def _stock_cpu(
    app: Any, batches: dict[str, list[list[tuple[dict, bytes]]]], database: str, rounds: int
) -> dict[str, Any]:
    """``stock`` mode: the stock saver's CPU time on the calls the service's saver gets (one conversation's)."""
    captured: dict[str, Any] = {route: [] for route in ROUTES}
    _capture_stock_calls(captured, batches)
    for route in ROUTES:
        captured["now"] = captured[route]
        await _replay(app, batches[route][0])
    captured.pop("now")
    _uncapture()
    gets = len(batches[ROUTES[2]][1])
    results = {"sync": _stock(captured, database, None, gets, rounds)}
    if not database.startswith("memory"):
        results["async"] = await _stock_async(captured, database, gets, rounds)
    return results


async def _stock_async(captured: dict[str, Any], database: str, gets: int, rounds: int) -> dict[str, Any]:
    """The same calls through ``AsyncPostgresSaver`` on the event loop (no worker thread)."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg import AsyncConnection
    from psycopg.rows import dict_row

    from reducing_saver.service.storage.serde import VerbatimSerde

    connection = await AsyncConnection.connect(
        database, autocommit=True, prepare_threshold=0, row_factory=dict_row
    )
    saver = AsyncPostgresSaver(connection, serde=VerbatimSerde())
    puts = [(name, args) for name, args in captured[ROUTES[0]] if name == "put"]
    latest_thread = str(puts[-1][1][0]["configurable"]["thread_id"])
    timings: dict[str, list[float]] = {route: [] for route in ROUTES}
    for prefix in ("astock-warm-", *(f"astock-{index}-" for index in range(rounds))):
        for route in ROUTES:
            calls = _stock_calls(captured, route, prefix, latest_thread, gets)
            used = time.process_time()
            for name, args in calls:
                await getattr(saver, "a" + name)(*args)
            if prefix != "astock-warm-":
                timings[route].append((time.process_time() - used) * 1e6 / len(calls))
    await connection.close()
    return {
        route: {"cpu_us_best": round(min(values), 1), "cpu_us_median": round(statistics.median(values), 1)}
        for route, values in timings.items()
    }


def _find_hotpath(app: Any) -> Any:
    from reducing_saver.service.http.hotpath import HotPath

    layer = app.middleware_stack
    while not isinstance(layer, HotPath):
        layer = layer.app
    return layer


async def _hop(calls: int, rounds: int) -> dict[str, Any]:
    """The thread hop alone: a no-op call awaited inline, through ``SaverPool.call`` (the service's
    worker threads) and through ``loop.run_in_executor``; wall and process CPU time per call, best and
    median of ``rounds``."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from reducing_saver.service.storage import SaverPool

    pool = SaverPool([SimpleNamespace(capabilities=frozenset()) for _ in range(2)], timeout=5.0)  # type: ignore[misc]
    executor = ThreadPoolExecutor(2)
    loop = asyncio.get_running_loop()

    def work(_: Any = None) -> int:
        return 1

    async def inline() -> None:
        work()

    async def saver_pool() -> None:
        await pool.call(work)

    async def executor_call() -> None:
        await loop.run_in_executor(executor, work)

    results: dict[str, Any] = {}
    for name, fn in (("inline", inline), ("SaverPool.call", saver_pool), ("run_in_executor", executor_call)):
        for _ in range(200):
            await fn()
        wall, cpu = [], []
        for _ in range(rounds):
            started, used = time.perf_counter(), time.process_time()
            for _ in range(calls):
                await fn()
            wall.append((time.perf_counter() - started) * 1e6 / calls)
            cpu.append((time.process_time() - used) * 1e6 / calls)
        results[name] = {
            "wall_us_best": round(min(wall), 1),
            "wall_us_median": round(statistics.median(wall), 1),
            "cpu_us_best": round(min(cpu), 1),
            "cpu_us_median": round(statistics.median(cpu), 1),
        }
    pool.close()
    executor.shutdown()
    return results


def _load_shim() -> Any:
    folder = Path(tempfile.mkdtemp(prefix="rs-callgrind-"))
    (folder / "shim.c").write_text(_SHIM)
    subprocess.run(
        ["cc", "-O1", "-shared", "-fPIC", "-o", str(folder / "shim.so"), str(folder / "shim.c")], check=True
    )
    shim = ctypes.CDLL(str(folder / "shim.so"))
    shim.rs_dump.argtypes = [ctypes.c_char_p]
    return shim


def _callgrind(argv: list[str], keep: str | None, *, groups: bool = False) -> dict[str, Any]:
    """Run this module under callgrind (``--inner``) and read the instructions per request of each dump
    (kept in ``keep``, for ``callgrind_annotate``, when given)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("callgrind mode needs valgrind")
    with tempfile.TemporaryDirectory() as temporary:
        folder = keep or temporary
        Path(folder).mkdir(parents=True, exist_ok=True)
        out = Path(folder) / "callgrind.out"
        subprocess.run(
            [
                valgrind,
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}.%p",
                *(["--collect-atstart=no"] if groups else []),
                sys.executable,
                "-m",
                "benchmarks.service_instructions",
                *argv,
                "--inner",
            ],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        dumps: list[tuple[str, str, int, int, int]] = []  # (route, part, requests, instructions, toggles)
        for dump in sorted(Path(folder).glob("callgrind.out.*")):
            text = dump.read_text(errors="replace")
            trigger = next((line for line in text.splitlines() if line.startswith("desc: Trigger:")), "")
            if "Client Request:" not in trigger:
                continue
            words = trigger.split("Client Request:", 1)[1].split()
            toggles = sum(int(word.split("=")[1]) for word in words if word.startswith("toggles="))
            words = [word for word in words if not word.startswith("toggles=")]
            total = next(
                int(line.split()[1]) for line in text.splitlines() if line.startswith(("summary:", "totals:"))
            )
            dumps.append((words[0], " ".join(words[1:-1]), int(words[-1]), total, toggles))
    if groups:
        return _group_table(dumps)
    figures: dict[str, list[float]] = {}
    for route, _, count, total, _ in dumps:
        figures.setdefault(route, []).append(total / count)
    return {
        route: {
            "instructions_best": round(min(values)),
            "instructions_median": round(statistics.median(values)),
            "spread_pct": round(100 * (max(values) - min(values)) / min(values), 2),
        }
        for route, values in figures.items()
    }


def _group_table(dumps: list[tuple[str, str, int, int, int]]) -> dict[str, Any]:
    """Instructions per request by group. The wrappers cost instructions at each boundary of the group
    measured (its toggles, calibrated, and their Python frames): each group's figure loses its
    boundaries' share, with the per-boundary cost that makes the groups add up to the inline total."""
    pair = next((total / count for route, _, count, total, _ in dumps if route == "calibration"), 0.0)
    out: dict[str, Any] = {"toggle_pair_instructions": round(pair)}
    for route in dict.fromkeys(route for route, *_ in dumps if route != "calibration"):
        rows = {
            part: (total / count, toggles / count)
            for name, part, count, total, toggles in dumps
            if name == route
        }
        inline, harness = rows["inline"][0], rows["harness"][0]
        groups = {part: row for part, row in rows.items() if part not in ("inline", "harness", "stock-alone")}
        excess = sum(raw for raw, _ in groups.values()) - inline
        boundaries = sum(toggles for _, toggles in groups.values())
        each = excess / boundaries if boundaries else 0.0
        out[route] = {
            "inline": round(inline),
            "harness": round(harness),
            "per_boundary_instructions": round(each),
            "groups": {part: round(raw - toggles * each) for part, (raw, toggles) in groups.items()},
            "stock saver alone": round(rows["stock-alone"][0] - pair) if "stock-alone" in rows else None,
        }
    return out


class _OutboxWal:
    """What the outbox costs PostgreSQL: the WAL records written to its table and indexes (and to the
    whole database's relations), read back with ``pg_walinspect`` (created in the database: a superuser's
    work)."""

    #: B-tree records that add a tuple to a leaf page.
    INDEX_INSERTS = ("INSERT_LEAF", "INSERT_POST", "SPLIT_L", "SPLIT_R")

    def __init__(self, database: str) -> None:
        import psycopg

        from reducing_saver.service.storage.outbox import TABLE

        self._conn = psycopg.connect(database, autocommit=True)
        self._conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        self._database_oid = self._conn.execute(
            "SELECT oid FROM pg_database WHERE datname = current_database()"
        ).fetchone()[0]
        # The table, its indexes, its TOAST table and that one's index, by the file their WAL names.
        self._relations = dict(
            self._conn.execute(
                "SELECT c.relfilenode::text, CASE WHEN c.relname LIKE 'pg_toast%%' THEN 'toast' "
                "ELSE c.relname END FROM pg_class c, pg_class t WHERE t.oid = %s::regclass "
                "AND (c.oid IN (t.oid, t.reltoastrelid) OR c.oid IN (SELECT indexrelid FROM pg_index "
                "WHERE indrelid IN (t.oid, t.reltoastrelid)))",
                (TABLE,),
            ).fetchall()
        )

    def close(self) -> None:
        self._conn.close()

    def lsn(self) -> Any:
        # Flushed: what a commit wrote is, and a later statement writes beyond it.
        return self._conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone()[0]

    def since(self, start: Any, end: Any) -> list[tuple[str, str, str, int, int]]:
        """The WAL records between two LSNs that touched this database's relations (commit records, which
        name none, left out): ``(relation, resource manager, record type, length, full-page image
        length)``, the relation the outbox's name for its own, ``"other"`` for the rest."""
        rows = self._conn.execute(
            "SELECT substring(block_ref FROM 'rel [0-9]+/[0-9]+/([0-9]+)'), resource_manager, record_type, "
            "record_length, fpi_length FROM pg_get_wal_records_info(%s, %s) "
            "WHERE block_ref LIKE %s",
            (start, end, f"%/{self._database_oid}/%"),
        ).fetchall()
        return [(self._relations.get(node, "other"), *rest) for node, *rest in rows]

    @classmethod
    def per_message(cls, records: list[tuple[str, str, str, int, int]], messages: int) -> dict[str, Any]:
        """WAL records, bytes (full-page images apart) and index tuples inserted per message: the
        outbox's relations, and the whole database's; the outbox table's updates and how many of them
        were HOT; the outbox's records by relation and type."""
        from reducing_saver.service.storage.outbox import TABLE

        outbox = [r for r in records if r[0] != "other"]
        kinds = collections.Counter(f"{r[0]} {r[2]}" for r in outbox)
        updates = [r[2] for r in outbox if r[0] == TABLE and r[1] == "Heap" and "UPDATE" in r[2]]

        def figures(rows: list[tuple[str, str, str, int, int]]) -> dict[str, float]:
            return {
                "records": round(len(rows) / messages, 2),
                "bytes": round(sum(r[3] - r[4] for r in rows) / messages),
                "fpi_bytes": round(sum(r[4] for r in rows) / messages),
                "index_inserts": round(
                    sum(1 for r in rows if r[1] == "Btree" and r[2] in cls.INDEX_INSERTS) / messages, 2
                ),
            }

        return {
            "outbox": figures(outbox),
            "database": figures(records),
            "outbox_updates": round(len(updates) / messages, 2),
            "outbox_hot_updates": round(sum(1 for kind in updates if kind.startswith("HOT")) / messages, 2),
            "outbox_by_record": {kind: round(n / messages, 2) for kind, n in sorted(kinds.items())},
        }


def _delivery(database: str, namespaces: int, rounds: int) -> dict[str, Any]:
    """``delivery`` mode (see the module's docstring)."""
    from langchain_core.messages import AIMessage, HumanMessage

    from reducing_saver.service.extraction.deliverer import Deliverer
    from reducing_saver.service.extraction.extractors import StoreExtractor
    from reducing_saver.service.storage import open_backend
    from reducing_saver.service.storage.outbox import make_entries

    if database.startswith(("memory", "sqlite")):
        raise SystemExit("delivery mode needs --database postgresql://...")
    backend = open_backend(database, pool_size=2, timeout=30.0)
    outbox, store = backend.outbox(), backend.store()
    deliverer = Deliverer(outbox, StoreExtractor(store))
    wal = _OutboxWal(database)
    counts: collections.Counter[str] = collections.Counter()
    run = uuid.uuid4().hex[:8]
    per_message: list[float] = []
    statements: list[int] = []
    recorded: list[tuple[str, str, str, int, int]] = []
    claimed: list[tuple[str, str, str, int, int]] = []
    delivered_total = 0
    try:
        for round_ in range(rounds + 1):  # the first warms up
            start = wal.lsn()
            for index in range(namespaces):
                messages = [
                    HumanMessage(f"question {round_}-{index} " + "x" * 200, id=f"h-{run}-{round_}-{index}"),
                    AIMessage(f"answer {round_}-{index} " + "y" * 400, id=f"a-{run}-{round_}-{index}"),
                ]
                outbox.record(
                    make_entries(
                        messages, ("memories", f"user-{index}"), thread_id=f"t-{index}", checkpoint_id="c"
                    )
                )
            middle = wal.lsn()
            counts.clear()
            used = time.process_time()
            with _counting_statements(counts):
                delivered = deliverer.run_once()
            if round_ and delivered:
                per_message.append((time.process_time() - used) * 1e6 / delivered)
                statements.append(sum(counts.values()))
                recorded += wal.since(start, middle)
                claimed += wal.since(middle, wal.lsn())
                delivered_total += delivered
    finally:
        wal.close()
        backend.close()
    return {
        "messages_a_claim": 2 * namespaces,
        "namespaces_a_claim": namespaces,
        "cpu_us_per_message_best": round(min(per_message), 1),
        "cpu_us_per_message_median": round(statistics.median(per_message), 1),
        "statements_a_claim": statistics.median(statements),
        "by_statement_last_claim": dict(counts.most_common()),
        "wal_per_message_recorded": _OutboxWal.per_message(recorded, delivered_total),
        "wal_per_message_delivered": _OutboxWal.per_message(claimed, delivered_total),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--database", default="memory://")
    parser.add_argument(
        "--mode",
        choices=("cpu", "callgrind", "profile", "groups", "hop", "stock", "statements", "delivery"),
        default="cpu",
    )
    parser.add_argument(
        "--conversations", type=int, default=8, help="recorded conversations of 12 turns each"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="measured batches per route (after one warm-up)"
    )
    parser.add_argument("--top", type=int, default=25, help="profile: functions shown")
    parser.add_argument("--keep", help="callgrind: keep the dumps in this folder (for callgrind_annotate)")
    parser.add_argument(
        "--inline",
        action="store_true",
        help="cpu, callgrind: the saver calls on the loop's thread (without the worker-thread hop)",
    )
    parser.add_argument(
        "--namespaces", type=int, default=8, help="delivery: threads pruned per claim (two messages each)"
    )
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode in ("callgrind", "groups") and not args.inner:
        argv = [arg for arg in sys.argv[1:] if arg != "--inner"]
        print(json.dumps(_callgrind(argv, args.keep, groups=args.mode == "groups"), indent=1))
        return
    from benchmarks.service_cost import record_turns

    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    if args.mode == "delivery":
        print(json.dumps(_delivery(args.database, args.namespaces, max(args.rounds, 5)), indent=1))
        return
    if args.mode == "hop":
        print(json.dumps(runner(_hop(5000, max(args.rounds, 5))), indent=1))
        return
    if args.mode == "groups":  # one conversation a batch: the warm-up, inline, harness, each group, other
        args.rounds = len(GROUPS) + 3
        args.conversations = args.rounds + 1
    calls = record_turns(12)
    shapes = runner(_record(args.conversations, calls))
    results = runner(
        _measure(args.database, shapes, mode=args.mode, rounds=args.rounds, top=args.top, inline=args.inline)
    )
    if args.mode not in ("callgrind", "groups"):
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
