"""EncryptingSaver over the three backends' savers: what is stored is sealed, and prune still sees a
DeltaChannel snapshot it can no longer read in the database."""

from __future__ import annotations

import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.service.encryption import Cipher, Sealer, encrypting, load_keyring
from reducing_saver.service.encryption.saver import is_sealed
from reducing_saver.service.storage import open_backend
from reducing_saver.wire import Blob
from tests.support.encryption import new_key, ring_json


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def saver(request, tmp_path):
    url = {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/s.sqlite"}.get(request.param)
    url = url or request.getfixturevalue("fresh_pg")
    backend = open_backend(url)
    backend.setup()
    sealer = Sealer(Cipher(load_keyring(ring_json("k1", k1=new_key()))), "required", tenant_mode=False)
    yield encrypting(backend.savers(1)[0], sealer)
    backend.close()


def _put(saver, thread_id: str, value) -> None:
    checkpoint = empty_checkpoint()
    version = saver.get_next_version(None, None)
    checkpoint["channel_values"] = {"items": value}
    checkpoint["channel_versions"] = {"items": version}
    config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}
    saver.put(config, checkpoint, {"source": "loop", "step": 1, "parents": {}}, {"items": version})


def test_keep_latest_refuses_a_thread_with_a_sealed_delta_snapshot(saver):
    snapshot = Blob(*JsonPlusSerializer().dumps_typed(_DeltaSnapshot(["a", "b"])))
    _put(saver, "plain", Blob(*JsonPlusSerializer().dumps_typed(["a"])))
    _put(saver, "plain", "a string")
    _put(saver, "delta", snapshot)
    _put(saver, "delta", Blob(*JsonPlusSerializer().dumps_typed(["c"])))
    with pytest.raises(NotImplementedError, match="DeltaChannel: delta$"):
        saver.prune(["plain", "delta"])
    assert len(list(saver.list({"configurable": {"thread_id": "plain"}}))) == 2  # nothing pruned
    saver.prune(["plain"])
    assert len(list(saver.list({"configurable": {"thread_id": "plain"}}))) == 1
    assert saver.get_tuple({"configurable": {"thread_id": "plain"}}).checkpoint["channel_values"] == {
        "items": "a string"
    }


def test_list_filters_on_sealed_metadata_after_opening(saver):
    for index in range(6):
        checkpoint = empty_checkpoint()
        config = {"configurable": {"thread_id": "t", "checkpoint_ns": "", "user": f"u{index % 2}"}}
        saver.put(config, checkpoint, {"source": "loop", "step": index, "parents": {}, "score": index}, {})
    found = list(saver.list({"configurable": {"thread_id": "t"}}, filter={"user": "u1"}, limit=2))
    assert [item.metadata["step"] for item in found] == [5, 3]
    assert [i.metadata["score"] for i in saver.list(None, filter={"user": "u0", "step": 2})] == [2]
    assert list(saver.list(None, filter={"user": "nobody"})) == []
    stored = saver.inner.get_tuple({"configurable": {"thread_id": "t"}}).metadata  # in the database
    assert stored["step"] == 5 and stored["user"].startswith("reducing-saver/aesgcm:")


# -- --keep-checkpoints on a DeltaChannel thread ---------------------------------------------------

_CLIENT = JsonPlusSerializer()


def _items(value) -> Blob:
    return Blob(*_CLIENT.dumps_typed(value))


def _history(saver, thread_id: str, puts: list[tuple[dict, dict]], ids: list[str]) -> None:
    """One put per ``(channel_values, metadata)``, each the child of the one before."""
    parent = None
    for checkpoint_id, (values, metadata) in zip(ids, puts, strict=True):
        checkpoint = empty_checkpoint()
        checkpoint["id"] = checkpoint_id
        checkpoint["channel_values"] = dict(values)
        version = saver.get_next_version(None, None) if values else None
        checkpoint["channel_versions"] = {channel: version for channel in values}
        config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": parent}}
        saver.put(config, checkpoint, metadata, dict(checkpoint["channel_versions"]))
        parent = checkpoint_id


def _read(saver, thread_id: str) -> list[tuple]:
    return [
        (item.checkpoint["id"], item.checkpoint["channel_values"], item.metadata)
        for item in saver.list({"configurable": {"thread_id": thread_id}})
    ]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend_saver(request, tmp_path):
    """A backend's saver as the service builds it with ``--keep-checkpoints 2``."""
    url = {"memory": "memory://", "sqlite": f"sqlite:///{tmp_path}/s.sqlite"}.get(request.param)
    backend = open_backend(url or request.getfixturevalue("fresh_pg"))
    backend.setup()
    inner = backend.savers(1)[0]
    inner.keep_checkpoints = 2
    yield inner
    backend.close()


@pytest.mark.parametrize("mode", ["migrate", "required"])
def test_keep_checkpoints_keeps_a_delta_channel_threads_rebuild_chain_under_encryption(backend_saver, mode):
    """A DeltaChannel ``items`` as LangGraph puts it: absent from the checkpoint, counters in the metadata,
    except on a checkpoint that snapshots it, whose only marker is the snapshot value (no counters). The
    newest 2 are kept with their ancestors back to the snapshot, and nothing older: under encryption (the
    backend sees the values sealed, the counters plain) as without."""
    sealer = Sealer(Cipher(load_keyring(ring_json("k1", k1=new_key()))), mode, tenant_mode=False)
    sealed = encrypting(backend_saver, sealer)

    def counted(step: int) -> tuple[dict, dict]:
        counters = {"items": [step, step]}
        return {}, {"source": "loop", "step": step, "parents": {}, "counters_since_delta_snapshot": counters}

    snapshot = {"items": _items(_DeltaSnapshot(["a", "b"]))}, {"source": "loop", "step": 4, "parents": {}}
    delta = [counted(1), counted(2), counted(3), snapshot, counted(1), counted(2)]
    plain = [({"items": _items(["a"] * n)}, {"source": "loop", "step": n, "parents": {}}) for n in range(6)]
    ids = [str(uuid6(clock_seq=index)) for index in range(len(delta))]

    _history(backend_saver, "delta-off", delta, ids)
    _history(sealed, "delta-sealed", delta, ids)
    assert [checkpoint_id for checkpoint_id, _, _ in _read(backend_saver, "delta-off")] == ids[:2:-1]
    assert _read(sealed, "delta-sealed") == _read(backend_saver, "delta-off")

    # The same puts without a DeltaChannel are pruned to 2 either way: the policy is on.
    _history(backend_saver, "plain-off", plain, ids)
    _history(sealed, "plain-sealed", plain, ids)
    kept = [checkpoint_id for checkpoint_id, _, _ in _read(sealed, "plain-sealed")]
    assert kept == [checkpoint_id for checkpoint_id, _, _ in _read(backend_saver, "plain-off")] == ids[:-3:-1]

    # What the backend stored: every value sealed, and no marker of the decision in the metadata.
    for item in backend_saver.list({"configurable": {"thread_id": "delta-sealed"}}):
        assert all(is_sealed(value) for value in item.checkpoint["channel_values"].values())
        assert not [key for key in item.metadata if key.startswith("__")]


def test_a_plain_inline_value_survives_the_first_sealed_checkpoint_under_migrate(backend_saver):
    """A stock PostgresSaver keeps a primitive channel value inline in its checkpoint row, with no blob
    row. The first checkpoint put under ``migrate`` that does not write that channel still holds its
    value: the sealed copy gets a blob row at the channel's version (a sealed value is never inline)."""
    sealer = Sealer(Cipher(load_keyring(ring_json("k1", k1=new_key()))), "migrate", tenant_mode=False)
    sealed = encrypting(backend_saver, sealer)
    old = backend_saver.get_next_version(None, None)
    new = backend_saver.get_next_version(old, None)
    values = {"count": 3, "title": "plain era", "items": _items(["a"])}

    def put(saver, checkpoint_id: str, values: dict, versions: dict, new_versions: dict) -> None:
        checkpoint = empty_checkpoint()
        checkpoint["id"], checkpoint["channel_values"], checkpoint["channel_versions"] = (
            checkpoint_id,
            values,
            versions,
        )
        config = {"configurable": {"thread_id": "t", "checkpoint_ns": "", "checkpoint_id": None}}
        saver.put(
            config, checkpoint, {"source": "loop", "step": int(checkpoint_id), "parents": {}}, new_versions
        )

    versions = dict.fromkeys(values, old)
    put(backend_saver, "1", values, versions, versions)  # the plain era
    put(sealed, "2", {**values, "reply": "new"}, {**versions, "reply": new}, {"reply": new})

    latest = sealed.get_tuple({"configurable": {"thread_id": "t"}})
    assert latest.checkpoint["id"] == "2"
    assert latest.checkpoint["channel_values"] == {**values, "reply": "new"}


@pytest.mark.parametrize("mode", ["migrate", "required"])
def test_a_put_seals_only_the_values_the_backend_stores(backend_saver, mode, monkeypatch, request):
    """PostgreSQL and memory store the values of ``new_versions`` only (and find the others by version):
    the others are not sealed. SQLite stores the whole checkpoint: everything is. Under ``migrate`` on
    PostgreSQL, the primitives carried are written too (see the plain-inline test above)."""
    sealer = Sealer(Cipher(load_keyring(ring_json("k1", k1=new_key()))), mode, tenant_mode=False)
    sealed = encrypting(backend_saver, sealer)
    handed = []
    put = backend_saver.put
    monkeypatch.setattr(backend_saver, "put", lambda *args: handed.append(args) or put(*args))
    old = backend_saver.get_next_version(None, None)
    new = backend_saver.get_next_version(old, None)
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"items": _items(["a"]), "count": 3, "reply": "new"}
    checkpoint["channel_versions"] = {"items": old, "count": old, "reply": new}
    config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    sealed.put(config, checkpoint, {"source": "loop", "step": 1, "parents": {}}, {"reply": new})

    ((_, stored, _, new_versions),) = handed
    assert all(is_sealed(value) for value in stored["channel_values"].values())
    backend = request.node.callspec.params["backend_saver"]
    expected = {
        "sqlite": {"items", "count", "reply"},
        "memory": {"reply"},
        "postgres": {"reply", "count"} if mode == "migrate" else {"reply"},
    }[backend]
    assert set(stored["channel_values"]) == expected
    assert set(new_versions) == (expected if backend != "sqlite" else {"reply"})


def test_blobs_sealed_by_earlier_releases_and_long_type_names_still_open():
    """Blob plaintexts are framed by hand now (``B``); those sealed as a msgpack pair (``b``: every blob
    of earlier releases, and type names of 256 bytes or more) open as before."""
    import ormsgpack

    sealer = Sealer(Cipher(load_keyring(ring_json("k1", k1=new_key()))), "required", tenant_mode=False)
    place = ("t", "", "messages", "3")
    for value in (Blob("msgpack", b"\x93\x01\x02\x03"), Blob("x" * 300, b"data"), Blob("json", b""), "plain"):
        assert sealer.open_value(sealer.seal_value(value, *place), *place) == value
    earlier = b"b" + ormsgpack.packb(["msgpack", b"\x93\x01\x02\x03"])
    envelope = sealer.cipher.seal(earlier, "", ["blob", *place])
    assert sealer.open_value(Blob("reducing-saver/aesgcm", envelope), *place) == Blob(
        "msgpack", b"\x93\x01\x02\x03"
    )
