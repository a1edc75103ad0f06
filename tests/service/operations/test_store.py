"""The store's tenant mapping and checks, and RemoteStore's surface, without a service."""

from __future__ import annotations

import inspect

import pytest
from langgraph.store.base import BaseStore, GetOp, ListNamespacesOp, MatchCondition, PutOp, SearchOp

from reducing_saver.client import RemoteStore
from reducing_saver.service.errors import BadRequest
from reducing_saver.service.operations.store import StoreScope, check_op, with_ttl_defaults
from reducing_saver.service.security import TenantScope

ACME = StoreScope(TenantScope("acme"))


def test_ops_are_mapped_into_the_tenants_subtree() -> None:
    assert ACME.op_in(GetOp(("a", "b"), "k")) == GetOp(("tenants", "acme", "a", "b"), "k")
    assert ACME.op_in(PutOp(("a",), "k", {"v": 1})).namespace == ("tenants", "acme", "a")
    assert ACME.op_in(SearchOp((), None, 10, 0)).namespace_prefix == ("tenants", "acme")
    listed = ACME.op_in(ListNamespacesOp((MatchCondition("suffix", ("x", "y")),), 2, 10, 0))
    assert listed.match_conditions == (
        MatchCondition("prefix", ("tenants", "acme", "*", "*")),  # the suffix lies within acme's labels
        MatchCondition("suffix", ("x", "y")),
    )
    assert listed.max_depth == 4, "max_depth counts the tenant's own labels"
    prefixed = ACME.op_in(ListNamespacesOp((MatchCondition("prefix", ("a",)),), None, 10, 0))
    assert MatchCondition("prefix", ("tenants", "acme", "a")) in prefixed.match_conditions
    assert ACME.namespace_out(("tenants", "acme", "a")) == ("a",)


def test_single_tenant_mode_maps_nothing() -> None:
    op = ListNamespacesOp((), None, 10, 0)
    assert StoreScope(TenantScope(None)).op_in(op) is op


@pytest.mark.parametrize(
    ("op", "field"),
    [
        (PutOp(("a.b",), "k", {}), "x.namespace[0]"),
        (PutOp((), "k", {}), "x.namespace"),
        (PutOp(("a",), "k\x00", {}), "x.key"),
        (PutOp(("a",), "k", {"v": "\x00"}), "x.value"),
        (SearchOp(("a",), {"k": {"$regex": "."}}, 10, 0), "x.filter.k"),
        (SearchOp(("a",), None, 10, -1), "x.offset"),
        (
            ListNamespacesOp((MatchCondition("prefix", ("a",) * 17),), None, 10, 0),
            "x.match_conditions[0].path",
        ),
        (ListNamespacesOp((), 0, 10, 0), "x.max_depth"),
    ],
)
def test_refused_ops_name_the_field(op, field) -> None:
    with pytest.raises(BadRequest, match=f"^{field.replace('[', '.').replace(']', '.')}"):
        check_op(op, "x")


def test_ttl_defaults_fill_only_what_the_client_left_open() -> None:
    config = {"default_ttl": 5, "refresh_on_read": False}
    put, own, delete = PutOp(("a",), "k", {}), PutOp(("a",), "k", {}, ttl=9), PutOp(("a",), "k", None)
    get = GetOp(("a",), "k", None)  # type: ignore[arg-type]
    search = SearchOp(("a",), None, 10, 0, None, None)  # type: ignore[arg-type]
    out = with_ttl_defaults([put, own, delete, get, search], config)
    assert [o.ttl for o in out[:3]] == [5, 9, None]
    assert out[3].refresh_ttl is False and out[4].refresh_ttl is False
    open_get = GetOp(("a",), "k", None)  # type: ignore[arg-type]
    assert with_ttl_defaults([open_get], None)[0].refresh_ttl is True


def test_remote_store_is_a_base_store_with_async_twins() -> None:
    assert issubclass(RemoteStore, BaseStore)
    public = {name: member for name, member in inspect.getmembers(RemoteStore) if not name.startswith("_")}
    for name in ("batch", "get", "put", "delete", "search", "list_namespaces"):
        twin = public[f"a{name}"]
        assert inspect.iscoroutinefunction(twin), name
        assert list(inspect.signature(public[name]).parameters) == list(inspect.signature(twin).parameters), (
            name
        )
    with pytest.raises(ValueError, match="http"):
        RemoteStore("postgresql://localhost/db")
