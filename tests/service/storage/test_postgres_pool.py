"""The PostgreSQL backend: parallel saver calls over one pool, tables created at start, bytes verbatim."""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from reducing_saver.reducer import MessageReducer, ReducingSaver
from reducing_saver.service.messages_codec import SafeMessagesCodec
from reducing_saver.service.storage import SaverPool, SaversBusy, open_backend
from reducing_saver.wire import Blob


class _Backend:
    """The PostgreSQL backend and a pool of reducing savers over it, as a service process opens them."""

    def __init__(self, database: str, pool_size: int) -> None:
        self.backend = open_backend(database, pool_size=pool_size, timeout=5.0)
        self.backend.setup()
        reducer = MessageReducer(max_messages=4)
        savers = [
            ReducingSaver(inner, reducer, codec=SafeMessagesCodec())
            for inner in self.backend.savers(pool_size)
        ]
        self.savers = SaverPool(savers, timeout=5.0)
        self.borrow = self.savers.borrow

    def close(self) -> None:
        self.savers.close()
        self.backend.close()


def _backend(database: str, pool_size: int) -> _Backend:
    return _Backend(database, pool_size)


def test_calls_for_different_threads_run_in_parallel(fresh_pg):
    backend = _backend(fresh_pg, pool_size=2)
    try:
        done = threading.Event()
        with backend.borrow() as held, held.inner.conn.connection() as conn, conn.transaction():
            # One saver is busy (and holds a connection in an open transaction) ...
            conn.execute("SELECT pg_sleep(0)")

            def other_call() -> None:
                with backend.borrow() as saver:
                    saver.get_tuple({"configurable": {"thread_id": "other", "checkpoint_ns": ""}})
                done.set()

            threading.Thread(target=other_call, daemon=True).start()
            # ... and a call for another thread still completes meanwhile.
            assert done.wait(timeout=10)
        with psycopg.connect(fresh_pg) as conn:
            connections = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = '' AND pid <> pg_backend_pid()"
            ).fetchone()[0]
        assert connections == 2  # exactly the pool
    finally:
        backend.close()


def test_one_saver_serializes_calls(fresh_pg):
    backend = _backend(fresh_pg, pool_size=1)
    try:
        done = threading.Event()
        with backend.borrow():
            threading.Thread(target=lambda: (backend.borrow().__enter__(), done.set()), daemon=True).start()
            assert not done.wait(timeout=0.5)  # the only saver is lent out
        assert done.wait(timeout=5)
    finally:
        backend.close()


def test_client_bytes_are_stored_verbatim(fresh_pg):
    backend = _backend(fresh_pg, pool_size=1)
    serde = JsonPlusSerializer()
    messages = [HumanMessage("hello", id="h1")]
    other = {"a", "set"}
    try:
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {
            "messages": Blob(*serde.dumps_typed(messages)),
            "other": Blob(*serde.dumps_typed(other)),
        }
        checkpoint["channel_versions"] = {"messages": "1", "other": "1"}
        config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
        with backend.borrow() as saver:
            saver.put(config, checkpoint, {}, {"messages": "1", "other": "1"})
        with psycopg.connect(fresh_pg) as conn:
            rows = dict(
                conn.execute("SELECT channel, blob FROM checkpoint_blobs WHERE thread_id = 't'").fetchall()
            )
        assert rows == {"messages": serde.dumps_typed(messages)[1], "other": serde.dumps_typed(other)[1]}
    finally:
        backend.close()


def test_a_call_that_finds_no_saver_in_time_is_refused_and_the_next_one_runs(fresh_pg):
    """A worker thread takes a saver for each call within the pool's timeout: with the only saver held
    elsewhere (a sweep's borrow), the call gets ``SaversBusy``; once it is back, calls run on it, and a
    call's error reaches its caller with the saver given back."""
    backend = _backend(fresh_pg, pool_size=1)
    backend.savers.timeout = 0.2
    read = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}

    async def calls() -> None:
        with backend.borrow():
            with pytest.raises(SaversBusy):
                await backend.savers.call(lambda saver: saver.get_tuple(read))
        assert await backend.savers.call(lambda saver: saver.get_tuple(read)) is None
        with pytest.raises(ZeroDivisionError):
            await backend.savers.call(lambda saver: 1 / 0)
        assert await backend.savers.call(lambda saver: saver.get_tuple(read)) is None

    try:
        asyncio.run(calls())
    finally:
        backend.close()
