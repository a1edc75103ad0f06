"""Per-stage queueing of the per-step routes, traced inside the service's processes (benchmark-only).

``python -m benchmarks.stages serve ARGS`` runs ``reducing-saver serve ARGS`` with the tracing below
installed in every worker process (so does ``python -m benchmarks.stock_service`` when :data:`ENV` names a
folder). The service's code is not changed: the tracing wraps ``HotPath.__call__``, ``SaverPool.call``,
``SaverPool._take`` and ``psycopg_pool.ConnectionPool.getconn`` in these processes only, so a service run
the ordinary way carries none of it. With :data:`REUSE_PORT_ENV` set it also runs an experiment of the
accept path, :func:`reuse_port` (a listening socket per worker process).

For each request of ``get_tuple``, ``put`` or ``put_writes`` a worker records, on ``CLOCK_MONOTONIC`` (one
clock for every process of the machine), in nanoseconds:

* ``sent``: when the agent sent it (the ``x-bench-sent`` header the benchmark's agents add, 0 without);
* ``arrived``: when the app got it (uvicorn has read its head): ``sent`` → ``arrived`` is the *accept*
  stage, the request waiting in the socket and the worker's event loop;
* ``wants_saver``: its body read and validated: the *decode* stage;
* ``picked``: a worker thread took the call: the *worker thread* stage (waiting for one of the pool's
  slots, then a thread);
* ``borrowed``: that thread has a saver (``SaverPool._take``);
* ``done``: the operation returned; ``pool_wait`` of it waiting in ``ConnectionPool.getconn`` (the *pool*
  stage: connections the deliverer, sweeper or cache may hold too) and ``cpu`` of its thread's CPU time;
  the rest is the *database* stage (statements, and the GIL the worker's other threads hold);
* ``resumed``: the request's coroutine is back on the event loop (the *resume* stage: the loop busy with
  other requests), and ``answered`` its answer sent; the agent notes when the answer reached it: the
  *answer* stage.

A thread of each worker appends the records to ``<folder>/<role>-<pid>.tsv`` every half second; the parent
reads them back by phase (:func:`read`) and joins them with the agents' own notes (:func:`summarize`).
"""

from __future__ import annotations

import contextvars
import os
import random
import statistics
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: The folder the workers write their records into; tracing is installed only when it is set.
ENV = "RS_BENCH_STAGES_DIR"
#: The role written into the file names (``service``, ``stock_service``).
ROLE_ENV = "RS_BENCH_STAGES_ROLE"
#: An experiment, not the service's behaviour: answer a random one in N per-step requests with
#: ``Connection: close`` (``--ab-args "--close-every N"``).
CLOSE_EVERY_ENV = "RS_BENCH_CLOSE_EVERY"
#: An experiment, not the service's behaviour: each worker process listens on a socket of its own, all of
#: them in one ``SO_REUSEPORT`` group on the service's port (``--ab-args --reuse-port``; :func:`reuse_port`).
REUSE_PORT_ENV = "RS_BENCH_REUSE_PORT"
#: The header carrying the agent's send time (``time.monotonic_ns()``).
HEADER = "x-bench-sent"
_HEADER = HEADER.encode()

FIELDS = (
    "route",
    "sent",
    "arrived",
    "wants_saver",
    "picked",
    "borrowed",
    "done",
    "resumed",
    "answered",
    "pool_wait",
    "cpu",
)
#: The stages, each from one field to the next (the agent's receive time ends the last).
STAGES = ("accept", "decode", "worker_thread", "saver", "pool", "database", "resume", "answer")

_record: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("rs_bench_stage", default=None)
_local = threading.local()


def _now() -> int:
    return time.monotonic_ns()


def install(folder: str, role: str) -> None:
    """Wrap the hot path, the saver pool and the connection pool of this process so that they record."""
    import psycopg_pool

    from reducing_saver.service.http.hotpath import HotPath
    from reducing_saver.service.storage import SaverPool
    from reducing_saver.wire import GET_PATH, PUT_PATH, WRITES_PATH

    routes = {GET_PATH: 0, PUT_PATH: 1, WRITES_PATH: 2}
    records: list[tuple[int, ...]] = []
    lock = threading.Lock()
    path = Path(folder) / f"{role}-{os.getpid()}.tsv"

    def flush() -> None:
        nonlocal records
        while True:
            time.sleep(0.5)
            with lock:
                batch, records = records, []
            if batch:
                with path.open("a", encoding="ascii") as out:
                    out.writelines("\t".join(map(str, record)) + "\n" for record in batch)

    threading.Thread(target=flush, name="stage-trace", daemon=True).start()

    hot_call = HotPath.__call__
    close_every = int(os.environ.get(CLOSE_EVERY_ENV, "0"))

    async def traced_hot_call(self: Any, scope: Any, receive: Any, send: Any) -> None:
        route = routes.get(scope.get("path")) if scope["type"] == "http" else None
        if route is None:
            await hot_call(self, scope, receive, send)
            return
        arrived = _now()
        sent = 0
        for name, value in scope["headers"]:
            if name == _HEADER:
                sent = int(value)
        # route, sent, arrived, wants_saver, picked, borrowed, done, resumed, answered, pool_wait, cpu
        record = [route, sent, arrived, 0, 0, 0, 0, 0, 0, 0, 0]
        token = _record.set(record)
        if close_every and random.random() * close_every < 1:
            inner_send = send

            async def send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message["headers"], (b"connection", b"close")]}
                await inner_send(message)

        try:
            await hot_call(self, scope, receive, send)
        finally:
            _record.reset(token)
            record[8] = _now()
            with lock:
                records.append(tuple(record))

    pool_call = SaverPool.call

    async def traced_pool_call(self: Any, fn: Any) -> Any:
        record = _record.get()
        if record is None:
            return await pool_call(self, fn)
        record[3] = _now()

        def timed(saver: Any) -> Any:
            record[4], record[5] = _local.picked, _local.borrowed
            _local.pool_wait, _local.tracing = 0, True
            cpu = time.thread_time_ns()
            try:
                return fn(saver)
            finally:
                record[6] = _now()
                record[9], record[10] = _local.pool_wait, time.thread_time_ns() - cpu
                _local.tracing = False

        try:
            return await pool_call(self, timed)
        finally:
            record[7] = _now()

    take = SaverPool._take  # every saver call's worker thread, and borrow(), take a saver here

    def traced_take(self: Any) -> Any:
        picked = _now()
        saver = take(self)
        _local.picked, _local.borrowed = picked, _now()
        return saver

    getconn = psycopg_pool.ConnectionPool.getconn

    def traced_getconn(self: Any, timeout: float | None = None) -> Any:
        if not getattr(_local, "tracing", False):
            return getconn(self, timeout)
        started = _now()
        try:
            return getconn(self, timeout)
        finally:
            _local.pool_wait += _now() - started

    HotPath.__call__ = traced_hot_call
    SaverPool.call = traced_pool_call
    SaverPool._take = traced_take
    psycopg_pool.ConnectionPool.getconn = traced_getconn


def install_from_env(role: str) -> None:
    """:func:`install` when :data:`ENV` names a folder (``ROLE_ENV`` overrides ``role``)."""
    folder = os.environ.get(ENV)
    if folder:
        install(folder, os.environ.get(ROLE_ENV, role))


def reuse_port(worker: bool) -> None:
    """A listening socket per worker process, in one ``SO_REUSEPORT`` group (the kernel hashes each new
    connection to one of the group's listening sockets), instead of one socket every worker accepts from.

    In the supervisor, ``serve``'s socket is bound with ``SO_REUSEPORT`` and never listens (a socket that
    does not listen is in no group: it holds the port and gets no connection). In each worker, before
    uvicorn starts serving, the inherited socket is closed and a new one bound to the same address, which
    uvicorn then listens on: a worker that dies takes its socket out of the group, its replacement adds one.
    ``worker``: whether this process is a worker (this module imported as ``__mp_main__``).
    """
    import socket

    def reusing(family: int) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return sock

    if not worker:
        from reducing_saver.service import cli

        bind = cli._bind

        def reuse_bind(host: str, port: int) -> socket.socket:
            sock = reusing(socket.AF_INET6 if ":" in host else socket.AF_INET)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                return bind(host, port)  # its error message
            sock.set_inheritable(True)
            return sock

        cli._bind = reuse_bind
        return

    import uvicorn

    startup = uvicorn.Server.startup

    async def own_socket_startup(self: Any, sockets: list[socket.socket] | None = None) -> None:
        if sockets:
            own = []
            for inherited in sockets:
                sock = reusing(inherited.family)
                sock.bind(inherited.getsockname()[:2])
                inherited.close()
                own.append(sock)
            sockets = own
        await startup(self, sockets)

    uvicorn.Server.startup = own_socket_startup  # type: ignore[method-assign]


# -- the parent's side ----------------------------------------------------------------------------------


def read(folder: Path, role: str, start_ns: int, end_ns: int, clear: bool = False) -> list[tuple[int, ...]]:
    """The records of ``role``'s workers whose request arrived in ``[start_ns, end_ns)``, with the worker's
    pid appended; ``clear``: empty the files after reading (the next phase starts afresh)."""
    out = []
    for path in folder.glob(f"{role}-*.tsv"):
        pid = int(path.stem.rsplit("-", 1)[1])
        with path.open(encoding="ascii") as lines:
            for line in lines:
                record = tuple(int(value) for value in line.split("\t"))
                if start_ns <= record[2] < end_ns:
                    out.append((*record, pid))
        if clear:
            os.truncate(path, 0)
    return out


def agents_by_worker(records: Iterable[tuple[int, ...]], sent: list[int], agents: list[int]) -> list[int]:
    """How many agents each worker process served most of the requests of, most first (``sent``, ``agents``:
    the agents' notes)."""
    agent_of = dict(zip(sent, agents, strict=True))
    counts: dict[int, dict[int, int]] = {}
    for record in records:
        agent = agent_of.get(record[1])
        if agent is not None:
            by_pid = counts.setdefault(agent, {})
            by_pid[record[-1]] = by_pid.get(record[-1], 0) + 1
    served: dict[int, int] = {}
    for by_pid in counts.values():
        pid = max(by_pid, key=by_pid.__getitem__)
        served[pid] = served.get(pid, 0) + 1
    return sorted(served.values(), reverse=True)


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]

    return {
        "median": round(at(0.5), 3),
        "p95": round(at(0.95), 3),
        "p99": round(at(0.99), 3),
        "mean": round(statistics.fmean(ordered), 3),
    }


def summarize(records: Iterable[tuple[int, ...]], client: dict[int, tuple[int, int]]) -> dict[str, Any]:
    """Per stage, in ms over requests: median, p95, p99, mean; ``client``: ``{sent: (received, agent)}``
    from the agents (the requests found on both sides get the accept and the whole answer stages).

    Also per worker process: its share of the requests and of the agents, and how many agents it served
    (keep-alive connections stay on the worker that accepted them)."""
    stages: dict[str, list[float]] = {name: [] for name in (*STAGES, "server", "round_trip", "op_cpu")}
    workers: dict[int, dict[str, Any]] = {}
    joined = 0
    total = 0
    for record in records:
        (_route, sent, arrived, wants, picked, borrowed, done, resumed, answered, pool_wait, cpu, pid) = (
            record
        )
        if not done:  # refused before it reached a saver (a 4xx, a 503)
            continue
        total += 1
        stages["decode"].append((wants - arrived) / 1e6)
        stages["worker_thread"].append((picked - wants) / 1e6)
        stages["saver"].append((borrowed - picked) / 1e6)
        stages["pool"].append(pool_wait / 1e6)
        stages["database"].append((done - borrowed - pool_wait) / 1e6)
        stages["resume"].append((resumed - done) / 1e6)
        stages["op_cpu"].append(cpu / 1e6)
        stages["server"].append((answered - arrived) / 1e6)
        worker = workers.setdefault(pid, {"requests": 0, "agents": set()})
        worker["requests"] += 1
        seen = client.get(sent) if sent else None
        if seen is not None:
            received, agent = seen
            joined += 1
            stages["accept"].append((arrived - sent) / 1e6)
            stages["answer"].append((received - resumed) / 1e6)
            stages["round_trip"].append((received - sent) / 1e6)
            worker["agents"].add(agent)
        else:
            stages["answer"].append((answered - resumed) / 1e6)
    by_worker = {
        str(pid): {
            "requests": w["requests"],
            "agents": len(w["agents"]),
            "share": round(w["requests"] / total, 3) if total else 0.0,
        }
        for pid, w in sorted(workers.items())
    }
    return {
        "requests": total,
        "joined_with_agents": joined,
        "stages_ms": {name: _ms(values) for name, values in stages.items()},
        "by_worker": by_worker,
    }


# Installed on import when this module is the program, in the supervisor and in each spawned worker (which
# imports its parent's main module as ``__mp_main__`` before it builds the app).
if __name__ in ("__main__", "__mp_main__"):
    install_from_env("service")
    if os.environ.get(REUSE_PORT_ENV):
        reuse_port(worker=__name__ == "__mp_main__")

if __name__ == "__main__":
    import sys

    from reducing_saver.service.cli import main

    sys.exit(main())
