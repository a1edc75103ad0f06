"""Outbox rows under encryption, on real PostgreSQL: the message column holds only ciphertext, the
deliverer's claim opens it, and a changed or moved message fails its integrity check."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage
from psycopg.types.json import Json

from reducing_saver.service.encryption import Cipher, Sealer, load_keyring
from reducing_saver.service.encryption.records import EncryptingOutbox
from reducing_saver.service.storage.outbox import make_entries
from tests.support.encryption import new_key, ring_json
from tests.support.storage import OwnPoolOutbox

NS = ("tenants", "acme", "memories", "t-1")


@pytest.fixture
def outbox(fresh_pg):
    inner = OwnPoolOutbox(fresh_pg)
    sealer = Sealer(Cipher(load_keyring(ring_json("k1", k1=new_key()))), "required", tenant_mode=True)
    yield EncryptingOutbox(inner, sealer), inner
    inner.close()


def _record(outbox, sentinel: str) -> None:
    messages = [HumanMessage(f"{sentinel} {i}", id=f"m-{i}") for i in range(3)]
    outbox.record(make_entries(messages, NS, thread_id="t-1", checkpoint_id="cp-1"))


def test_messages_are_sealed_and_claims_open_them(outbox, fresh_pg):
    sealed, inner = outbox
    _record(sealed, "SENTINEL-outbox")
    with inner._pool.connection() as conn:
        texts = [
            row["message"]
            for row in conn.execute("SELECT message::text AS message FROM reducing_saver_outbox")
        ]
    assert len(texts) == 3 and not any("SENTINEL" in text for text in texts)
    claimed = sealed.claim("w1", 10, 30)
    assert sorted(entry.message["content"] for entry in claimed) == [f"SENTINEL-outbox {i}" for i in range(3)]


@pytest.mark.parametrize("tamper", ["flip", "moved"])
def test_a_changed_or_moved_message_fails_the_claim(outbox, tamper):
    sealed, inner = outbox
    _record(sealed, "x")
    with inner._pool.connection() as conn:
        rows = {
            r["key"]: r["message"] for r in conn.execute("SELECT key, message FROM reducing_saver_outbox")
        }
        first, second, third = sorted(rows)
        if tamper == "flip":
            text = rows[first]["reducing-saver/aesgcm"]
            changed = text[:20] + ("A" if text[20] != "A" else "B") + text[21:]
            value = {"reducing-saver/aesgcm": changed}
        else:  # the second row's ciphertext under the first row's key
            value = rows[second]
        conn.execute("UPDATE reducing_saver_outbox SET message = %s WHERE key = %s", (Json(value), first))
    claimed = sealed.claim("w1", 10, 30)  # the others are delivered; that row is a dead letter
    assert sorted(entry.key for entry in claimed) == [second, third]
    (dead,) = inner.dead_letters()
    assert dead.key == first and "integrity check failed" in dead.last_error


def test_fingerprints_are_keyed_per_tenant_and_stable():
    """What a message says is kept as a keyed digest under encryption: equal for the same message (so an
    unchanged message is recorded once), different for an edit, for another tenant, for another key
    ring, and never the plain digest (which could be matched against guessed texts)."""
    from reducing_saver.service.encryption.records import seal_entries

    def sealed_fingerprint(text: str, namespace=NS, ring=None) -> str:
        cipher = Cipher(load_keyring(ring or RING))
        sealer = Sealer(cipher, "required", tenant_mode=True)
        (entry,) = make_entries([HumanMessage(text, id="m")], namespace, thread_id="t-1")
        (sealed,) = seal_entries(sealer, [entry])
        assert sealed.fingerprint != entry.fingerprint and len(sealed.fingerprint) == 32
        return sealed.fingerprint

    first = sealed_fingerprint("my name is Alice")
    assert sealed_fingerprint("my name is Alice") == first
    assert sealed_fingerprint("CORRECTION: my name is Bob") != first
    assert sealed_fingerprint("my name is Alice", ("tenants", "globex", "memories", "t-1")) != first
    assert sealed_fingerprint("my name is Alice", ring=ring_json("k1", k1=new_key())) != first


RING = ring_json("k1", k1=new_key())
