"""The book of running summaries under encryption, on SQLite and PostgreSQL: each step's text and batch
are ciphertext bound to (tenant, thread, namespace, step); a changed or moved row fails its integrity
check naming the thread, ``required`` refuses a plain row, ``migrate`` reads it, and ``copy_thread``
seals the copy again for its target."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from reducing_saver.reducer import StepRequest, step_id
from reducing_saver.service.encryption import (
    Cipher,
    IntegrityError,
    PlainTextRefused,
    Sealer,
    load_keyring,
)
from reducing_saver.service.encryption.summaries import SummarySealer
from reducing_saver.service.storage import open_backend
from tests.support.encryption import new_key, ring_json

SENTINEL = "SENTINEL-summary"
THREAD = "acme:t-1"


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path}/s.sqlite" if request.param == "sqlite" else request.getfixturevalue("fresh_pg")
    )
    opened = open_backend(url, pool_size=2)
    opened.setup()
    yield opened
    opened.close()


@pytest.fixture
def ring():
    return load_keyring(ring_json("k1", k1=new_key()))


def _sealer(ring, mode: str = "required") -> SummarySealer:
    return SummarySealer(Sealer(Cipher(ring), mode, tenant_mode=True))


def _query(backend, sql: str, params: tuple = ()) -> list[tuple]:
    """Raw SQL on the backend's database (``?`` placeholders)."""
    if backend.kind == "sqlite":
        import sqlite3

        with sqlite3.connect(backend.path) as conn:
            return conn.execute(sql, params).fetchall()
    from psycopg.rows import tuple_row

    with backend.pool.connection() as conn, conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(sql.replace("?", "%s"), params)
        return cur.fetchall() if cur.description else []


def _step(thread_id: str, base: str | None, keys: list[str], version: int) -> StepRequest:
    batch = [HumanMessage(f"{key} {SENTINEL}", id=key) for key in keys]
    return StepRequest(
        thread_id, "", step_id(base, keys), base, version, tuple(keys), batch, version * len(keys)
    )


def _summarize(book, thread_id: str = THREAD) -> tuple[StepRequest, StepRequest]:
    """Two steps of ``thread_id``, each summarized with the batch's text."""
    first = _step(thread_id, None, ["m1"], 1)
    second = _step(thread_id, first.step_id, ["m2"], 2)
    for step in (first, second):
        book.request(step)
        claimed = book.claim("w", 30)
        assert claimed.request.step_id == step.step_id
        text = "\n".join(filter(None, [claimed.previous, *(m["content"] for m in claimed.request.batch)]))
        assert book.complete(claimed.request, text)
    return first, second


def test_text_and_batch_are_sealed_and_read_back(backend, ring):
    book = backend.summaries()
    book.sealer = _sealer(ring)
    _, second = _summarize(book)
    stored = _query(backend, "SELECT text, batch FROM reducing_saver_summaries")
    assert len(stored) == 2
    for text, batch in stored:
        assert SENTINEL not in text and SENTINEL.encode() not in bytes(batch)
    info = book.steps(THREAD, "", [second.step_id])[second.step_id]
    assert info.text == f"m1 {SENTINEL}\nm2 {SENTINEL}"


@pytest.mark.parametrize("tamper", ["flip", "another step", "another thread", "batch onto text"])
def test_a_changed_or_moved_summary_fails_naming_the_thread(backend, ring, tamper):
    book = backend.summaries()
    book.sealer = _sealer(ring)
    first, second = _summarize(book)
    _summarize(book, "acme:t-2")
    where = "thread_id = ? AND step_id = ?"
    if tamper == "flip":
        (text,) = _query(
            backend, f"SELECT text FROM reducing_saver_summaries WHERE {where}", (THREAD, second.step_id)
        )[0]
        changed = text[:-6] + ("A" if text[-6] != "A" else "B") + text[-5:]
        _query(
            backend,
            f"UPDATE reducing_saver_summaries SET text = ? WHERE {where}",
            (changed, THREAD, second.step_id),
        )
    else:
        source = {
            "another step": (THREAD, first.step_id),
            "another thread": ("acme:t-2", second.step_id),
            "batch onto text": (THREAD, second.step_id),
        }[tamper]
        column = "batch" if tamper == "batch onto text" else "text"
        (value,) = _query(backend, f"SELECT {column} FROM reducing_saver_summaries WHERE {where}", source)[0]
        if column == "batch":  # the batch's envelope, as a sealed text would carry it
            import base64

            value = (
                "reducing-saver/aesgcm:"
                + base64.b64encode(bytes(value)[len(b"reducing-saver/aesgcm:") :]).decode()
            )
        _query(
            backend,
            f"UPDATE reducing_saver_summaries SET text = ? WHERE {where}",
            (value, THREAD, second.step_id),
        )
    with pytest.raises(IntegrityError, match="integrity check failed") as caught:
        book.steps(THREAD, "", [second.step_id])
    assert f"thread {THREAD!r}" in str(caught.value) and second.step_id in str(caught.value)
    assert book.steps("acme:t-2", "", [second.step_id])[second.step_id].text  # the others still read


def test_a_moved_batch_makes_its_step_a_dead_letter(backend, ring):
    book = backend.summaries()
    book.sealer = _sealer(ring)
    other = _step("acme:t-2", None, ["x1"], 1)
    moved = _step(THREAD, None, ["m1"], 1)
    book.request(moved)  # the older one: claimed first
    book.request(other)
    (batch,) = _query(
        backend, "SELECT batch FROM reducing_saver_summaries WHERE thread_id = ?", ("acme:t-2",)
    )[0]
    _query(
        backend, "UPDATE reducing_saver_summaries SET batch = ? WHERE thread_id = ?", (bytes(batch), THREAD)
    )
    claimed = book.claim("w", 30)  # the moved step is parked, the other one claimed
    assert claimed.request.thread_id == "acme:t-2" and claimed.request.batch[0]["content"] == f"x1 {SENTINEL}"
    (dead,) = book.dead_letters()
    assert dead.thread_id == THREAD and "integrity check failed" in dead.last_error


def test_required_refuses_a_plain_row_and_migrate_reads_it(backend, ring):
    book = backend.summaries()  # no sealer: rows as a service without encryption wrote them
    _, second = _summarize(book)
    book.sealer = _sealer(ring, "required")
    with pytest.raises(PlainTextRefused, match="--encryption required refuses") as caught:
        book.steps(THREAD, "", [second.step_id])
    assert f"thread {THREAD!r}" in str(caught.value)
    book.sealer = _sealer(ring, "migrate")
    assert book.steps(THREAD, "", [second.step_id])[second.step_id].text.endswith(f"m2 {SENTINEL}")


def test_copy_thread_seals_again_for_the_target(backend, ring):
    book = backend.summaries()
    book.sealer = _sealer(ring)
    first, second = _summarize(book)
    book.copy_thread(THREAD, "acme:copy")
    copied = book.steps("acme:copy", "", [first.step_id, second.step_id])
    assert copied[second.step_id].text == f"m1 {SENTINEL}\nm2 {SENTINEL}"
    rows = _query(backend, "SELECT thread_id, step_id, text FROM reducing_saver_summaries ORDER BY thread_id")
    texts = {(thread, step): text for thread, step, text in rows}
    assert texts[("acme:copy", second.step_id)] != texts[(THREAD, second.step_id)]
    # The copy's pending step opens under its own thread too.
    third = _step(THREAD, second.step_id, ["m3"], 3)
    book.request(third)
    book.copy_thread(THREAD, "acme:copy-2")
    claimed = [book.claim("w", 30), book.claim("w", 30)]
    assert {c.request.thread_id for c in claimed} == {THREAD, "acme:copy-2"}
    assert all(c.previous == f"m1 {SENTINEL}\nm2 {SENTINEL}" for c in claimed)


def test_the_book_tells_sealed_values_by_the_envelope_s_prefix():
    """The storage layer cannot import encryption: its prefixes are spelled there and must stay the
    envelope's, or a plain book would hand sealed summaries on as text."""
    from reducing_saver.service.encryption.saver import METADATA_PREFIX
    from reducing_saver.service.storage import summaries

    assert summaries.SEALED_PREFIX == METADATA_PREFIX
    assert summaries.SEALED_BATCH_PREFIX == METADATA_PREFIX.encode()
