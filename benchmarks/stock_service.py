"""The stock-saver service: the floor under the service's figures, measured in the same run.

``python -m benchmarks.stock_service serve ARGS`` runs ``reducing-saver serve ARGS`` with its three per-step
routes (``get_tuple``, ``put``, ``put_writes``) answered by LangGraph's stock ``PostgresSaver`` and nothing
else: the same process (or ``--workers`` processes), server, middleware, request models, body decoding and
worker-thread hop as the service, on the same connection pool, but no reducer, messages codec, extension
scan, tenancy, outbox, TTL ledger or latest-checkpoint cache. A checkpoint is stored as the client sent it
(the service's ``VerbatimSerde``: bytes in, bytes out), so ``RemoteReducingSaver`` talks to it unchanged.

It is no checkpointer to use (it keeps every message, as a plain saver does). It answers what a per-call
service costs here when its own work is free and its storage is the stock saver's: the suite runs it
beside the service as one more checkpointer in the latency section, route by route in the service-cost
section and as one more mode in the throughput section; ``targets()`` reports its figures as
``floor_stock_service_*``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from langgraph.checkpoint.postgres import PostgresSaver

from reducing_saver.reducer import ReducingSaver
from reducing_saver.service.encryption import KeylessSaver
from reducing_saver.service.http import hotpath
from reducing_saver.service.operations import saver as ops
from reducing_saver.service.storage.serde import VerbatimSerde
from reducing_saver.wire import GET_PATH, PUT_PATH, WRITES_PATH, bodies, ints_from_wire

#: One stock saver per saver of the service's pool (each is lent to one call at a time), on its pool.
_stock: dict[int, PostgresSaver] = {}


def stock_saver(saver: ReducingSaver) -> PostgresSaver:
    """The stock ``PostgresSaver`` twin of one of the service's savers: the same connection pool, verbatim
    serde."""
    inner = saver.inner
    if isinstance(inner, KeylessSaver):  # --encryption off: the backend's saver is under it
        inner = inner.inner
    if not isinstance(inner, PostgresSaver):
        raise SystemExit("the stock-saver service runs on PostgreSQL only (--database postgresql://...)")
    twin = _stock.get(id(inner))
    if twin is None:
        twin = _stock[id(inner)] = PostgresSaver(inner.conn, serde=VerbatimSerde())
    return twin


def get_checkpoint(service: Any, saver: ReducingSaver, body: Any) -> dict[str, Any]:
    item = stock_saver(saver).get_tuple(ops._run_config(body["config"]))
    return bodies.GetCheckpointAnswer(checkpoint=ops._tuple_out(item) if item else None)


def put_checkpoint(service: Any, saver: ReducingSaver, body: Any) -> dict[str, Any]:
    checkpoint: dict[str, Any] = dict(body["checkpoint"])
    checkpoint["channel_values"] = {
        channel: ops._from_wire(value, f"values.{channel}", inline_ints=True)
        for channel, value in body["values"].items()
    }
    metadata = ints_from_wire(body["metadata"], "metadata")
    config = stock_saver(saver).put(
        ops._run_config(body["config"]), checkpoint, metadata, body["new_versions"]
    )
    return bodies.PutCheckpointAnswer(config=config)


def put_writes(service: Any, saver: ReducingSaver, body: Any) -> None:
    writes = [
        (channel, ops._from_wire(value, f"writes[{index}]"))
        for index, (channel, value) in enumerate(body["writes"])
    ]
    stock_saver(saver).put_writes(ops._run_config(body["config"]), writes, body["task_id"], body["task_path"])


@contextmanager
def run(log_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Any]:
    """The stock-saver service with ``serve ARGS`` in a process of its own, until the block ends (the
    suite's ``run_service``, this module standing for ``reducing-saver``)."""
    from tests.support.server import run_service

    program = (sys.executable, "-m", "benchmarks.stock_service")
    with run_service(log_dir, *args, env=env, program=program) as service:
        yield service


def install() -> None:
    """Answer the per-step routes with the stock operations above."""
    for path, op in ((GET_PATH, get_checkpoint), (PUT_PATH, put_checkpoint), (WRITES_PATH, put_writes)):
        model, _, status = hotpath.ROUTES[path]
        hotpath.ROUTES[path] = (model, op, status)


# Installed on import when this module is the program: with ``--workers N`` uvicorn spawns the workers,
# and a spawned process imports its parent's main module (as ``__mp_main__``) before it builds the app.
if __name__ in ("__main__", "__mp_main__"):
    install()
    from benchmarks import stages

    stages.install_from_env("stock_service")

if __name__ == "__main__":
    from reducing_saver.service.cli import main

    sys.exit(main())
