"""SqliteStore whose searches page stably (``storage/paging.py``): ties broken by namespace and key,
and a query search's candidates bounded by the page's end rather than its size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langgraph.store.base import SearchOp
from langgraph.store.sqlite import SqliteStore

from reducing_saver.service.storage.paging import extend_order, widened_limit

_NEWEST = "ORDER BY updated_at DESC"
_BEST = "ORDER BY score DESC"


class PagingSqliteStore(SqliteStore):
    """LangGraph's ``SqliteStore``, constructed and used exactly like it; its searches order ties by
    namespace and key (SQLite compares text as bytes), and a query search with an ``offset`` finds the
    candidates of its page. sqlite-vec scans every vector, so a query search's pages are exact."""

    def _prepare_batch_search_queries(self, search_ops: Sequence[tuple[int, SearchOp]]) -> Any:
        queries, embedding_requests = super()._prepare_batch_search_queries(search_ops)
        stable = []
        for (sql, params, refresh), (_, op) in zip(queries, search_ops, strict=True):
            if op.query and self.index_config:
                # The candidates (first ORDER BY), then the page (last): both break ties alike.
                sql = extend_order(sql, _BEST, "s.prefix, s.key", which="first")
                sql = extend_order(sql, _BEST, "prefix, key", which="last")
                params = widened_limit(list(params), op.limit * 2, (op.offset + op.limit) * 2)
            else:
                sql = extend_order(sql, _NEWEST, "prefix, key")
            stable.append((sql, params, refresh))
        return stable, embedding_requests
