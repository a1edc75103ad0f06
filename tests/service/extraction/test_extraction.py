"""Delivery to long-term memory: retries, dead letters, the store extractor, custom extractors."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict

import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    message_to_dict,
    messages_from_dict,
)
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres import PostgresStore

from reducing_saver.reducer import message_key, validate_namespace
from reducing_saver.service.extraction.deliverer import Deliverer
from reducing_saver.service.extraction.extractors import StoreExtractor, entry_message, load_extractor
from reducing_saver.service.messages_codec import EncodedMessage, SafeMessagesCodec
from reducing_saver.service.storage.inmemory.outbox import MemoryOutbox
from reducing_saver.service.storage.outbox import make_entries
from reducing_saver.service.storage.sqlite.outbox import SqliteOutbox
from reducing_saver.wire import Blob
from reducing_saver.wire.nul import decode_memory_value
from tests.support.storage import OwnPoolOutbox as PostgresOutbox
from tests.support.storage import open_store

NS = ("memories", "user-1")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def outbox(request, tmp_path):
    if request.param == "memory":
        box = MemoryOutbox()
    elif request.param == "sqlite":
        box = SqliteOutbox(str(tmp_path / "service.sqlite"))
    else:
        box = PostgresOutbox(request.getfixturevalue("fresh_pg"))
    box.setup()
    yield box
    box.close()


def human_entries(n: int, namespace=NS, prefix: str = "m"):
    pruned = [HumanMessage(f"message {i}", id=f"{prefix}-{i:04d}") for i in range(n)]
    return make_entries(pruned, namespace, thread_id="t-1", checkpoint_id="cp-1")


def drain(outbox, deliverer, *, until, timeout: float = 20.0) -> None:
    """Run rounds until ``until(status)`` holds (sleeping briefly while retries are not due)."""
    deadline = time.monotonic() + timeout
    while not until(outbox.status()):
        assert time.monotonic() < deadline, outbox.status()
        deliverer.run_once()
        if deliverer.last_claimed == 0:
            time.sleep(0.01)


# -- failures, retries, dead letters ---------------------------------------------------------------


def test_an_extractor_failing_30_percent_of_calls_still_delivers_everything_once(outbox):
    made = [e for ns in range(4) for e in human_entries(30, namespace=("memories", f"user-{ns}"))]
    outbox.record(made)
    rng = random.Random(1234)
    delivered: Counter = Counter()
    seen_attempts: dict[str, list[int]] = defaultdict(list)
    failures = 0

    def flaky(batch, namespace):
        nonlocal failures
        for e in batch:
            seen_attempts[e.key + repr(namespace)].append(e.attempts)
        if rng.random() < 0.3:
            failures += 1
            raise ConnectionError("store went away")
        delivered.update(e.ident for e in batch)

    deliverer = Deliverer(
        outbox,
        flaky,
        batch_size=25,
        max_attempts=10,
        base_backoff=0.01,
        max_backoff=0.05,
        lease_seconds=10,
        rng=random.Random(7),
    )
    drain(outbox, deliverer, until=lambda s: s["pending"] == s["in_flight"] == 0)

    assert failures > 5
    assert delivered == Counter({e.ident: 1 for e in made})
    figures = outbox.status()
    assert figures == {
        "pending": 0,
        "in_flight": 0,
        "delivered": 120,
        "dead": 0,
        "oldest_pending_age_seconds": None,
    }
    # Attempts are recorded: a retried message comes back with a higher count, never a lower one.
    retried = [a for a in seen_attempts.values() if a[-1] > 1]
    assert retried
    assert all(a == sorted(a) for a in seen_attempts.values())


def test_an_always_failing_extractor_parks_dead_letters_that_retry_dead_redrives(outbox):
    made = human_entries(12)
    outbox.record(made)

    def broken(batch, namespace):
        raise RuntimeError("memory store is down")

    deliverer = Deliverer(
        outbox, broken, batch_size=5, max_attempts=3, base_backoff=0.01, max_backoff=0.02, lease_seconds=10
    )
    drain(outbox, deliverer, until=lambda s: s["dead"] == 12)

    assert outbox.status() == {
        "pending": 0,
        "in_flight": 0,
        "delivered": 0,
        "dead": 12,
        "oldest_pending_age_seconds": None,
    }
    dead = outbox.dead_letters(limit=100)
    assert sorted(e.key for e in dead) == sorted(e.key for e in made)
    assert {e.attempts for e in dead} == {3}
    assert {e.last_error for e in dead} == {
        "retryable failure, gave up after 3 attempt(s): RuntimeError: memory store is down"
    }
    by_key = {e.key: e for e in made}
    assert all(e.message == by_key[e.key].message and e.thread_id == "t-1" for e in dead)
    assert len(outbox.dead_letters(limit=5)) == 5

    assert outbox.retry_dead() == 12
    status = outbox.status()
    assert (status["pending"], status["dead"]) == (12, 0)
    got: list = []
    deliverer.extractor = lambda batch, namespace: got.extend(batch)
    drain(outbox, deliverer, until=lambda s: s["delivered"] == 12)
    assert sorted(e.key for e in got) == sorted(e.key for e in made)
    assert all(e.attempts == 1 for e in got)
    assert outbox.dead_letters() == []


def test_one_bad_message_does_not_hold_back_its_group():
    outbox = MemoryOutbox()
    made = human_entries(6)
    outbox.record(made)
    delivered = []

    def picky(batch, namespace):
        if any(e.key == "m-0003" for e in batch):
            raise ValueError("cannot embed m-0003")
        delivered.extend(e.key for e in batch)

    deliverer = Deliverer(outbox, picky, max_attempts=1, base_backoff=0.01, max_backoff=0.01)
    assert deliverer.run_once() == 5
    assert sorted(delivered) == ["m-0000", "m-0001", "m-0002", "m-0004", "m-0005"]
    (dead,) = outbox.dead_letters()
    assert dead.key == "m-0003"
    assert dead.last_error == "retryable failure, gave up after 1 attempt(s): ValueError: cannot embed m-0003"


def test_a_namespace_the_store_refuses_is_a_dead_letter_at_once():
    outbox = MemoryOutbox()
    outbox.record(human_entries(2, namespace=("memories", "user.42")))
    deliverer = Deliverer(outbox, StoreExtractor(InMemoryStore()), max_attempts=5)
    assert deliverer.run_once() == 0
    dead = outbox.dead_letters()
    assert len(dead) == 2 and {e.attempts for e in dead} == {1}
    assert "'user.42'" in dead[0].last_error and "PermanentExtractionError" in dead[0].last_error
    # Said plainly: re-driving it would fail the same way.
    assert dead[0].last_error.startswith("permanent failure, retrying cannot help: ")


def test_backoff_is_exponential_capped_and_jittered():
    deliverer = Deliverer(
        MemoryOutbox(), lambda b, ns: None, base_backoff=1.0, max_backoff=10.0, rng=random.Random(3)
    )
    for attempts, full in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (30, 10.0)]:
        waits = [deliverer.backoff(attempts) for _ in range(50)]
        assert all(full / 2 <= w <= full for w in waits)
        assert len(set(waits)) > 1


def test_deliverer_refuses_nonsense_settings():
    for bad in [
        {"batch_size": 0},
        {"lease_seconds": 0},
        {"max_attempts": 0},
        {"base_backoff": 5, "max_backoff": 1},
    ]:
        with pytest.raises(ValueError):
            Deliverer(MemoryOutbox(), lambda b, ns: None, **bad)


class BrokenClaims(MemoryOutbox):
    """An outbox whose database is away while ``down`` is set: claims fail as a lost connection would."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()
        self.failed_claims = 0

    def claim(self, worker_id, limit, lease_seconds):
        if self.down.is_set():
            self.failed_claims += 1
            raise ConnectionError("the database is unavailable")
        return super().claim(worker_id, limit, lease_seconds)


def test_a_deliverer_woken_after_an_outage_delivers_at_once_not_after_its_backoff():
    outbox = BrokenClaims()
    outbox.down.set()
    # After a failed round the deliverer backs off (here 10 s: idle_sleep 5 s doubled).
    deliverer = Deliverer(outbox, lambda batch, namespace: None, idle_sleep=5.0)
    stop = threading.Event()
    thread = threading.Thread(target=deliverer.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while outbox.failed_claims == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        outbox.down.clear()
        # The database is back: a put records rows and wakes the deliverer, as Memory.record does.
        outbox.record(human_entries(3))
        woken = time.monotonic()
        deliverer.wake()
        while outbox.status()["delivered"] < 3:
            assert time.monotonic() - woken < 2.0, "the deliverer waited out its error backoff"
            time.sleep(0.01)
    finally:
        stop.set()
        deliverer.wake()
        thread.join(5)


def test_the_error_backoff_is_capped():
    outbox = BrokenClaims()
    outbox.down.set()
    waits: list[float] = []
    deliverer = Deliverer(outbox, lambda batch, namespace: None, idle_sleep=1.0)
    stop = threading.Event()

    class Recording(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            if len(waits) >= 10:
                stop.set()
            return False

    deliverer._wakeup = Recording()
    giving_up = threading.Timer(5.0, stop.set)  # a deliverer that waits elsewhere still ends
    giving_up.start()
    try:
        deliverer.run_forever(stop)
    finally:
        giving_up.cancel()
    assert waits[:5] == [2.0, 4.0, 8.0, 16.0, 30.0] and max(waits) == 30.0


def test_stopping_hands_back_the_rest_of_the_batch(outbox):
    made = [e for ns in range(3) for e in human_entries(4, namespace=("memories", f"user-{ns}"))]
    outbox.record(made)
    entered, proceed = threading.Event(), threading.Event()
    delivered = []

    def blocking(batch, namespace):
        entered.set()
        proceed.wait(10)
        delivered.extend(batch)

    deliverer = Deliverer(outbox, blocking, batch_size=100, lease_seconds=30)
    deliverer.start()
    assert entered.wait(10)
    assert outbox.status()["in_flight"] == 12
    stopper = threading.Thread(target=deliverer.stop)
    stopper.start()
    time.sleep(0.1)
    proceed.set()  # the group in hand finishes; the other two go back
    stopper.join(10)
    assert len(delivered) == 4
    status = outbox.status()
    assert (status["delivered"], status["pending"], status["in_flight"]) == (4, 8, 0)
    again = outbox.claim("next", 100, 30)
    assert len(again) == 8 and {e.attempts for e in again} == {1}


def test_rows_of_a_crashed_worker_are_delivered_after_their_lease(outbox):
    outbox.record(human_entries(5))
    outbox.claim("crashed-worker", 10, 1.0)
    got = []
    deliverer = Deliverer(outbox, lambda batch, ns: got.extend(batch), lease_seconds=5)
    assert deliverer.run_once() == 0
    time.sleep(1.2)
    assert deliverer.run_once() == 5
    assert {e.attempts for e in got} == {2}


# -- the store extractor ---------------------------------------------------------------------------


def encoded(messages: list[BaseMessage]) -> list[EncodedMessage]:
    """The messages as the service sees them: decoded from the client's serialized channel."""
    kind, data = JsonPlusSerializer().dumps_typed(messages)
    return SafeMessagesCodec().decode(Blob(kind, data))


def conversation() -> list[BaseMessage]:
    return [
        SystemMessage("be brief", id="s-1"),
        HumanMessage("what is the weather?", id="h-1"),
        AIMessage("", id="a-1", tool_calls=[{"id": "call-1", "name": "weather", "args": {"city": "Oslo"}}]),
        ToolMessage("rain, 4 °C", tool_call_id="call-1", id="t-1"),
        AIMessageChunk("It rains.", id="a-2"),
        HumanMessage("thanks (no id)"),
    ]


def test_store_extractor_writes_every_message_to_a_postgres_store_once(fresh_pg):
    store, close_store = open_store(fresh_pg)
    outbox = PostgresOutbox(fresh_pg)
    outbox.setup()
    try:
        originals = conversation()
        unknown = EncodedMessage({"type": "custom", "content": "x", "id": "c-1"}, b"", "my.module", "Custom")
        made = make_entries([*encoded(originals), unknown], NS, thread_id="thread-1", checkpoint_id="cp-9")
        other = make_entries(
            encoded([HumanMessage("elsewhere", id="h-9")]), ("memories", "user-2"), thread_id="thread-2"
        )
        assert outbox.record(made + other) == 8
        deliverer = Deliverer(outbox, StoreExtractor(store), lease_seconds=10)
        assert deliverer.run_once() == 8

        pruned_at = made[0].pruned_at.isoformat()
        expected = {
            message_key(m, NS): {**message_to_dict(m), "thread_id": "thread-1", "pruned_at": pruned_at}
            for m in originals
        }
        expected["c-1"] = {
            "type": "custom",
            "data": {"type": "custom", "content": "x", "id": "c-1"},
            "thread_id": "thread-1",
            "pruned_at": pruned_at,
        }
        assert any(key.startswith("sha256:") for key in expected)

        with PostgresStore.from_conn_string(fresh_pg) as stock:
            items = stock.search(NS, limit=100)
            assert {item.key: item.value for item in items} == expected
            assert all(item.namespace == NS for item in items)
            assert [item.key for item in stock.search(("memories", "user-2"))] == ["h-9"]

        # Redelivery (a worker that lost its lease, a re-driven dead letter) overwrites: one item per key.
        StoreExtractor(store)(made, NS)
        assert outbox.record(made) == 0
        with PostgresStore.from_conn_string(fresh_pg) as stock:
            again = stock.search(NS, limit=100)
        assert len(again) == len(expected)
        assert {item.key: item.value for item in again} == expected
    finally:
        outbox.close()
        close_store()


def test_a_message_holding_nul_reaches_postgres_escaped_and_decodes_to_the_original(fresh_pg):
    """jsonb refuses NUL characters: such a message is stored escaped and marked, not parked."""
    store, close_store = open_store(fresh_pg)
    try:
        outbox = MemoryOutbox()
        pruned = [
            HumanMessage("fine \\0 with a backslash", id="h-1"),
            ToolMessage("nul \x00 inside, \\0 beside", id="h-2", tool_call_id="call\x00-1"),
            HumanMessage("fine too", id="h-3"),
        ]
        outbox.record(make_entries(pruned, NS, thread_id="t-1"))
        deliverer = Deliverer(outbox, StoreExtractor(store), max_attempts=5)
        assert deliverer.run_once() == 3
        assert outbox.dead_letters() == []
        with PostgresStore.from_conn_string(fresh_pg) as stock:
            items = {item.key: item.value for item in stock.search(NS)}
        assert set(items) == {"h-1", "h-2", "h-3"}
        assert "nul_escaped" not in items["h-1"]
        assert items["h-1"]["data"]["content"] == "fine \\0 with a backslash"
        assert items["h-2"]["nul_escaped"] is True
        decoded = decode_memory_value(items["h-2"])
        assert "nul_escaped" not in decoded
        restored = messages_from_dict([decoded])[0]
        assert restored.content == "nul \x00 inside, \\0 beside" and restored.tool_call_id == "call\x00-1"
        assert decode_memory_value(items["h-1"]) == items["h-1"]
    finally:
        close_store()


def test_entry_message_rebuilds_the_recorded_class():
    originals = conversation()
    made = make_entries(encoded(originals), NS, thread_id="t")
    rebuilt = [entry_message(e) for e in made]
    assert [type(m) for m in rebuilt] == [type(m) for m in originals]
    assert [m.model_dump() for m in rebuilt] == [m.model_dump() for m in originals]
    # Entries recorded from plain dicts are rebuilt from their type.
    (from_dict,) = make_entries([{"type": "ai", "content": "hi", "id": "x"}], NS, thread_id="t")
    assert isinstance(entry_message(from_dict), AIMessage)
    (odd,) = make_entries([{"type": "strange", "content": "hi", "id": "y"}], NS, thread_id="t")
    assert entry_message(odd) == {"type": "strange", "content": "hi", "id": "y"}


@pytest.mark.parametrize("scheme", ["sqlite", "memory"])
def test_open_store_for_sqlite_and_memory(scheme, tmp_path):
    url = f"sqlite:///{tmp_path}/service.sqlite" if scheme == "sqlite" else "memory://"
    store, close = open_store(url)
    try:
        made = make_entries(conversation(), NS, thread_id="t-1")
        StoreExtractor(store)(made, NS)
        StoreExtractor(store)(made, NS)
        items = store.search(NS, limit=100)
        assert len(items) == len(made)
        assert {i.value["thread_id"] for i in items} == {"t-1"}
    finally:
        close()
    with pytest.raises(ValueError, match="unsupported"):
        open_store("mysql://x")


def test_sqlite_outbox_and_store_share_the_service_file(tmp_path):
    path = tmp_path / "service.sqlite"
    store, close = open_store(f"sqlite:///{path}")
    outbox = SqliteOutbox(str(path))
    outbox.setup()
    try:
        outbox.record(human_entries(10))
        assert Deliverer(outbox, StoreExtractor(store)).run_once() == 10
        assert len(store.search(NS, limit=100)) == 10
    finally:
        outbox.close()
        close()


# -- namespaces ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("namespace", "named"),
    [
        ((), "empty"),
        (("memories", "user.42"), "'user.42'"),
        (("a.b",), "'a.b'"),
        (("memories", ""), "label 1"),
        (("langgraph", "x"), "'langgraph'"),
        (("memories", "nul\x00"), "NUL"),
        (("memories", 7), "label 1 (7)"),
    ],
)
def test_validate_namespace_names_the_bad_label(namespace, named):
    with pytest.raises(ValueError) as info:
        validate_namespace(namespace)
    assert named in str(info.value)


@pytest.mark.parametrize("namespace", [("memories", "user-42"), ("a:b", "c"), ("x",), ["list", "ok"]])
def test_validate_namespace_accepts_what_stores_accept(namespace):
    validate_namespace(namespace)
    store = InMemoryStore()
    store.put(tuple(namespace), "k", {"v": 1})
    assert store.get(tuple(namespace), "k").value == {"v": 1}


# -- custom extractors -----------------------------------------------------------------------------


def sync_extractor(messages, namespace, store):
    """A custom extractor: one summary item per call."""
    assert all(isinstance(m, BaseMessage) for m in messages)
    store.put(
        namespace, f"summary-{messages[0].id}", {"count": len(messages), "ids": [m.id for m in messages]}
    )


async def async_extractor(messages, namespace, store):
    for m in messages:
        await store.aput(namespace, m.id, {"text": m.content})


def test_load_extractor_runs_sync_and_async_callables():
    for path in [
        "tests.service.extraction.test_extraction:sync_extractor",
        "tests.service.extraction.test_extraction:async_extractor",
    ]:
        store = InMemoryStore()
        outbox = MemoryOutbox()
        outbox.record(human_entries(3))
        deliverer = Deliverer(outbox, load_extractor(path, store))
        assert deliverer.run_once() == 3
        assert deliverer.run_once() == 0
        deliverer.release()
        items = store.search(NS, limit=10)
        if path.endswith("sync_extractor") and "async" not in path:
            assert [i.value for i in items] == [{"count": 3, "ids": ["m-0000", "m-0001", "m-0002"]}]
        else:
            assert sorted(i.key for i in items) == ["m-0000", "m-0001", "m-0002"]


def test_load_extractor_explains_bad_paths():
    with pytest.raises(ValueError, match="expected module:attribute"):
        load_extractor("no_colon")
    with pytest.raises(ValueError, match="attribute not found"):
        load_extractor("tests.service.extraction.test_extraction:missing")
    with pytest.raises(ValueError, match="module not found"):
        load_extractor("no_such_module_here:x")
    with pytest.raises(ValueError, match="not a callable"):
        load_extractor("tests.service.extraction.test_extraction:NS")


# -- batching after a wake -------------------------------------------------------------------------


@pytest.mark.parametrize("linger", [0.0, 0.5])
def test_a_woken_deliverer_lingers_so_one_batch_covers_the_rows_of_many_puts(linger):
    outbox = MemoryOutbox()
    batches: list[int] = []
    deliverer = Deliverer(outbox, lambda batch, ns: batches.append(len(batch)), idle_sleep=30, linger=linger)
    deliverer.start()
    try:
        time.sleep(0.1)  # the first round found nothing: it sleeps until woken
        for put in range(5):  # five puts, 50 ms apart, each recording two rows and waking the deliverer
            outbox.record(human_entries(2, prefix=f"put-{put}"))
            deliverer.wake()
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while sum(batches) < 10:
            assert time.monotonic() < deadline, batches
            time.sleep(0.01)
    finally:
        deliverer.stop()
    if linger:
        assert batches == [10]  # all five puts' rows in one claim
    else:
        assert len(batches) >= 4  # each wake claims what one put recorded


class _CountingStore(InMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def batch(self, ops):
        self.batches += 1
        return super().batch(ops)


class _CountingCompletions(MemoryOutbox):
    def __init__(self) -> None:
        super().__init__()
        self.completions = 0

    def complete(self, worker_id, keys):
        self.completions += 1
        return super().complete(worker_id, keys)


def test_the_store_extractor_takes_every_namespace_of_a_claim_in_one_store_write():
    outbox = _CountingCompletions()
    outbox.record([e for n in range(5) for e in human_entries(2, namespace=("memories", f"user-{n}"))])
    store = _CountingStore()
    assert Deliverer(outbox, StoreExtractor(store)).run_once() == 10
    assert (store.batches, outbox.completions) == (1, 1)
    for n in range(5):
        assert [item.key for item in store.search(("memories", f"user-{n}"))] == ["m-0000", "m-0001"]
    assert outbox.status()["delivered"] == 10


def test_a_namespace_the_store_refuses_among_others_is_a_dead_letter_and_the_others_are_delivered():
    outbox = MemoryOutbox()
    outbox.record([*human_entries(2, namespace=("memories", "user.42")), *human_entries(3)])
    store = InMemoryStore()
    assert Deliverer(outbox, StoreExtractor(store), max_attempts=5).run_once() == 3
    assert [item.key for item in store.search(NS)] == ["m-0000", "m-0001", "m-0002"]
    dead = outbox.dead_letters()
    assert len(dead) == 2 and all("PermanentExtractionError" in e.last_error for e in dead)
