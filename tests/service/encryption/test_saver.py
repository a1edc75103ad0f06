"""EncryptingSaver over the three backends' savers: what is stored is sealed, and prune still sees a
DeltaChannel snapshot it can no longer read in the database."""

from __future__ import annotations

import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.service.encryption import Cipher, Sealer, encrypting, load_keyring
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
