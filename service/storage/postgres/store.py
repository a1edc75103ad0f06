"""PostgresStore whose searches page stably (``storage/paging.py``): ties broken by namespace and key,
and a query search's candidates bounded by the page's end rather than its size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langgraph.store.base import SearchOp
from langgraph.store.postgres import PostgresStore

from reducing_saver.service.storage.paging import extend_order, widened_limit

# Bytes order (COLLATE "C"), as SQLite and Python compare: the same pages whatever the database's collation.
_NEWEST = "ORDER BY store.updated_at DESC"
_NEWEST_TIES = 'store.prefix COLLATE "C", store.key COLLATE "C"'
_BEST = "ORDER BY score DESC"
_BEST_TIES = 'uniq.prefix COLLATE "C", uniq.key COLLATE "C"'


class PagingPostgresStore(PostgresStore):
    """LangGraph's ``PostgresStore``, constructed and used exactly like it; its searches order ties by
    namespace and key, and a query search with an ``offset`` finds the candidates of its page.

    The candidates of a query search are still what the vector index (HNSW by default) returns for the
    inner ``ORDER BY distance LIMIT n``, whose order among equal distances is the index's: paging is exact
    where PostgreSQL scans the table (small namespaces), approximate as the index is beyond that.
    """

    def _prepare_batch_search_queries(self, search_ops: Sequence[tuple[int, SearchOp]]) -> Any:
        queries, embedding_requests = super()._prepare_batch_search_queries(search_ops)
        stable = []
        for (sql, params), (_, op) in zip(queries, search_ops, strict=True):
            if op.query and self.index_config:
                # PostgresStore adds this key to its index config; its TypedDict does not declare it.
                per_item = self.index_config["__estimated_num_vectors"]  # type: ignore[typeddict-item]
                sql = extend_order(sql, _BEST, _BEST_TIES)
                params = widened_limit(
                    list(params), op.limit * per_item * 2 + 1, (op.offset + op.limit) * per_item * 2 + 1
                )
            else:
                sql = extend_order(sql, _NEWEST, _NEWEST_TIES)
            stable.append((sql, params))
        return stable, embedding_requests
