"""The key ring and the envelope: validation that never prints a key, nonces, binding, tampering."""

from __future__ import annotations

import base64
import json
import os

import pytest

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.encryption import (
    Cipher,
    IntegrityError,
    KeyRingError,
    UnknownKeyError,
    load_keyring,
)
from reducing_saver.service.encryption.envelope import NONCE_BYTES, key_id_of
from tests.support.encryption import new_key, ring_json


def test_a_ring_from_json_and_from_a_file(tmp_path):
    key = new_key()
    text = ring_json("k1", k1=key, k0=new_key())
    path = tmp_path / "keys.json"
    path.write_text(text)
    for source in (text, str(path)):
        ring = load_keyring(source)
        assert ring.primary == "k1" and ring.key_ids == ["k0", "k1"]
        assert ring.key("k1") == base64.b64decode(key)
        assert key not in repr(ring) and key not in str(ring)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"primary": "k2", "keys": {"k1": "KEY"}}, "primary key id 'k2' is not among the keys"),
        ({"primary": "k1", "keys": {"k1": "KEY@@@@"}}, "key 'k1' is not valid base64"),
        ({"primary": "k1", "keys": {"k1": "SHORT"}}, "key 'k1' is 16 bytes; AES-256 needs 32"),
        ({"primary": "k1", "keys": {}}, '"keys" must be a non-empty object'),
        ({"primary": "k 1", "keys": {"k 1": "KEY"}}, "key id 'k 1' must be"),
        ({"keys": {"k1": "KEY"}}, "expected a JSON object"),
    ],
)
def test_malformed_rings_are_refused_without_printing_a_key(document, message):
    key, short = new_key(), base64.b64encode(b"0123456789abcdef").decode()
    text = json.dumps(document).replace("KEY", key).replace("SHORT", short)
    with pytest.raises(KeyRingError) as caught:
        load_keyring(text)
    assert message in str(caught.value)
    assert key[:8] not in str(caught.value) and short[:8] not in str(caught.value)


def test_not_json_names_the_position_only():
    key = new_key()
    with pytest.raises(KeyRingError, match=r"not valid JSON \(line 1") as caught:
        load_keyring('{"primary": "k1", "keys": {"k1": "' + key + '"')
    assert key not in str(caught.value)


def test_a_missing_key_file_is_named_without_its_content(tmp_path):
    with pytest.raises(KeyRingError, match="cannot read the key file: No such file"):
        load_keyring(str(tmp_path / "absent.json"))


def test_settings_never_show_the_key():
    key = new_key()
    settings = Settings(encryption="required", encryption_keys=ring_json("k1", k1=key))
    assert key not in repr(settings) and key not in str(settings.model_dump())
    assert settings.keyring.primary == "k1"
    with pytest.raises(ValueError, match="encryption required needs a key ring"):
        Settings(encryption="required")
    with pytest.raises(ValueError, match="cannot be combined with store_index"):
        Settings(
            encryption="migrate",
            encryption_keys=ring_json("k1", k1=key),
            store_index={"dims": 4, "embed": "tests.support.embeddings:embed"},
        )


def test_values_round_trip_bound_to_their_context():
    cipher = Cipher(load_keyring(ring_json("k1", k1=new_key())))
    envelope = cipher.seal(b"hello", "acme", ["blob", "t1", "", "messages", "1"])
    assert key_id_of(envelope) == "k1"
    assert cipher.open(envelope, "acme", ["blob", "t1", "", "messages", "1"], "here") == b"hello"
    for tenant, context in [
        ("globex", ["blob", "t1", "", "messages", "1"]),  # another tenant: another derived key
        ("acme", ["blob", "t2", "", "messages", "1"]),
        ("acme", ["blob", "t1", "sub", "messages", "1"]),
        ("acme", ["blob", "t1", "", "notes", "1"]),
        ("acme", ["blob", "t1", "", "messages", "2"]),
    ]:
        with pytest.raises(IntegrityError, match="here: integrity check failed"):
            cipher.open(envelope, tenant, context, "here")


def test_every_byte_flipped_fails():
    cipher = Cipher(load_keyring(ring_json("k1", k1=new_key())))
    context = ["write", "t1", "", "c1", "task", 0, "ch"]
    envelope = cipher.seal(b"some value", "", context)
    for index in range(len(envelope)):
        changed = bytearray(envelope)
        changed[index] ^= 0x40
        with pytest.raises((IntegrityError, UnknownKeyError)):
            cipher.open(bytes(changed), "", context, "w")
    with pytest.raises(IntegrityError):
        cipher.open(envelope[:-1], "", context, "w")


def test_another_ring_names_the_missing_key_id():
    sealed = Cipher(load_keyring(ring_json("old", old=new_key()))).seal(b"x", "", ["c"])
    other = Cipher(load_keyring(ring_json("new", new=new_key())))
    with pytest.raises(UnknownKeyError, match="key id 'old', which the key ring does not hold"):
        other.open(sealed, "", ["c"], "v")


def test_100000_encryptions_repeat_no_nonce():
    cipher = Cipher(load_keyring(ring_json("k1", k1=new_key())))
    start = 2 + len("k1")
    nonces = {cipher.seal(b"v", "", ["c"])[start : start + NONCE_BYTES] for _ in range(100_000)}
    assert len(nonces) == 100_000


def test_a_forked_child_never_reuses_its_parents_nonces():
    """Nonces are read from the system many at a time: a child must not use those its parent read."""
    cipher = Cipher(load_keyring(ring_json("k1", k1=new_key())))
    start = 2 + len("k1")

    def nonces(count: int) -> list[bytes]:
        return [cipher.seal(b"v", "", ["c"])[start : start + NONCE_BYTES] for _ in range(count)]

    nonces(3)  # the parent has read a batch of nonces, most of them not used yet
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.write(write, b"".join(nonces(50)))
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    theirs = {data[index : index + NONCE_BYTES] for index in range(0, len(data), NONCE_BYTES)}
    assert len(theirs) == 50 and not theirs & set(nonces(50))
