"""What the service says about itself (``GET /v1/capabilities``), as the client reads it.

A newer service may say more (the rest is ignored, capabilities this client does not know included); an
older one less (the client falls back on what that release did).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, cast, get_args

from reducing_saver.client._calls import Call
from reducing_saver.wire import CAPABILITIES_PATH, JSON, bodies
from reducing_saver.wire.bodies import StoredValues
from reducing_saver.wire.capabilities import OPTIONAL_CAPABILITIES

logger = logging.getLogger(__name__)

#: Which channel values a checkpoint of the service's backend keeps (``stored_values``): ``"all"``, every
#: value in every checkpoint (SqliteSaver); ``"changed"``, only the channels in ``new_versions``
#: (InMemorySaver); ``"changed_and_inline"``, those and every primitive value, which PostgresSaver keeps
#: inline in each checkpoint row. A put sends only what will be stored.
#: What a service that does not say (0.1.0) stores, by its backend's name.
STORED_VALUES_BY_BACKEND: dict[str, StoredValues] = {
    "sqlite": "all",
    "memory": "changed",
    "postgres": "changed_and_inline",
}


@dataclass(frozen=True)
class RemoteReducer:
    """The reducer the service applies, as ``GET /v1/capabilities`` describes it (read-only).

    A ``RemoteReducingSaver`` always carries one, so wrapping it in a local ``ReducingSaver`` (which
    would reduce, and deliver pruned messages, a second time) raises ``ValueError``.
    """

    max_messages: int | None
    min_messages: int | None
    max_tokens: int | None
    target_tokens: int | None
    preserve_first: bool
    cascade_tool_messages: bool
    start_on: str | None
    namespace_key: str


@dataclass(frozen=True)
class ServerInfo:
    capabilities: frozenset[str]
    backend: str
    messages_key: str
    reducer: RemoteReducer
    version: str
    #: Content types the per-step routes accept (a service older than msgpack bodies: JSON only).
    body_formats: frozenset[str]
    #: The most checkpoints one list answer holds; ``None`` from a service that does not say (one that
    #: answers a list without a limit in full).
    max_list_limit: int | None
    stored_values: StoredValues


def parse_server_info(body: Any) -> ServerInfo:
    advertised = body["capabilities"]
    unknown = sorted(set(advertised) - OPTIONAL_CAPABILITIES.keys())
    if unknown:  # a newer service; its extra capabilities stay unused
        logger.info("ignoring capabilities this client does not know: %s", unknown)
    return ServerInfo(
        capabilities=frozenset(name for name in advertised if name in OPTIONAL_CAPABILITIES),
        backend=body["backend"],
        messages_key=body["messages_key"],
        reducer=RemoteReducer(**_reducer_body(body["reducer"])),
        version=body["version"],
        body_formats=frozenset(body.get("body_formats") or (JSON,)),
        max_list_limit=list_page_size(body.get("limits")),
        stored_values=_stored_values(body),
    )


def _reducer_body(reducer: Any) -> bodies.ReducerBody:
    """The wire's reducer fields (a newer service's others left out); typed as the wire declares them, so
    mypy checks that ``RemoteReducer`` takes exactly those."""
    return cast(bodies.ReducerBody, {f.name: reducer[f.name] for f in fields(RemoteReducer)})


def _stored_values(body: Any) -> StoredValues:
    """The service's ``stored_values``; by its backend's name when it does not say; ``"all"`` (always
    enough) for a backend or a rule this client does not know."""
    said = body.get("stored_values")
    if said is None:
        return STORED_VALUES_BY_BACKEND.get(body["backend"], "all")
    if said in get_args(StoredValues):
        return cast(StoredValues, said)
    logger.info(
        "the service stores channel values by a rule this client does not know (%r): puts send all",
        said,
    )
    return "all"


def list_page_size(limits: Any) -> int | None:
    cap = limits.get("max_list_limit") if isinstance(limits, Mapping) else None
    return cap if type(cap) is int and cap > 0 else None


def capabilities_call() -> Call[ServerInfo]:
    return Call("GET", CAPABILITIES_PATH, None, True, parse_server_info)
