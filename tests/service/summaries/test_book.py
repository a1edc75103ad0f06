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
