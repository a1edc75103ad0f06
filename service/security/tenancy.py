"""Tenants: every stored thread id and memory namespace of a tenant lives under its name.

With keys configured, the thread id stored is ``f"{tenant}:{thread_id}"`` (tenant names are
``[A-Za-z0-9_-]+``, so the first ``:`` always splits it back and no two tenants' ids can collide), and
every memory namespace is stored under ``("tenants", tenant, *namespace)``; the fallback
``("memories", thread_id)`` uses the agent's own thread id. :class:`TenantScope` maps ids in and out of
the operations; another tenant's thread looks exactly like a missing one. Without keys (single-tenant
mode) nothing is mapped: stored ids are the agent's own.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import closing
from contextvars import ContextVar
from itertools import islice
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple

from reducing_saver.reducer import namespace_for
from reducing_saver.service.errors import Unauthorized
from reducing_saver.service.storage.lifecycle import CHECKPOINT_ID_KEY, THREAD_PREFIX_KEY
from reducing_saver.wire.bodies import CheckpointTupleBody

#: The 401 detail: which headers carry a key.
UNAUTHORIZED = "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
#: Prefix of every memory namespace in tenant mode: ``("tenants", tenant, *namespace)``.
TENANTS_LABEL = "tenants"
_tenant: ContextVar[str | None] = ContextVar("reducing_saver_tenant", default=None)


def current_tenant() -> str | None:
    """The tenant of the current request's API key; ``None`` without keys or outside a request."""
    return _tenant.get()


# -- tenant scoping ----------------------------------------------------------------------------------


class TenantScope:
    """Maps an agent's thread ids and memory namespaces to stored ones and back, for one tenant.

    ``TenantScope(None)`` (single-tenant mode) maps nothing.
    """

    def __init__(self, tenant: str | None) -> None:
        self.tenant = tenant
        self.prefix = f"{tenant}:" if tenant is not None else ""

    @classmethod
    def for_request(cls, tenant_mode: bool) -> TenantScope:
        tenant = current_tenant()
        if tenant_mode and tenant is None:
            # Never fall back to unscoped access: a request that got here without a tenant is a bug.
            raise Unauthorized(UNAUTHORIZED)
        return cls(tenant)

    # thread ids
    def thread(self, thread_id: str) -> str:
        return self.prefix + thread_id

    def threads(self, thread_ids: Sequence[str]) -> list[str]:
        return [self.prefix + t for t in thread_ids]

    def unthread(self, stored: str) -> str:
        return stored.removeprefix(self.prefix)

    def owns(self, stored: str) -> bool:
        return stored.startswith(self.prefix)

    def text(self, message: str) -> str:
        """An error message with stored ids turned back into the agent's."""
        return message.replace(self.prefix, "") if self.prefix else message

    # configs
    def config_in(
        self, config: RunnableConfig, namespace_key: str, *, namespace: bool = False
    ) -> RunnableConfig:
        """``config`` with its thread id stored; with ``namespace``, the memory namespace made explicit
        under ``("tenants", tenant)`` (the fallback from the agent's own thread id)."""
        if self.tenant is None:
            return config
        configurable = dict(config["configurable"])
        if namespace:
            configurable[namespace_key] = list(self.namespace(namespace_for(config, namespace_key)))
        else:
            configurable.pop(namespace_key, None)
        if configurable.get("thread_id") is not None:
            configurable["thread_id"] = self.thread(str(configurable["thread_id"]))
        return {**config, "configurable": configurable}

    def config_out(self, config: Any) -> Any:
        if self.tenant is None or not isinstance(config, dict):
            return config
        configurable = config.get("configurable")
        if not isinstance(configurable, dict) or not isinstance(configurable.get("thread_id"), str):
            return config
        return {
            **config,
            "configurable": {**configurable, "thread_id": self.unthread(configurable["thread_id"])},
        }

    def tuple_out(self, item: CheckpointTupleBody) -> CheckpointTupleBody:
        if self.tenant is None:
            return item
        return {
            **item,
            "config": self.config_out(item["config"]),
            "parent_config": self.config_out(item["parent_config"]),
        }

    # memory namespaces
    @property
    def namespace_prefix(self) -> tuple[str, ...] | None:
        return (TENANTS_LABEL, self.tenant) if self.tenant is not None else None

    def namespace(self, namespace: Sequence[str]) -> tuple[str, ...]:
        prefix = self.namespace_prefix
        return (*prefix, *namespace) if prefix is not None else tuple(namespace)

    def unnamespace(self, namespace: Sequence[str]) -> list[str]:
        labels = list(namespace)
        return (
            labels[2:] if self.tenant is not None and tuple(labels[:2]) == self.namespace_prefix else labels
        )


def stored_thread_to_agent(stored: str, tenant_mode: bool) -> str:
    """The agent's thread id of a stored one (tenant mode strips ``tenant:``)."""
    return stored.split(":", 1)[1] if tenant_mode and ":" in stored else stored


def list_checkpoints(
    saver: Any,
    scope: TenantScope,
    config: RunnableConfig | None,
    *,
    filter: dict[str, Any] | None,
    before: RunnableConfig | None,
    limit: int | None,
) -> Generator[CheckpointTuple, None, None]:
    """``saver.list`` seen by one tenant, in pages that never skip a checkpoint.

    With a thread in ``config`` the thread id is already the stored one, and ``before`` means what it
    means to the saver (ids older than its ``checkpoint_id``). Across threads (``config`` is ``None``) a
    tenant sees only its own (:func:`_across`), and the order is total: newest id first, then thread id
    and namespace, descending, since the copies ``copy_thread`` makes share their ids. A ``before``
    naming a thread (the last checkpoint of the previous page, as clients page) is a cursor in that
    order: the next page starts right after it, with the checkpoints sharing its id that it had not
    reached yet. A ``before`` naming only a checkpoint id keeps the saver's meaning.
    """
    # Every saver generator is closed explicitly when this one is: PostgresSaver.list holds the saver's
    # lock until its generator ends, and a consumer that fails mid-list must not leave it held.
    if config is not None:
        with closing(saver.list(config, filter=filter, before=before, limit=limit)) as items:
            yield from items
        return
    page: list[Any] = []
    configurable = (before or {}).get("configurable") or {}
    checkpoint_id, thread_id = configurable.get("checkpoint_id"), configurable.get("thread_id")
    if checkpoint_id and thread_id:
        cursor = (scope.thread(str(thread_id)), configurable.get("checkpoint_ns") or "")
        page = [item for item in _same_id(saver, scope, filter, checkpoint_id) if _tie_key(item) < cursor]
        before = {"configurable": {"checkpoint_id": checkpoint_id}}
    room = None if limit is None else limit - len(page)
    if room is not None and room <= 0:
        yield from page[:limit]
        return
    with closing(_across(saver, scope, filter=filter, before=before, limit=room)) as items:
        rest = sorted(items, key=_order_key, reverse=True)
    if room is not None and len(rest) == room and rest:
        # A full page: the checkpoints sharing its last id may go on past the limit, in any order. Take
        # the first of them in the total order, so the next page's cursor skips none.
        last = rest[-1].config["configurable"]["checkpoint_id"]
        head = [item for item in rest if item.config["configurable"]["checkpoint_id"] != last]
        rest = head + _same_id(saver, scope, filter, last)[: room - len(head)]
    yield from page + rest


def _order_key(item: Any) -> tuple[str, str, str]:
    configurable = item.config["configurable"]
    return configurable["checkpoint_id"], configurable["thread_id"], configurable.get("checkpoint_ns") or ""


def _tie_key(item: Any) -> tuple[str, str]:
    configurable = item.config["configurable"]
    return configurable["thread_id"], configurable.get("checkpoint_ns") or ""


def _same_id(saver: Any, scope: TenantScope, filter: dict[str, Any] | None, checkpoint_id: str) -> list[Any]:
    """The tenant's checkpoints with id ``checkpoint_id``, in every thread, by thread and namespace
    descending (the savers' ``list`` with ``CHECKPOINT_ID_KEY``)."""
    configurable: dict[str, Any] = {CHECKPOINT_ID_KEY: checkpoint_id}
    if scope.tenant is not None and getattr(saver.inner, "lists_by_thread_prefix", False):
        configurable[THREAD_PREFIX_KEY] = scope.prefix
    with closing(saver.list({"configurable": configurable}, filter=filter)) as items:
        found = [item for item in items if scope.owns(item.config["configurable"]["thread_id"])]
    return sorted(found, key=_tie_key, reverse=True)


def _across(
    saver: Any,
    scope: TenantScope,
    *,
    filter: dict[str, Any] | None,
    before: RunnableConfig | None,
    limit: int | None,
) -> Generator[Any, None, None]:
    """The tenant's checkpoints across threads, newest id first: a saver that ``lists_by_thread_prefix``
    (PostgreSQL's) filters in the query (``thread_id LIKE 'tenant:%'``, before ``ORDER BY`` and
    ``LIMIT``); the others' ordered results are filtered here, stopping after ``limit``."""
    if scope.tenant is None:
        with closing(saver.list(None, filter=filter, before=before, limit=limit)) as items:
            yield from items
        return
    if getattr(saver.inner, "lists_by_thread_prefix", False):
        prefixed = {"configurable": {THREAD_PREFIX_KEY: scope.prefix}}
        with closing(saver.list(prefixed, filter=filter, before=before, limit=limit)) as items:
            for item in items:
                if scope.owns(item.config["configurable"]["thread_id"]):
                    yield item
        return
    with closing(saver.list(None, filter=filter, before=before, limit=None)) as items:
        own = (item for item in items if scope.owns(item.config["configurable"]["thread_id"]))
        yield from (own if limit is None else islice(own, limit))
