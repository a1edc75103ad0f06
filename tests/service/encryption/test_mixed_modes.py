"""Two processes of two encryption modes on one database, as during a rollout off -> migrate: the one
without the key ring leaves alone what it cannot open (outbox rows, summary batches and texts), or
refuses it with an error naming ``--encryption off`` (store reads, a summarized put, a sweep that would
delete a window it cannot read). Never a sealed value handed on as plain data.

Both "processes" are backends opened twice in this process, on real PostgreSQL and on SQLite; the
rollout with two real service processes is ``tests/e2e/test_encryption_rollout.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage

from reducing_saver.client import ReducingSaverError, RemoteReducingSaver
from reducing_saver.reducer import StepRequest, step_id
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.encryption import ENVELOPE_TYPE, StoredDataError
from reducing_saver.service.extraction.recorder import Memory
from reducing_saver.service.http.app import create_app
from reducing_saver.service.storage import open_backend
from reducing_saver.service.summaries.setup import RunningSummaries
from reducing_saver.service.summaries.summarizer import CallableSummarizer, SummaryWorker
from tests.support.chat import build_chat_graph, human
from tests.support.encryption import new_key, ring_json

RING = ring_json("k1", k1=new_key())


@pytest.fixture(params=["postgres", "sqlite"])
def database(request, tmp_path):
    return (
        request.getfixturevalue("fresh_pg")
        if request.param == "postgres"
        else f"sqlite:///{tmp_path}/m.sqlite"
    )


class Process:
    """One mode's backend, outbox and book, as a service process of that mode holds them."""

    def __init__(self, database: str, mode: str) -> None:
        keys = {"encryption_keys": RING} if mode != "off" else {}
        self.settings = Settings(
            database=database,
            encryption=mode,
            summarizer="tests.support.summarizers:verbatim",
            extraction_base_backoff=0,
            extraction_max_backoff=0,
            **keys,
        )
        self.backend = open_backend(database, pool_size=2, timeout=10.0)
        self.backend.setup()
        self.memory = Memory(self.settings, self.backend)
        self.summaries = RunningSummaries(
            self.settings, self.backend, wrap=None, registry=None, tenant_mode=False
        )
        self.book = self.summaries.book
        self.store = self.memory.deliverer_for().extractor.store

    def record(self, thread: str, texts: list[str]) -> None:
        messages = [HumanMessage(text, id=f"{thread}-{i}") for i, text in enumerate(texts)]
        self.memory.record(
            messages, ("memories", thread), {"configurable": {"thread_id": thread}}, {"id": "cp"}
        )

    def deliver(self) -> int:
        delivered = 0
        while (done := self.memory.deliverer.run_once()) or self.memory.deliverer.last_claimed:
            delivered += done
        return delivered

    def close(self) -> None:
        self.memory.close(0)
        self.backend.close()


@pytest.fixture
def processes(database):
    opened = [Process(database, "off"), Process(database, "migrate")]
    yield opened
    for process in opened:
        process.close()


def test_an_off_deliverer_leaves_sealed_rows_to_a_process_with_the_key_ring(processes):
    off, keyed = processes
    keyed.record("sealed", ["SECRET 0", "SECRET 1", "SECRET 2"])
    off.record("plain", ["plain 0", "plain 1"])
    assert off.deliver() == 2  # its own plain rows; the sealed ones stay pending, unclaimed
    status = off.memory.outbox.status()
    assert status["pending"] == 3 and status["in_flight"] == 0 and status["dead"] == 0, status
    assert keyed.deliver() == 3
    for thread, count in (("sealed", 3), ("plain", 2)):
        for i in range(count):
            item = keyed.store.get(("memories", thread), f"{thread}-{i}")
            assert item.value["data"]["content"].endswith(str(i)), item.value  # a message, not an envelope
    # The store through the process without the key ring: plain items read, sealed ones refused.
    assert off.store.get(("memories", "plain"), "plain-0").value["data"]["content"] == "plain 0"
    with pytest.raises(StoredDataError, match="--encryption off"):
        off.store.get(("memories", "sealed"), "sealed-0")
    with pytest.raises(StoredDataError, match="--encryption off"):
        off.store.search(("memories",), limit=100)


def _step(thread: str, base: str | None, key: str, version: int = 1) -> StepRequest:
    batch = [HumanMessage(f"FACT: {key}", id=key)]
    return StepRequest(thread, "", step_id(base, [key]), base, version, (key,), batch, version)


def _worker(process: Process, calls: list) -> SummaryWorker:
    def summarize(previous, messages):
        calls.append((previous, [m.id for m in messages]))
        return "\n".join(filter(None, [previous, *(m.content for m in messages)]))

    return SummaryWorker(
        process.book,
        CallableSummarizer(summarize, "s", max_tokens=1000),
        max_attempts=2,
        base_backoff=0,
        max_backoff=0,
        rng=random.Random(1),
    )


def test_an_off_summarizer_leaves_sealed_batches_and_bases_alone_and_its_puts_refuse_them(processes):
    off, keyed = processes
    sealed = _step("s", None, "s-1")
    keyed.book.request(sealed)  # a batch a keyed replica's put asked for: sealed
    plain = _step("p", None, "p-1")
    off.book.request(plain)
    keyed_calls: list = []
    keyed_worker = _worker(keyed, keyed_calls)
    assert keyed_worker.run_once() and keyed_calls == [(None, ["s-1"])]  # the oldest: the sealed one
    on_sealed_base = _step("s", sealed.step_id, "s-2", version=2)
    off.book.request(on_sealed_base)  # an off replica's put: a plain batch on a sealed summary

    off_calls: list = []
    off_worker = _worker(off, off_calls)
    while off_worker.run_once():
        pass
    off_worker.release()
    assert off_calls == [(None, ["p-1"])]  # neither the sealed summary's next batch, nor a failure
    assert off.book.status()["dead_steps"] == 0
    while keyed_worker.run_once():
        pass
    keyed_worker.release()
    assert keyed_calls[-1] == ("FACT: s-1", ["s-2"])  # built on the opened summary
    assert (
        keyed.book.steps("s", "", [on_sealed_base.step_id])[on_sealed_base.step_id].text
        == "FACT: s-1\nFACT: s-2"
    )
    # The put path of the process without the key ring cannot show a sealed summary: a clear refusal.
    with pytest.raises(StoredDataError, match="--encryption off") as refused:
        off.book.steps("s", "", [sealed.step_id])
    assert "'s'" in str(refused.value) and ENVELOPE_TYPE not in str(refused.value)


def test_an_off_sweep_never_deletes_a_window_it_cannot_read(database, caplog):
    """A TTL sweep (delete) records a thread's window in the outbox before deleting it: a process without
    the key ring cannot read a sealed window, so it leaves that thread to a process that can."""
    import time

    from fastapi.testclient import TestClient

    from reducing_saver.client import RemoteReducingSaver
    from reducing_saver.service.http.app import create_app
    from tests.support.chat import build_chat_graph, human

    common = dict(
        database=database,
        max_messages=6,
        min_messages=4,
        ttl_strategy="delete",
        default_ttl="1s",
        sweep=False,
        extract=False,
    )
    keyed_app = create_app(Settings(**common, encryption="migrate", encryption_keys=RING))
    off_app = create_app(Settings(**common))
    with TestClient(keyed_app) as keyed_http, TestClient(off_app):
        with RemoteReducingSaver(
            "http://testserver", transport=keyed_http._transport, max_retries=0
        ) as saver:
            graph = build_chat_graph(saver, prefix="w", length=30)
            for n in range(3):
                graph.invoke({"messages": [human(n, "w", 30)]}, {"configurable": {"thread_id": "w"}})
        time.sleep(1.2)
        report = off_app.state.service.sweeper.sweep()
        assert report.errors == 1 and report.threads_deleted == 0, report
        assert "--encryption off" in caplog.text
        assert (
            keyed_app.state.service.open_backend()
            .savers(1)[0]
            .get_tuple({"configurable": {"thread_id": "w"}})
        )
        report = keyed_app.state.service.sweeper.sweep()
        assert report.errors == 0 and report.threads_deleted == 1, report
        outbox = keyed_app.state.service.open_memory().outbox
        assert outbox.status()["pending"] == 6  # the window, recorded before the delete
        claimed = outbox.claim("check", 10, 30)
        assert sorted(e.message["content"].rstrip(".") for e in claimed) == sorted(
            f"{kind} {n}" for n in range(3) for kind in ("question", "answer")
        )


# -- checkpoint reads and copies through an `off` process ------------------------------------------


@contextmanager
def _client(database: str, mode: str) -> Iterator[RemoteReducingSaver]:
    """The service of ``mode`` on ``database`` (in process), and a client of it."""
    keys = {"encryption_keys": RING} if mode != "off" else {}
    app = create_app(Settings(database=database, encryption=mode, extract=False, sweep=False, **keys))
    with (
        TestClient(app) as http,
        RemoteReducingSaver("http://testserver", transport=http._transport, max_retries=0) as saver,
    ):
        yield saver


def test_an_off_service_refuses_sealed_checkpoints_naming_the_mode_and_copies_none(database):
    sealed = {"configurable": {"thread_id": "sealed"}}
    with _client(database, "migrate") as keyed:
        graph = build_chat_graph(keyed)
        for turn in range(2):
            graph.invoke({"messages": [human(turn)]}, sealed)
        expected = graph.get_state(sealed).values["messages"]
    with _client(database, "off") as off:
        graph = build_chat_graph(off)
        graph.invoke({"messages": [human(0)]}, {"configurable": {"thread_id": "plain"}})
        reads = {
            "get_tuple": lambda: off.get_tuple(sealed),
            "list": lambda: list(off.list(sealed)),
            "get_state": lambda: graph.get_state(sealed),
            "invoke": lambda: graph.invoke({"messages": [human(9)]}, sealed),
            "copy_thread": lambda: off.copy_thread("sealed", "sealed-copy"),
        }
        for name, read in reads.items():
            with pytest.raises(ReducingSaverError, match=r"encrypted at rest.*--encryption off") as refused:
                read()
            assert "thread 'sealed'" in str(refused.value), name
        assert off.get_tuple({"configurable": {"thread_id": "sealed-copy"}}) is None
        off.copy_thread("plain", "plain-copy")  # a thread with nothing sealed copies as before
        assert off.get_tuple({"configurable": {"thread_id": "plain-copy"}}) is not None
    with _client(database, "migrate") as keyed:  # nothing changed: the keyed process reads it all
        assert build_chat_graph(keyed).get_state(sealed).values["messages"] == expected
