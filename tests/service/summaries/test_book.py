"""The book of running summaries on the three backends: requests once, claims in order, compare-and-set
completion, retries and dead letters, a thread's steps going with it."""

from __future__ import annotations

import time

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base import empty_checkpoint

from reducing_saver.reducer import StepRequest, step_id
from reducing_saver.service.storage import open_backend


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend(request, tmp_path):
    if request.param == "memory":
        url = "memory://"
    elif request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/service.sqlite"
    else:
        url = request.getfixturevalue("fresh_pg")
    opened = open_backend(url, pool_size=2, timeout=10.0)
    opened.setup()
    yield opened
    opened.close()


def step(base: str | None, keys: list[str], thread: str = "t", ns: str = "", version: int = 1) -> StepRequest:
    batch = [HumanMessage(f"FACT: {k}\x00nul", id=k) for k in keys]
    return StepRequest(
        thread, ns, step_id(base, keys), base, version, tuple(keys), batch, version * len(keys)
    )


def test_request_is_idempotent_and_children_are_found_by_base(backend):
    book = backend.summaries()
    first = step(None, ["a", "b"])
    book.request(first)
    book.request(first)
    (child,) = book.children("t", "", None)
    assert child.step_id == first.step_id and child.keys == ("a", "b") and child.status == "pending"
    assert book.children("t", "", first.step_id) == []
    assert book.children("other", "", None) == []
    assert book.steps("t", "", [first.step_id, "nope"]).keys() == {first.step_id}


def test_a_chain_of_lagging_steps_is_read_back_from_its_tip_in_one_call(backend):
    """A summary far behind names only the ends of its lagging chain; the book walks the links."""
    book = backend.summaries()
    done = step(None, ["d"])
    book.request(done)
    assert book.complete(done, "summary D")
    base, chain = done.step_id, []
    for n in range(30):
        request = step(base, [f"k{n}"], version=n + 2)
        book.request(request)
        chain.append(request.step_id)
        base = request.step_id
    book.request(step(chain[10], ["fork"], version=12))  # another branch off the chain: not on the path
    found = book.chain("t", "", chain[-1], done.step_id)
    assert [info.step_id for info in found] == chain
    assert found[0].base_step == done.step_id and [info.version for info in found] == list(range(2, 32))
    assert [info.step_id for info in book.chain("t", "", chain[4], chain[1])] == chain[2:5]
    assert [info.step_id for info in book.chain("t", "", done.step_id, None)] == [done.step_id]
    assert book.chain("other", "", chain[-1], None) == []


@pytest.fixture(params=["sqlite", "postgres"])
def sql_backend(request, tmp_path):
    """The backends whose book keeps batches as bytes (memory:// keeps objects: nothing to corrupt)."""
    url = (
        f"sqlite:///{tmp_path}/service.sqlite"
        if request.param == "sqlite"
        else request.getfixturevalue("fresh_pg")
    )
    opened = open_backend(url, pool_size=2, timeout=10.0)
    opened.setup()
    yield opened
    opened.close()


def test_a_batch_that_cannot_be_read_is_a_dead_letter_and_the_next_step_is_claimed(sql_backend):
    """One unreadable row (not JSON) is parked with its reason; it never fails the claim, which would
    hand the same row back ahead of every other step."""
    book = sql_backend.summaries()
    broken, fine = step(None, ["a"], thread="broken"), step(None, ["b"], thread="fine")
    book.request(broken)
    book.request(fine)
    with book._tx() as cur:
        cur.execute(
            f"UPDATE reducing_saver_summaries SET batch = {book.sql.mark} WHERE thread_id = 'broken'",
            (b"\x00not json",),
        )
    claimed = book.claim("w", 60)
    assert claimed is not None and claimed.request.thread_id == "fine"
    (dead,) = book.dead_letters()
    assert dead.thread_id == "broken" and "JSONDecodeError" in dead.last_error


def test_a_step_is_claimed_only_once_its_base_is_done_and_completes_once(backend):
    book = backend.summaries()
    first, second = step(None, ["a"]), None
    second = step(first.step_id, ["b"], version=2)
    book.request(second)
    book.request(first)
    claimed = book.claim("w1", 60)
    assert claimed.request.step_id == first.step_id and claimed.previous is None
    assert claimed.request.batch[0]["content"] == "FACT: a\x00nul"  # NUL survives (bytea/blob)
    assert book.claim("w2", 60) is None  # the first is leased, the second waits for its base
    assert book.complete(first, "summary A", model="m", prompt_hash="h", input_tokens=3, output_tokens=2)
    assert not book.complete(first, "summary A again")  # a second call of the same step: no effect
    assert book.steps("t", "", [first.step_id])[first.step_id].text == "summary A"
    claimed = book.claim("w2", 60)
    assert claimed.request.step_id == second.step_id and claimed.previous == "summary A"


def test_failures_retry_then_park_and_retry_dead_sends_them_back(backend):
    book = backend.summaries()
    first = step(None, ["a"])
    book.request(first)
    claimed = book.claim("w", 60)
    assert book.fail("w", claimed.request, "boom", retry_at=time.time() + 3600)
    assert book.claim("w", 60) is None  # waiting for its retry
    assert book.status()["pending_steps"] == 1
    book.retry_dead()  # not dead: nothing changes
    assert book.claim("w", 60) is None
    # A lease that ran out makes the step claimable again (a crashed worker).
    other = step(None, ["z"])
    book.request(other)
    assert book.claim("w1", 0.01).request.step_id == other.step_id
    time.sleep(0.05)
    again = book.claim("w2", 60)
    assert again.request.step_id == other.step_id and again.attempts == 2
    assert book.fail("w2", again.request, "gave up")  # dead
    assert book.status()["dead_steps"] == 1
    assert [d.step_id for d in book.dead_letters()] == [other.step_id]
    assert book.retry_dead() == 1
    assert book.claim("w3", 60).request.step_id == other.step_id


def test_a_threads_steps_go_with_it(backend):
    book = backend.summaries()
    first = step(None, ["a"])
    book.request(first)
    book.copy_thread("t", "copy")
    assert [c.step_id for c in book.children("copy", "", None)] == [first.step_id]
    book.delete_thread("t")
    assert book.children("t", "", None) == []
    assert book.children("copy", "", None) != []
    # A thread with a checkpoint keeps its steps; one whose checkpoints are gone (a TTL sweep,
    # delete_for_runs) loses them once they are older than the grace.
    kept = step(None, ["k"], thread="alive")
    book.request(kept)
    saver = backend.savers(1)[0]
    checkpoint = empty_checkpoint()
    saver.put({"configurable": {"thread_id": "alive", "checkpoint_ns": ""}}, checkpoint, {}, {})
    assert book.forget_orphans(grace_seconds=3600) == 0  # too young
    assert book.forget_orphans(grace_seconds=-1) == 1
    assert book.children("copy", "", None) == []
    assert [c.step_id for c in book.children("alive", "", None)] == [kept.step_id]


def test_retry_dead_on_the_command_line_sends_dead_batches_back(tmp_path):
    import json
    import subprocess

    from tests.support.server import CLI

    url = f"sqlite:///{tmp_path}/service.sqlite"
    opened = open_backend(url)
    opened.setup()
    book = opened.summaries()
    first = step(None, ["a"])
    book.request(first)
    book.fail("w", book.claim("w", 60).request, "model gone")
    opened.close()
    status = subprocess.run(
        [str(CLI), "extraction", "status", "--database", url],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(status.stdout)["summaries"]["dead_steps"] == 1
    retried = subprocess.run(
        [str(CLI), "extraction", "retry-dead", "--database", url],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(retried.stdout)["summary_steps_requeued"] == 1
    opened = open_backend(url)
    try:
        assert opened.summaries().claim("w2", 60).request.step_id == first.step_id
    finally:
        opened.close()


def test_a_lease_is_renewed_only_by_its_holder_while_the_step_is_pending(backend):
    book = backend.summaries()
    first = step(None, ["a"])
    book.request(first)
    claimed = book.claim("w1", 0.2)
    assert book.renew("w1", claimed.request, 60)
    time.sleep(0.3)  # past the claim's own lease: the renewal holds it
    assert book.claim("w2", 60) is None
    assert not book.renew("w2", claimed.request, 60)  # not its step
    # The lease lost (a renewal that came too late, another worker claimed it): no renewal takes it back.
    book.renew("w1", claimed.request, 0.01)
    time.sleep(0.05)
    assert book.claim("w2", 60).request.step_id == first.step_id
    assert not book.renew("w1", claimed.request, 60)
    assert book.complete(first, "done by w2")
    assert not book.renew("w2", claimed.request, 60)  # done: nothing to hold


def _checkpoint(saver, thread: str, run_id: str, ns: str = "") -> None:
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
    saver.put(config, empty_checkpoint(), {"run_id": run_id}, {})


def _steps_of(book, thread: str, ns: str = "") -> list[str]:
    return [c.step_id for c in book.children(thread, ns, None)]


def test_delete_for_runs_forgets_the_steps_of_the_namespaces_it_empties_at_once(backend):
    book = backend.summaries()
    saver = backend.savers(1)[0]
    gone, kept, other = step(None, ["a"], thread="gone"), step(None, ["b"], thread="kept"), step(None, ["c"])
    for request in (gone, kept, other):
        book.request(request)
    _checkpoint(saver, "gone", "run-1")
    _checkpoint(saver, "kept", "run-1")
    _checkpoint(saver, "kept", "run-2")  # the thread keeps a checkpoint of another run
    _checkpoint(saver, "t", "run-2")
    saver.delete_for_runs(["run-1"])
    assert _steps_of(book, "gone") == []  # at once, not after the orphan sweep's grace
    assert _steps_of(book, "kept") == [kept.step_id]
    assert _steps_of(book, "t") == [other.step_id]
    # Tenant-scoped (the service's prefix): only the tenant's threads, their steps with them.
    for thread in ("acme:x", "rival:x"):
        book.request(step(None, ["d"], thread=thread))
        _checkpoint(saver, thread, "run-3")
    saver.delete_for_runs(["run-3"], thread_id_prefix="acme:")
    assert _steps_of(book, "acme:x") == [] and _steps_of(book, "rival:x") != []


@pytest.mark.parametrize("strategy", ["delete", "keep_latest"])
def test_a_ttl_sweep_forgets_the_steps_of_what_it_deletes_at_once(backend, strategy):
    from reducing_saver.service.storage.ledger import Policy

    book = backend.summaries()
    saver = backend.savers(1)[0]
    ledger = backend.ledger(window=lambda *args: [], recorder=None, worker_id="sweeper")
    root, call = step(None, ["a"], thread="idle"), step(None, ["s"], thread="idle", ns="child:1")
    book.request(root)
    book.request(call)
    _checkpoint(saver, "idle", "run-1")
    _checkpoint(saver, "idle", "run-2")
    ledger.touch("idle", 0.01, None)
    time.sleep(0.05)
    if strategy == "keep_latest":
        book.request(step(None, ["z"], thread="idle", ns="never-stored"))  # no checkpoint: forgotten too
    with ledger.session(Policy(strategy, None)) as session:
        outcome = session.handle("idle")
    assert outcome is not None and outcome.action == ("deleted" if strategy == "delete" else "pruned")
    # Deleted: every step of the thread; pruned to its head: the steps of namespaces it still has.
    assert _steps_of(book, "idle") == ([] if strategy == "delete" else [root.step_id])
    assert _steps_of(book, "idle", "child:1") == []
    assert _steps_of(book, "idle", "never-stored") == []
    ledger.close()


def test_delete_thread_with_extraction_and_prune_delete_forget_the_steps(backend):
    book = backend.summaries()
    saver = backend.savers(1)[0]
    ledger = backend.ledger(window=lambda *args: [], recorder=None, worker_id="w")
    for thread in ("extracted", "pruned"):
        book.request(step(None, ["a"], thread=thread))
        _checkpoint(saver, thread, "run-1")
    ledger.delete_extracting("extracted", None)  # a client's delete_thread under --extract-on-delete
    saver.prune(["pruned"], strategy="delete")
    assert _steps_of(book, "extracted") == [] and _steps_of(book, "pruned") == []
    ledger.close()
