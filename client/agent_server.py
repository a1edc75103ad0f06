"""Factories for LangGraph Agent Server (``langgraph dev``, langgraph-api): its checkpointer and its store.

In ``langgraph.json``::

    {
      "dependencies": ["reducing-saver", "."],
      "graphs": {"agent": "./agent.py:graph"},
      "env": {"REDUCING_SAVER_URL": "http://reducing-saver:8080"},
      "checkpointer": {"path": "reducing_saver.client.agent_server.checkpointer"},
      "store": {"path": "reducing_saver.client.agent_server.store"}
    }

Agent Server splits a module path on its last dot, so the path is dotted throughout: ``pkg.mod.attr``
(a colon works only after a file path, ``./file.py:attr``).

Agent Server enters each factory once per event loop: once at start-up, and, with
``BG_JOB_ISOLATED_LOOPS=true``, again in each run thread's own loop, under a detector that fails any
blocking call made on a running loop. The factories therefore open with :meth:`RemoteReducingSaver.aopen`,
which sends its capabilities request through the async transport, and :meth:`RemoteStore.aopen`, which
sets the store up in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from reducing_saver.client._saver import RemoteReducingSaver
from reducing_saver.client._setup import API_KEY_ENV
from reducing_saver.client._store import RemoteStore

#: The service's base URL, e.g. ``http://reducing-saver:8080`` (``langgraph.json``'s ``env`` can set it).
URL_ENV = "REDUCING_SAVER_URL"

__all__ = ["API_KEY_ENV", "URL_ENV", "checkpointer", "store"]


def _url() -> str:
    url = os.environ.get(URL_ENV, "").strip()
    if not url:
        raise RuntimeError(
            f"{URL_ENV} is not set: set it to the reducing-saver service's URL (e.g. http://127.0.0.1:8080), "
            'in the environment or in langgraph.json\'s "env"'
        )
    return url


@asynccontextmanager
async def checkpointer() -> AsyncIterator[RemoteReducingSaver]:
    """A :class:`RemoteReducingSaver` for the service at ``$REDUCING_SAVER_URL``, closed on exit.

    The API key comes from ``$REDUCING_SAVER_API_KEY`` (none when unset). Opening makes no blocking call
    on the running event loop, so the factory is safe under ``BG_JOB_ISOLATED_LOOPS=true``.

    Raises:
        RuntimeError: If ``REDUCING_SAVER_URL`` is not set.
        ReducingSaverError: If the service does not answer its capabilities request.
    """
    saver = await RemoteReducingSaver.aopen(_url())
    try:
        yield saver
    finally:
        await saver.aclose()


@asynccontextmanager
async def store() -> AsyncIterator[RemoteStore]:
    """A :class:`RemoteStore` for the service at ``$REDUCING_SAVER_URL``, closed on exit.

    Agent Server's store routes (``/store/...``) and the graphs' ``runtime.store`` / ``get_store()`` then
    read and write the service's store, where the memories it extracts from pruned messages live. The API
    key comes from ``$REDUCING_SAVER_API_KEY`` (none when unset). Opening sends no request and makes no
    blocking call on the running event loop, so the factory is safe under ``BG_JOB_ISOLATED_LOOPS=true``;
    a wrong URL or key shows on the first store call. Semantic search and TTLs are the service's
    settings: Agent Server's ``store.index`` and ``store.ttl`` do not apply to a custom store.

    Raises:
        RuntimeError: If ``REDUCING_SAVER_URL`` is not set.
    """
    remote = await RemoteStore.aopen(_url())
    try:
        yield remote
    finally:
        await remote.aclose()
