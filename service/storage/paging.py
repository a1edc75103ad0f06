"""Stable pages of store searches: what the three backends' stores share.

LangGraph's stores order a search without a query by ``updated_at`` alone (PostgresStore, SqliteStore) or
by insertion (InMemoryStore), and one with a query by score alone. Items written together tie: one
delivery batch shares PostgreSQL's ``NOW()``, SQLite keeps whole seconds, equal texts get equal scores.
Ties come back in whatever order the database likes, so ``limit``/``offset`` pages overlap and skip.
Each backend's store (``storage/<backend>/store.py``) breaks them the same way: newest first (or best
score first), then namespace, then key, both compared as bytes (the namespace as its labels joined by
``.``), so one search pages the same on the three backends.

PostgresStore and SqliteStore also bound a query search's candidates by the page's ``limit`` alone (twice
it, times the vectors per item), so pages past that came back empty; the bound covers ``offset`` too.

The SQL stores extend LangGraph's own query builders: :func:`extend_order` adds the tie-breaker to the
``ORDER BY`` they write, and leaves a query it does not recognise as it is (a later LangGraph may write
it differently; ``tests/service/storage/test_store_paging.py`` then fails).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

_warned: set[str] = set()
#: Digits of a score that count when ordering by it (float64 cosine similarity is exact to about 15).
_SCORE_DIGITS = 12


def extend_order(sql: str, order: str, tie_breaker: str, *, which: str = "only") -> str:
    """``sql`` with ``, tie_breaker`` after its ``order`` clause: the only one (``which="only"``), or the
    ``"first"`` or ``"last"`` of several.

    A query without that clause (or with several, for ``"only"``) is returned unchanged, and a warning
    names the clause once.
    """
    at = sql.rfind(order) if which == "last" else sql.find(order)
    if at < 0 or (which == "only" and sql.find(order, at + 1) >= 0):
        if order not in _warned:
            _warned.add(order)
            logger.warning(
                "store search: LangGraph's query has no single %r; its pages are left unordered on ties",
                order,
            )
        return sql
    end = at + len(order)
    return f"{sql[:end]}, {tie_breaker}{sql[end:]}"


def widened_limit(params: list[Any], expected: int, wanted: int) -> list[Any]:
    """``params`` with the candidates' bound (third from last, before the page's limit and offset)
    raised from ``expected``, what LangGraph computes, to ``wanted``; unchanged if it is not there."""
    if len(params) >= 3 and params[-3] == expected:
        return [*params[:-3], max(expected, wanted), *params[-2:]]
    if "candidates" not in _warned:
        _warned.add("candidates")
        logger.warning(
            "store search: LangGraph's query bounds its candidates differently; deep pages may be short"
        )
    return params


def namespace_key(namespace: Iterable[str]) -> str:
    """A namespace as the SQL stores compare it: its labels joined by ``.`` (compared as bytes)."""
    return ".".join(namespace)


def stable_sort(items: list[Any], *, by_score: bool) -> list[Any]:
    """Store items in page order: best score (``by_score``; no score last) or newest first, then
    namespace, then key. Python compares strings by code point, which is the order of their UTF-8 bytes."""
    items = sorted(items, key=lambda item: (namespace_key(item.namespace), item.key))
    if by_score:
        # Equal vectors may score a rounding error apart (1.0 and 1.0000000000000002): ties all the same.
        return sorted(
            items,
            key=lambda item: (item.score is not None, round(item.score or 0.0, _SCORE_DIGITS)),
            reverse=True,
        )
    return sorted(items, key=lambda item: item.updated_at, reverse=True)  # stable: ties keep the order above
