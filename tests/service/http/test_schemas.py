"""The wire's bodies as the service validates and documents them (service/http/schemas.py)."""

from __future__ import annotations

import inspect
import typing

from fastapi.testclient import TestClient
from langgraph.store.base import BaseStore, ListNamespacesOp, SearchOp
from pydantic import TypeAdapter

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http import schemas
from reducing_saver.service.http.app import create_app
from reducing_saver.service.operations import store as store_ops
from reducing_saver.wire import bodies


def test_every_field_rule_names_a_field_of_its_body() -> None:
    """A rule for a field the wire no longer has would be dropped without a word."""
    missing = [
        f"{body.__name__}.{field}"
        for body, field in schemas.FIELD_RULES
        if field not in typing.get_type_hints(body)
    ]
    assert missing == []
    assert {body for body, _ in schemas.FIELD_RULES} <= set(bodies.BODIES)


def test_the_document_shows_the_wire_fields_their_docstrings_and_which_may_be_left_out() -> None:
    with TestClient(create_app(Settings(database="memory://", sweep=False, extract=False))) as http:
        components = http.get("/openapi.json").json()["components"]["schemas"]
    writes = components["PutWritesBody"]
    assert set(writes["properties"]) == set(typing.get_type_hints(bodies.PutWritesBody))
    assert writes["properties"]["writes"]["description"] == "(channel, value) pairs."
    assert writes["required"] == ["config", "writes", "task_id"]  # task_path: NotRequired, default ""
    assert writes["properties"]["task_path"]["default"] == ""
    assert writes["additionalProperties"] is False
    # NotRequired answers' fields are not required (the wire module postpones its annotations).
    assert components["DeltaChannelHistoryBody"]["required"] == ["writes"]
    assert components["ErrorBody"]["required"] == ["detail"]
    assert "additionalProperties" not in components["GetCheckpointAnswer"]  # answers may grow
    assert components["CheckpointFieldsBody"]["additionalProperties"] is True
    assert components["CapabilitiesAnswer"]["properties"]["stored_values"]["enum"] == [
        "all",
        "changed",
        "changed_and_inline",
    ]


def test_an_absent_field_takes_its_default_and_a_new_one_each_time() -> None:
    adapter = TypeAdapter(schemas.PutCheckpointBody)
    body = {
        "config": {"configurable": {"thread_id": "t"}},
        "checkpoint": {
            "v": 4,
            "id": "1f0a8a4e-0000-6000-8000-000000000000",
            "ts": "",
            "channel_versions": {},
            "versions_seen": {},
            "pending_sends": [],
        },
        "values": {},
        "new_versions": {},
    }
    first, second = adapter.validate_python(body), adapter.validate_python(body)
    assert first["metadata"] == {} and first["config"]["metadata"] == {}
    assert first["metadata"] is not second["metadata"]
    assert first["checkpoint"]["updated_channels"] is None
    assert first["checkpoint"]["pending_sends"] == []  # a checkpoint keeps the keys it brings


def test_store_paging_left_out_is_the_store_operations_default_everywhere() -> None:
    """A search or namespace listing without ``limit``/``offset`` gets the same paging through the routes'
    bodies, the batch route's ops and the document, and it is what ``BaseStore`` gives."""
    search, listing = store_ops.SEARCH_LIMIT, store_ops.LIST_NAMESPACES_LIMIT
    offset = store_ops.DEFAULT_OFFSET
    assert TypeAdapter(schemas.SearchItemsBody).validate_python({})["limit"] == search
    assert TypeAdapter(schemas.ListNamespacesBody).validate_python({})["limit"] == listing
    ops = TypeAdapter(schemas.StoreBatchBody).validate_python(
        {"ops": [{"op": "search"}, {"op": "list_namespaces"}]}
    )["ops"]
    assert [(op["limit"], op["offset"]) for op in ops] == [(search, offset), (listing, offset)]
    assert store_ops.op_from_json({"op": "search"}) == SearchOp((), None, search, offset, None, None)
    assert store_ops.op_from_json({"op": "list_namespaces"}) == ListNamespacesOp((), None, listing, offset)
    with TestClient(create_app(Settings(database="memory://", sweep=False, extract=False))) as http:
        components = http.get("/openapi.json").json()["components"]["schemas"]
    assert components["SearchItemsBody"]["properties"]["limit"]["default"] == search
    assert components["ListNamespacesBody"]["properties"]["limit"]["default"] == listing
    store = (
        inspect.signature(BaseStore.search).parameters,
        inspect.signature(BaseStore.list_namespaces).parameters,
    )
    assert (store[0]["limit"].default, store[0]["offset"].default) == (search, offset)
    assert (store[1]["limit"].default, store[1]["offset"].default) == (listing, offset)
