"""The store's semantic search and TTL settings, as ``langgraph.json`` configures Agent Server's store.

``--store-index '{"dims": 1536, "embed": "openai:text-embedding-3-small", "fields": ["$"]}'``: ``embed``
is ``provider:model`` (``langchain.embeddings.init_embeddings``; the provider's key in the service's
environment) or ``module:callable`` (a function from texts to vectors, sync or async, or an
``Embeddings``). Embedding happens in the service: agents need no keys.

``--store-ttl '{"default_ttl": 60, "refresh_on_read": true, "sweep_interval_minutes": 5}'``: minutes,
applied to every item without a TTL of its own, the extracted memories included.

:func:`parse_index` and :func:`parse_ttl` check the JSON when the settings are read (a bad key is a
settings error naming it); :func:`store_options` turns them into the backend store's keyword arguments
when the service opens (importing the embedder then).
"""

from __future__ import annotations

import json
from typing import Any

from reducing_saver.service.imports import ResolveError, import_or_provider, kind_of
from reducing_saver.service.storage import backend_module

#: The keys of --store-index and --store-ttl (the stores' IndexConfig and TTLConfig).
INDEX_KEYS = frozenset({"dims", "embed", "fields"})
TTL_KEYS = frozenset({"default_ttl", "refresh_on_read", "sweep_interval_minutes"})


class StoreConfigError(ValueError):
    """The store settings cannot be served by this backend or environment (the service will not start)."""


def _json(value: object, name: str) -> object:
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not JSON: {exc}") from None
    return value


def parse_index(value: object) -> dict[str, Any] | None:
    """``--store-index`` as a dict with ``dims`` (int > 0), ``embed`` (str) and ``fields`` (list of str)."""
    value = _json(value, "store_index")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("store_index must be a JSON object {dims, embed, fields}")
    unknown = sorted(set(value) - INDEX_KEYS)
    if unknown:
        raise ValueError(f"store_index: unknown key(s) {unknown}; use {sorted(INDEX_KEYS)}")
    dims, embed, fields = value.get("dims"), value.get("embed"), value.get("fields", ["$"])
    if not isinstance(dims, int) or isinstance(dims, bool) or dims <= 0:
        raise ValueError("store_index.dims must be a positive integer (the embedding's dimensions)")
    if not isinstance(embed, str) or ":" not in embed:
        raise ValueError("store_index.embed must be 'provider:model' or 'module:callable'")
    if not isinstance(fields, list) or not fields or not all(isinstance(f, str) and f for f in fields):
        raise ValueError('store_index.fields must be a non-empty list of JSON paths, e.g. ["$"]')
    return {"dims": dims, "embed": embed, "fields": fields}


def parse_ttl(value: object) -> dict[str, Any] | None:
    """``--store-ttl`` as a dict: ``default_ttl`` (minutes), ``refresh_on_read``, ``sweep_interval_minutes``

    Raises ``ValueError`` (what pydantic reports as a settings error), also for a value of the wrong type.
    """
    value = _json(value, "store_ttl")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            "store_ttl must be a JSON object {default_ttl, refresh_on_read, sweep_interval_minutes}"
        )
    unknown = sorted(set(value) - TTL_KEYS)
    if unknown:
        raise ValueError(f"store_ttl: unknown key(s) {unknown}; use {sorted(TTL_KEYS)}")
    default = value.get("default_ttl")
    if default is not None and (
        isinstance(default, bool) or not isinstance(default, (int, float)) or default <= 0
    ):
        raise ValueError("store_ttl.default_ttl must be a positive number of minutes")
    if not isinstance(value.get("refresh_on_read", True), bool):
        raise ValueError("store_ttl.refresh_on_read must be true or false")
    interval = value.get("sweep_interval_minutes")
    if interval is not None and (
        isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0
    ):
        raise ValueError("store_ttl.sweep_interval_minutes must be a positive integer")
    return {"refresh_on_read": True, **value}


def _embedder(embed: str) -> Any:
    """``module:attribute`` (an ``Embeddings``, its class, or a callable) or ``provider:model`` through
    langchain's ``init_embeddings``, resolved as every such setting is
    (:mod:`reducing_saver.service.imports`)."""

    def init(provider_model: str) -> Any:
        from langchain.embeddings import init_embeddings

        return init_embeddings(provider_model)

    try:
        target, from_provider = import_or_provider(
            embed, "--store-index embed", providers="embeddings", init=init
        )
    except ResolveError as exc:
        raise StoreConfigError(str(exc)) from None
    if from_provider:
        return target
    if isinstance(target, type):
        target = target()
    if not callable(target) and not hasattr(target, "embed_documents"):
        raise StoreConfigError(
            str(
                ResolveError(
                    "--store-index embed",
                    embed,
                    "not an embeddings model or callable",
                    f"got {kind_of(target)}: name an Embeddings or a callable (texts) -> vectors",
                )
            )
        )
    return target


def store_options(settings: Any) -> dict[str, Any]:
    """The backend store's keyword arguments (``index``, ``ttl``) for ``settings``."""
    options: dict[str, Any] = {}
    index = getattr(settings, "store_index", None)
    if index is not None:
        options["index"] = {**index, "embed": _embedder(index["embed"])}
    ttl = getattr(settings, "store_ttl", None)
    if ttl is not None:
        options["ttl"] = dict(ttl)
    return options


def refusal(settings: Any) -> str | None:
    """Why the service cannot serve these store settings on its backend (one line), or ``None``.

    Checked before the service starts (``reducing-saver serve``, ``worker``); the backends check again when
    they open the store, so an app built another way fails too. What a backend supports is its own to say
    (``store_refusal`` of its package).
    """
    index = getattr(settings, "store_index", None)
    ttl = getattr(settings, "store_ttl", None)
    if index is not None:
        try:
            _embedder(index["embed"])
        except StoreConfigError as exc:
            return str(exc)
    rules = backend_module(settings.database)
    default = (ttl or {}).get("default_ttl")
    if default is not None and rules.STORE_TTL_WHOLE_MINUTES and default != int(default):
        return (
            f"--store-ttl: default_ttl {default:g} is not a whole number of minutes, and this backend's "
            "store keeps TTLs in whole minutes (a refreshing read would round it): give whole minutes"
        )
    return rules.store_refusal(
        settings.database,
        index=index is not None,
        ttl=ttl is not None,
        postgres=getattr(settings, "postgres", None),
    )
