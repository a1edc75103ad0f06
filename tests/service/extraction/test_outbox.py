"""The extraction outbox: recording once, claiming safely, leases, failures, dead letters, status.

The API tests run against all three outboxes (memory, SQLite, PostgreSQL); the concurrency tests run
on real PostgreSQL, with two pools at once and with deliverers in separate processes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import multiprocessing
import random
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from langchain_core.messages import AIMessage, HumanMessage

from reducing_saver.reducer import message_key
from reducing_saver.service.extraction.deliverer import Deliverer
from reducing_saver.service.leased_worker import LeaseRenewer
from reducing_saver.service.messages_codec import EncodedMessage
from reducing_saver.service.storage.inmemory.outbox import MemoryOutbox
from reducing_saver.service.storage.outbox import OutboxEntry, make_entries
from reducing_saver.service.storage.postgres.outbox import PostgresOutbox as PoolOutbox
from reducing_saver.service.storage.postgres.outbox import insert_entries
from reducing_saver.service.storage.sqlite.outbox import SqliteOutbox
from tests.support.storage import OwnPoolOutbox as PostgresOutbox
from tests.support.storage import open_outbox

NS = ("memories", "user-1")


def messages(n: int, prefix: str = "m") -> list[HumanMessage]:
    return [HumanMessage(f"message {i}", id=f"{prefix}-{i:04d}") for i in range(n)]


def entries(n: int, namespace=NS, prefix: str = "m", thread_id: str = "t-1") -> list[OutboxEntry]:
    return make_entries(messages(n, prefix), namespace, thread_id=thread_id, checkpoint_id="cp-1")


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


def status(box, **expected):
    figures = box.status()
    for name, value in expected.items():
        assert figures[name] == value, (name, figures)
    return figures


# -- make_entries ---------------------------------------------------------------------------------


def test_make_entries_keys_like_the_reducer_and_keeps_one_per_key():
    anonymous = HumanMessage("no id here")
    pruned = [*messages(3), messages(1)[0], anonymous, {"type": "human", "content": "a dict", "id": None}]
    made = make_entries(pruned, ["memories", "u"], thread_id="t", checkpoint_id="c")
    assert [e.key for e in made] == [
        "m-0000",
        "m-0001",
        "m-0002",
        message_key(anonymous, ("memories", "u")),
        message_key(pruned[-1], ("memories", "u")),
    ]
    assert made[3].key.startswith("sha256:")
    assert made[0].namespace == ("memories", "u")
    assert made[0].message_class == "langchain_core.messages.human:HumanMessage"
    assert made[-1].message_class is None
    assert made[0].message == messages(1)[0].model_dump()
    assert made[0].pruned_at.tzinfo is not None


def test_make_entries_records_the_class_of_encoded_messages_and_cleans_json():
    dump = AIMessage("hi", id="a1", additional_kwargs={"raw": b"\x00\xff", "tags": {"x"}}).model_dump()
    encoded = EncodedMessage(dump, b"", "my.module", "CustomMessage")
    (entry,) = make_entries([encoded], NS, thread_id="t")
    assert entry.message_class == "my.module:CustomMessage"
    assert entry.message["additional_kwargs"] == {"raw": "AP8=", "tags": ["x"]}
    assert type(entry.message) is dict


def test_open_outbox_by_url(tmp_path, fresh_pg):
    assert isinstance(open_outbox("memory://"), MemoryOutbox)
    sqlite_box = open_outbox(f"sqlite:///{tmp_path}/s.sqlite")
    assert isinstance(sqlite_box, SqliteOutbox)
    assert sqlite_box.record(entries(2)) == 2
    sqlite_box.close()
    with open_outbox(fresh_pg) as pg_box:
        assert isinstance(pg_box, PostgresOutbox)
        assert pg_box.record(entries(2)) == 2
    with pytest.raises(ValueError, match="unsupported"):
        open_outbox("mysql://x")


# -- the API, on every outbox ---------------------------------------------------------------------


def test_record_is_idempotent_and_unique_per_namespace_and_key(outbox):
    assert outbox.record(entries(10)) == 10
    assert outbox.record(entries(10)) == 0
    assert outbox.record(entries(15)) == 5
    assert outbox.record(entries(15, namespace=("memories", "user-2"))) == 15
    assert outbox.record([]) == 0
    status(outbox, pending=30, in_flight=0, delivered=0, dead=0)
    # Once delivered, a late put of the same turn records nothing either.
    claimed = outbox.claim("w", 100, 30)
    assert outbox.complete("w", [e.ident for e in claimed]) == 30
    assert outbox.record(entries(15)) == 0
    status(outbox, pending=0, delivered=30, oldest_pending_age_seconds=None)


def test_namespaces_that_join_alike_do_not_collide(outbox):
    namespaces = [("a", "b:c"), ("a:b", "c"), ("a", "b"), ("a,b",), ('a","b',), ("a.b",)]
    made = [make_entries([HumanMessage("x", id="k")], ns, thread_id="t")[0] for ns in namespaces]
    assert outbox.record(made) == len(namespaces)
    assert outbox.record(made) == 0
    claimed = outbox.claim("w", 100, 30)
    assert sorted(e.namespace for e in claimed) == sorted(namespaces)


def test_a_stored_entry_comes_back_unchanged(outbox):
    message = AIMessage(
        "nul \x00 and ünïcode ✓",
        id="ai-1",
        tool_calls=[{"id": "c1", "name": "lookup", "args": {"q": [1, 2.5, None, True]}}],
        additional_kwargs={"nested": {"deep": ["x", {"y": 1}]}},
    )
    (entry,) = make_entries([message], NS, thread_id="thread-9", checkpoint_id="cp-7")
    outbox.record([entry])
    (claimed,) = outbox.claim("w", 10, 30)
    assert claimed.message == message.model_dump()
    assert (claimed.namespace, claimed.key, claimed.thread_id, claimed.checkpoint_id) == (
        NS,
        "ai-1",
        "thread-9",
        "cp-7",
    )
    assert claimed.message_class == "langchain_core.messages.ai:AIMessage"
    assert abs(claimed.pruned_at - entry.pruned_at) < timedelta(milliseconds=1)
    assert claimed.attempts == 1


def test_status_claim_complete_fail_release_at_each_stage(outbox):
    recorded = entries(6)
    outbox.record(recorded)
    first = status(outbox, pending=6, in_flight=0, delivered=0, dead=0)
    assert first["oldest_pending_age_seconds"] is not None and first["oldest_pending_age_seconds"] >= 0

    a = outbox.claim("worker-a", 4, 30)
    assert len(a) == 4 and all(e.attempts == 1 for e in a)
    status(outbox, pending=2, in_flight=4)
    b = outbox.claim("worker-b", 10, 30)  # skips rows under a live lease
    assert len(b) == 2 and not {e.ident for e in a} & {e.ident for e in b}
    status(outbox, pending=0, in_flight=6)
    assert outbox.claim("worker-c", 10, 30) == []

    # Only the holder completes.
    assert outbox.complete("worker-b", [a[0].ident]) == 0
    assert outbox.complete("worker-a", [a[0].ident, a[1].ident]) == 2
    assert outbox.complete("worker-a", []) == 0
    status(outbox, pending=0, in_flight=4, delivered=2)

    # A failure waits for its retry time; a dead one is parked and listed.
    later = datetime.now(UTC) + timedelta(seconds=60)
    assert outbox.fail("worker-a", a[2].ident, "ValueError: flaky", retry_at=later)
    assert not outbox.fail("worker-b", a[3].ident, "not mine", dead=True)
    assert outbox.fail("worker-a", a[3].ident, "RuntimeError: broken", dead=True)
    status(outbox, pending=1, in_flight=2, delivered=2, dead=1)
    assert outbox.claim("worker-c", 10, 30) == []  # the retry is not due yet
    (dead,) = outbox.dead_letters()
    assert dead.ident == a[3].ident and dead.attempts == 1 and dead.last_error == "RuntimeError: broken"

    # Graceful shutdown hands rows back without counting the claim.
    assert outbox.release("worker-b") == 2
    status(outbox, pending=3, in_flight=0, delivered=2, dead=1)
    again = outbox.claim("worker-c", 10, 30)
    assert sorted(e.ident for e in again) == sorted(e.ident for e in b)
    assert all(e.attempts == 1 for e in again)

    # Re-driving a dead letter makes it claimable with a fresh attempt count.
    assert outbox.retry_dead() == 1
    assert outbox.retry_dead() == 0
    status(outbox, pending=2, in_flight=2, delivered=2, dead=0)
    (redriven,) = outbox.claim("worker-d", 10, 30)
    assert redriven.ident == a[3].ident and redriven.attempts == 1
    assert outbox.complete("worker-d", [redriven.ident]) == 1
    assert outbox.complete("worker-c", [e.ident for e in again]) == 2
    final = status(outbox, pending=1, in_flight=0, delivered=5, dead=0)
    assert final["oldest_pending_age_seconds"] >= 0


def stored_messages(box) -> dict[str, object]:
    """key -> the message column as the backend holds it (``None`` for SQL or JSON null)."""
    if isinstance(box, MemoryOutbox):
        return {key: row.entry.message for (_, key), row in box._rows.items()}
    if isinstance(box, SqliteOutbox):
        rows = box._conn().execute("SELECT key, json(message) FROM reducing_saver_outbox").fetchall()
        return {key: None if text in (None, "null") else text for key, text in rows}
    with box._pool.connection() as conn:
        rows = conn.execute("SELECT key, message::text AS text FROM reducing_saver_outbox").fetchall()
        return {row["key"]: None if row["text"] == "null" else row["text"] for row in rows}


def test_delivered_rows_keep_their_key_and_drop_the_message(outbox):
    recorded = entries(3)
    assert outbox.record(recorded) == 3
    first, second, third = outbox.claim("w", 3, 30)
    assert outbox.complete("w", [first.ident, second.ident]) == 2
    assert outbox.fail("w", third.ident, "RuntimeError: broken", dead=True)
    held = stored_messages(outbox)
    assert held[first.key] is None and held[second.key] is None
    assert held[third.key] is not None
    # The keys still deduplicate: a later put pruning the same messages records nothing.
    assert outbox.record(recorded) == 0
    status(outbox, pending=0, delivered=2, dead=1)
    # A dead letter keeps its payload, so it can be retried and delivered.
    (dead,) = outbox.dead_letters()
    assert dead.message == third.message == recorded[2].message
    assert outbox.retry_dead() == 1
    (retried,) = outbox.claim("w2", 10, 30)
    assert retried.message == recorded[2].message
    assert outbox.complete("w2", [retried.ident]) == 1
    assert set(stored_messages(outbox).values()) == {None}


def test_forget_takes_a_row_from_its_deliverer_and_keeps_the_key_out(outbox):
    """A deletion (a message the agent deleted on purpose) is a row without a message: pending again
    whatever it was, taken from a deliverer holding it (its completion finds nothing), claimed as a
    deletion, and once done a later record of the key stays out."""
    held, delivered, unseen = entries(3)
    outbox.record([held, delivered])
    first, second = outbox.claim("w", 2, 30)
    assert outbox.complete("w", [second.ident]) == 1
    never = dataclasses.replace(unseen, message=None, message_class=None)
    assert outbox.forget([dataclasses.replace(e, message=None) for e in (held, delivered)] + [never]) == 3
    assert outbox.complete("w", [first.ident]) == 0  # "w" delivered it meanwhile: the deletion runs after
    claimed = outbox.claim("w2", 10, 30)
    assert sorted(e.key for e in claimed) == sorted(e.key for e in (held, delivered, unseen))
    assert all(e.message is None for e in claimed)
    assert outbox.complete("w2", [e.ident for e in claimed]) == 3
    assert outbox.record([held, delivered, unseen]) == 0
    assert outbox.claim("w3", 10, 30) == []


def test_fail_needs_exactly_one_outcome(outbox):
    outbox.record(entries(1))
    (e,) = outbox.claim("w", 1, 30)
    with pytest.raises(TypeError):
        outbox.fail("w", e.ident, "x")
    with pytest.raises(TypeError):
        outbox.fail("w", e.ident, "x", retry_at=datetime.now(UTC), dead=True)


def test_an_error_quoting_what_the_database_cannot_hold_fails_only_its_message(outbox):
    """An extractor's error may quote the content it failed on, NUL and lone surrogates included: the
    message is a retry or a dead letter with that error escaped, the others are delivered, and the
    deliverer's round does not fail (which would hold back every row of its claim)."""
    outbox.record(entries(3))
    poisoned = "m-0001"

    def extractor(batch, namespace):
        if any(e.key == poisoned for e in batch):
            raise ValueError("the model answered 'x\x00y' and then '\ud800'")

    deliverer = Deliverer(outbox, extractor, worker_id="w", max_attempts=2, base_backoff=0, max_backoff=0)
    assert deliverer.run_once() == 2  # not an exception
    status(outbox, delivered=2, pending=1)
    assert deliverer.run_once() == 0
    status(outbox, delivered=2, pending=0, dead=1)
    (dead,) = outbox.dead_letters()
    assert dead.key == poisoned
    assert "the model answered 'x\\x00y' and then '\\ud800'" in dead.last_error


def test_a_newer_version_of_a_message_replaces_its_row_and_is_delivered_again(outbox):
    """The same key saying something else (an edit with the same id) is recorded again, however far the
    first version went (pending, delivered, dead); the same version again changes nothing."""
    first = make_entries([HumanMessage("my name is Alice", id="m")], NS, thread_id="t")
    edited = make_entries([HumanMessage("CORRECTION: my name is Bob", id="m")], NS, thread_id="t")
    assert first[0].fingerprint != edited[0].fingerprint
    assert outbox.record(first) == 1
    (claimed,) = outbox.claim("w", 10, 30)
    assert outbox.complete("w", [claimed.ident]) == 1
    outbox.record(first)  # a later put of the same turn: nothing to do
    status(outbox, pending=0, delivered=1)
    outbox.record(edited)
    status(outbox, pending=1, delivered=0)
    (again,) = outbox.claim("w", 10, 30)
    assert again.message["content"] == "CORRECTION: my name is Bob" and again.attempts == 1
    outbox.fail("w", again.ident, "boom", dead=True)
    outbox.record(edited)
    status(outbox, pending=0, dead=1)  # the same version: the dead letter stays
    outbox.record(first)  # a put from before the edit (a fork, say): the version last recorded wins
    (back,) = outbox.claim("w", 10, 30)
    assert back.message["content"] == "my name is Alice"


def test_retry_dead_by_key_and_purge_delivered(outbox):
    outbox.record(entries(3))
    claimed = outbox.claim("w", 3, 30)
    for e in claimed[:2]:
        outbox.fail("w", e.ident, "boom", dead=True)
    outbox.complete("w", [claimed[2].ident])
    assert outbox.retry_dead([claimed[0].ident]) == 1
    status(outbox, pending=1, dead=1, delivered=1)
    assert outbox.purge_delivered(3600) == 0
    assert outbox.purge_delivered(0) == 1
    status(outbox, pending=1, dead=1, delivered=0)


def test_a_crashed_workers_rows_come_back_after_the_lease(outbox):
    outbox.record(entries(5))
    crashed = outbox.claim("crashed", 10, 1.0)  # never completes
    assert len(crashed) == 5
    assert outbox.claim("survivor", 10, 30) == []
    status(outbox, in_flight=5, pending=0)
    time.sleep(1.2)
    status(outbox, in_flight=0, pending=5)
    back = outbox.claim("survivor", 10, 30)
    assert len(back) == 5 and all(e.attempts == 2 for e in back)
    # The crashed worker, should it wake up, can no longer complete them.
    assert outbox.complete("crashed", [e.ident for e in crashed]) == 0
    assert outbox.complete("survivor", [e.ident for e in back]) == 5
    status(outbox, delivered=5, in_flight=0, pending=0)


def test_renewal_keeps_a_lease_alive(outbox):
    outbox.record(entries(3))
    held = outbox.claim("slow", 10, 1.0)
    for _ in range(3):
        time.sleep(0.4)
        assert outbox.renew("slow", [e.ident for e in held], 1.0) == 3
    assert outbox.renew("other", [e.ident for e in held], 1.0) == 0
    assert outbox.claim("other", 10, 1.0) == []  # 1.2 s after a 1 s claim
    assert outbox.renew("slow", None, 1.0) == 3


def test_a_slow_extractor_causes_no_duplicates_thanks_to_renewal(outbox):
    outbox.record(entries(8))
    delivered: Counter = Counter()
    lock = threading.Lock()

    def extractor(batch, namespace, delay):
        time.sleep(delay)
        with lock:
            delivered.update(e.key for e in batch)

    slow = Deliverer(outbox, lambda b, ns: extractor(b, ns, 1.6), worker_id="slow", lease_seconds=1.0)
    fast = Deliverer(outbox, lambda b, ns: extractor(b, ns, 0), worker_id="fast", lease_seconds=1.0)
    worker = threading.Thread(target=slow.run_once)
    worker.start()
    time.sleep(0.1)
    while worker.is_alive():  # the other worker keeps trying to claim while the slow one extracts
        fast.run_once()
        time.sleep(0.05)
    worker.join()
    assert fast.run_once() == 0
    assert delivered == Counter({e.key: 1 for e in entries(8)})
    status(outbox, delivered=8, pending=0, in_flight=0)


def test_without_renewal_the_same_slow_extractor_duplicates(fresh_pg, monkeypatch):
    """The control for the test above: it does detect a missing renewal."""
    monkeypatch.setattr(LeaseRenewer, "run", lambda self: None)
    with PostgresOutbox(fresh_pg) as outbox:
        outbox.setup()
        outbox.record(entries(4))
        delivered: Counter = Counter()
        slow = Deliverer(
            outbox,
            lambda b, ns: (time.sleep(1.6), delivered.update(e.key for e in b)),
            worker_id="slow",
            lease_seconds=1.0,
        )
        fast = Deliverer(
            outbox, lambda b, ns: delivered.update(e.key for e in b), worker_id="fast", lease_seconds=1.0
        )
        worker = threading.Thread(target=slow.run_once)
        worker.start()
        time.sleep(0.1)  # the slow worker claims first, as in the test above
        while worker.is_alive():
            fast.run_once()
            time.sleep(0.05)
        worker.join()
        assert set(delivered.values()) == {2}


def test_a_row_that_keeps_crashing_its_worker_is_parked():
    outbox = MemoryOutbox()
    outbox.record(entries(1))
    for _ in range(3):  # three workers die holding it
        assert len(outbox.claim("doomed", 1, 0.01)) == 1
        time.sleep(0.02)
    calls = []
    deliverer = Deliverer(outbox, lambda b, ns: calls.append(b), max_attempts=3, lease_seconds=5)
    assert deliverer.run_once() == 0
    assert calls == []
    (dead,) = outbox.dead_letters()
    assert dead.attempts == 4 and "claimed 4 times without an outcome" in dead.last_error


def test_postgres_outbox_on_a_pool_shaped_like_the_backends(fresh_pg):
    """The put path records on the backend's pool: autocommit, prepare_threshold=0, dict rows."""
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool

    for kwargs in ({"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}, {}):
        with ConnectionPool(fresh_pg, min_size=1, max_size=2, kwargs=kwargs, open=True) as pool:
            box = PoolOutbox(pool)
            box.setup()
            box.record(entries(3, prefix=f"p{len(kwargs)}"))
            claimed = box.claim("w", 10, 30)
            assert len(claimed) == 3
            assert box.complete("w", [e.ident for e in claimed]) == 3
            box.close()  # not its pool: stays open
            assert not pool.closed
    with PostgresOutbox(fresh_pg) as box:
        status(box, delivered=6, pending=0)


def _outbox_counts(pool, view: str, columns: str) -> tuple[int, ...]:
    """The outbox table's ``columns`` of a statistics ``view`` so far, on a pool of one connection: what
    that connection did is reported first (``pg_stat_force_next_flush``, done when it goes idle)."""
    with pool.connection() as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        return tuple(
            conn.execute(
                f"SELECT {columns} FROM {view} WHERE relid = 'reducing_saver_outbox'::regclass"
            ).fetchone()
        )


def _updates(pool) -> tuple[int, ...]:
    """The outbox table's ``(updates, HOT updates)`` so far."""
    return _outbox_counts(pool, "pg_stat_user_tables", "n_tup_upd, n_tup_hot_upd")


def test_a_postgres_claim_writes_no_index_entry(fresh_pg):
    """A claim changes no indexed column and finds room on each row's page: every row it takes is a HOT
    update (PostgreSQL's own count), however many rows of a page it takes at once."""
    from psycopg_pool import ConnectionPool

    # Messages of 40 to 2,000 characters (the longest below PostgreSQL's TOAST threshold), in key order.
    made = make_entries(
        [HumanMessage("w " * (20 + (i * 37) % 980), id=f"m-{i:04d}") for i in range(300)],
        NS,
        thread_id="t-1",
        checkpoint_id="cp-1",
    )
    with ConnectionPool(fresh_pg, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:
        box = PoolOutbox(pool)
        box.setup()
        box.record(made)
        before = _updates(pool)
        # A worker id as default_worker_id() makes one in a Kubernetes pod (host:pid:random).
        claimed = [box.claim("reducing-saver-7d9f8b6c5d-x2x4q:4242:1a2b3c4d", 100, 30) for _ in range(3)]
        after = _updates(pool)
    assert [len(batch) for batch in claimed] == [100, 100, 100]
    updates, hot = (now - then for now, then in zip(after, before, strict=True))
    assert (updates, hot) == (300, 300)


# -- PostgreSQL under concurrency -----------------------------------------------------------------


def test_setup_from_many_replicas_at_once(fresh_pg):
    boxes = [PostgresOutbox(fresh_pg, pool_size=1) for _ in range(4)]
    errors = []

    def run(box):
        try:
            box.setup()
        except Exception as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(box,)) for box in boxes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for box in boxes:
        box.close()
    assert errors == []


def test_record_from_two_pools_at_once_keeps_each_message_once(fresh_pg):
    """Several puts of one turn on several replicas record overlapping sets concurrently, in any order."""
    first, second = PostgresOutbox(fresh_pg, pool_size=4), PostgresOutbox(fresh_pg, pool_size=4)
    first.setup()
    made = [e for ns in range(3) for e in entries(100, namespace=("memories", f"user-{ns}"))]
    inserted: list[int] = []
    offered: set = set()
    errors: list[Exception] = []
    lock = threading.Lock()

    def put_turns(box, seed):
        rng = random.Random(seed)
        try:
            for _ in range(5):
                batch = rng.sample(made, 150)  # overlapping, shuffled: record must sort and skip
                n = box.record(batch)
                with lock:
                    inserted.append(n)
                    offered.update(e.ident for e in batch)
        except Exception as exc:  # pragma: no cover - a deadlock or a unique violation
            errors.append(exc)

    threads = [
        threading.Thread(target=put_turns, args=(box, seed)) for seed, box in enumerate([first, second] * 4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(inserted) == len(offered)
    assert second.record(made) == len(made) - len(offered)
    assert first.record(made) == 0
    with psycopg.connect(fresh_pg) as conn:
        total, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT (namespace, key)) FROM reducing_saver_outbox"
        ).fetchone()
    assert total == distinct == len(made)
    first.close()
    second.close()


def test_a_put_recording_messages_already_in_the_outbox_never_deadlocks_with_their_deliverer(fresh_pg):
    """A put records every message its list cuts, so the later puts of a turn record again the rows its
    earlier puts recorded (an upsert: each row found is locked until the put commits), while a deliverer
    renews, completes, releases and purges those rows, several in one statement. Both sides must take
    their rows' locks in one order, key order, or two of them wait on each other until PostgreSQL ends
    one with ``deadlock detected`` (a put answering 503 a second later)."""
    box = PostgresOutbox(fresh_pg, pool_size=2)
    box.setup()
    made = entries(40, prefix="again-")
    for entry in reversed(made):  # the table's order is not key order
        box.record([entry])
    stop = threading.Event()
    failures: list[BaseException] = []
    rounds = Counter()

    def put_turns() -> None:
        with psycopg.connect(fresh_pg, autocommit=True) as conn:
            while not stop.is_set():
                try:
                    with conn.transaction(), conn.pipeline(), conn.cursor() as cur:
                        insert_entries(cur, made)
                    rounds["put"] += 1
                except psycopg.Error as exc:
                    failures.append(exc)

    def deliver() -> None:
        while not stop.is_set():
            try:
                held = [e.ident for e in box.claim("w", len(made), 30)]
                box.renew("w", held, 30)
                box.complete("w", held[::2])
                box.release("w", held[1::2])
                box.purge_delivered(0)  # a re-recorded key whose row is purged is new again
                rounds["deliverer"] += 1
            except psycopg.Error as exc:
                failures.append(exc)

    threads = [threading.Thread(target=put_turns), threading.Thread(target=deliver)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    print(f"{rounds['put']} puts, {rounds['deliverer']} rounds of the deliverer, {len(failures)} failed")
    assert failures == []
    assert rounds["put"] > 10 and rounds["deliverer"] > 10
    box.close()


def _deliver_in_process(url: str, worker_id: str, ready, go, stop) -> None:
    """A deliverer in a process of its own, recording every delivery in a table."""
    import psycopg as pg

    from reducing_saver.service.extraction.deliverer import Deliverer as ChildDeliverer
    from tests.support.storage import OwnPoolOutbox as ChildOutbox

    conn = pg.connect(url, autocommit=True)

    def extractor(batch, namespace):
        time.sleep(0.002 * len(batch))
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO deliveries (namespace, key, worker) VALUES (%s, %s, %s)",
                [(list(namespace), e.key, worker_id) for e in batch],
            )

    with ChildOutbox(url, pool_size=2) as outbox:
        deliverer = ChildDeliverer(
            outbox, extractor, worker_id=worker_id, batch_size=20, lease_seconds=5, idle_sleep=0.05
        )
        ready.set()
        go.wait(60)  # both processes start claiming together
        deliverer.run_forever(stop)
    conn.close()


@pytest.mark.e2e  # starts processes
def test_two_processes_deliver_500_entries_exactly_once(fresh_pg):
    with PostgresOutbox(fresh_pg) as outbox:
        outbox.setup()
        with psycopg.connect(fresh_pg, autocommit=True) as conn:
            conn.execute("CREATE TABLE deliveries (namespace text[], key text, worker text)")
        made = [e for ns in range(10) for e in entries(50, namespace=("memories", f"user-{ns}"))]
        assert outbox.record(made) == 500

        ctx = multiprocessing.get_context("spawn")
        go, stop = ctx.Event(), ctx.Event()
        ready = [ctx.Event() for _ in range(2)]
        workers = [
            ctx.Process(target=_deliver_in_process, args=(fresh_pg, f"proc-{i}", ready[i], go, stop))
            for i in range(2)
        ]
        for p in workers:
            p.start()
        for event in ready:
            assert event.wait(60)
        started = time.monotonic()
        go.set()
        deadline = time.monotonic() + 45
        while outbox.status()["delivered"] < 500 and time.monotonic() < deadline:
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        stop.set()
        for p in workers:
            p.join(20)
            assert p.exitcode == 0
        print(f"two processes delivered 500 entries in {elapsed:.2f} s")

        status(outbox, delivered=500, pending=0, in_flight=0, dead=0)
        with psycopg.connect(fresh_pg) as conn:
            rows = conn.execute("SELECT namespace, key, worker FROM deliveries").fetchall()
        per_message = Counter((tuple(ns), key) for ns, key, _ in rows)
        assert len(rows) == 500
        assert set(per_message) == {e.ident for e in made}
        assert set(per_message.values()) == {1}
        per_worker = Counter(worker for _, _, worker in rows)
        assert set(per_worker) == {"proc-0", "proc-1"}, per_worker


def test_postgres_record_sends_one_insert_per_thousand_rows(fresh_pg, monkeypatch):
    """Rows go in chunks of 1000 (the statement's parameter limit), each row once, not one chunk per row."""
    outbox = PostgresOutbox(fresh_pg)
    try:
        inserts: list[int] = []
        execute = psycopg.Cursor.execute

        def counting(self, query, params=None, **kwargs):
            if "INSERT INTO reducing_saver_outbox" in str(query):
                inserts.append(len(params) // 8)
            return execute(self, query, params, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", counting)
        messages = [HumanMessage(f"m{i}", id=f"m-{i:05d}") for i in range(2500)]
        made = make_entries(messages, ("memories", "t"), thread_id="t")
        assert outbox.record(made) == 2500
        assert inserts == [1000, 1000, 500]
    finally:
        outbox.close()


def _heap_blocks_read(pool) -> int:
    """The outbox table's heap blocks read so far, from shared buffers or not."""
    return _outbox_counts(pool, "pg_statio_user_tables", "heap_blks_hit + heap_blks_read")[0]


def _record_in_a_put_pipeline(pool, made: list[OutboxEntry]) -> None:
    """Record as a put of the PostgreSQL backend does: queued in the put's pipeline."""
    with pool.connection() as conn, conn.pipeline(), conn.cursor() as cur:
        insert_entries(cur, made)


@pytest.mark.parametrize("path", ["record", "put pipeline"])
def test_a_postgres_outbox_finds_its_rows_by_key_however_much_it_grew_since_its_first_statements(
    fresh_pg, path
):
    """A new deployment's first puts and claims run on an empty outbox, and its connections keep their
    statements prepared (psycopg prepares one after its fifth run). A plan kept from those first runs
    would read the whole table to revise or claim two rows once it has grown, until autovacuum's first
    ANALYZE of the table (never, where autovacuum is off): recording and claiming must read the rows they
    touch, whatever the table held when the connection first ran them."""
    from psycopg_pool import ConnectionPool

    with ConnectionPool(fresh_pg, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:
        box = PoolOutbox(pool)
        box.setup()
        record = box.record if path == "record" else functools.partial(_record_in_a_put_pipeline, pool)
        with pool.connection() as conn:
            conn.execute("ALTER TABLE reducing_saver_outbox SET (autovacuum_enabled = off)")
        for i in range(12):
            record(entries(2, prefix=f"early-{i}-"))
            assert box.complete("w", [e.ident for e in box.claim("w", 2, 30)]) == 2
        box.record(entries(20_000, prefix="later-"))
        with pool.connection() as conn:
            pages = conn.execute("SELECT pg_relation_size('reducing_saver_outbox') / 8192").fetchone()[0]

        start = _heap_blocks_read(pool)
        record(entries(2, prefix="new-"))
        recorded = _heap_blocks_read(pool)
        assert len(box.claim("w", 2, 30)) == 2
        claimed = _heap_blocks_read(pool)
        with pool.connection() as conn:
            new = conn.execute(
                "SELECT count(*) FROM reducing_saver_outbox WHERE key LIKE 'new-%%'"
            ).fetchone()[0]

    assert new == 2
    assert pages > 2_000
    # The rows' own pages, and the pages of rows whose index entries the scans pass: tens, not thousands.
    assert recorded - start < 50
    assert claimed - recorded < 50


def test_a_postgres_deliverer_finds_its_rows_by_key_however_much_the_outbox_grew_since_its_first_claims(
    fresh_pg,
):
    """The deliverer's renewals, completions, failures and releases name rows by key. Prepared on a new
    deployment's empty outbox, their plans would read the whole table for two rows once it has grown
    (as the recording's did, above): each must read the rows it names, whatever the table held when the
    connection first ran it."""
    from psycopg_pool import ConnectionPool

    with ConnectionPool(fresh_pg, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:
        box = PoolOutbox(pool)
        box.setup()
        with pool.connection() as conn:
            conn.execute("ALTER TABLE reducing_saver_outbox SET (autovacuum_enabled = off)")
        later = datetime.now(UTC) + timedelta(hours=1)
        for i in range(12):
            box.record(entries(4, prefix=f"early-{i}-"))
            first, second, third, fourth = (e.ident for e in box.claim("w", 4, 30))
            assert box.renew("w", [first, second], 30) == 2
            assert box.complete("w", [first, second]) == 2
            assert box.fail("w", third, "the extractor failed", retry_at=later)
            assert box.release("w", [fourth]) == 1
        box.record(entries(20_000, prefix="later-"))

        first, second, third, fourth = (e.ident for e in box.claim("w", 4, 30))
        read = [_heap_blocks_read(pool)]
        assert box.renew("w", [first, second], 30) == 2
        read.append(_heap_blocks_read(pool))
        assert box.complete("w", [first, second]) == 2
        read.append(_heap_blocks_read(pool))
        assert box.fail("w", third, "the extractor failed", retry_at=later)
        read.append(_heap_blocks_read(pool))
        assert box.release("w", [fourth]) == 1
        read.append(_heap_blocks_read(pool))

    renewed, completed, failed, released = (after - before for before, after in itertools.pairwise(read))
    # The rows' own pages and their neighbours' in the index: a handful, not the table's 2,000 and more.
    assert renewed < 50
    assert completed < 50
    assert failed < 50
    assert released < 50
