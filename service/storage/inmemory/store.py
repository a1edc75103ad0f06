"""InMemoryStore whose searches page as the SQL stores' do (``storage/paging.py``): newest first (best
score first with a query), then namespace, then key; and whose batches may index one text twice."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from langgraph.store.base import Op, Result, SearchOp
from langgraph.store.memory import InMemoryStore

from reducing_saver.service.storage.paging import stable_sort


class PagingInMemoryStore(InMemoryStore):
    """LangGraph's ``InMemoryStore``, constructed and used exactly like it; a search finds every match,
    orders it as the SQL stores do and then takes the page (InMemoryStore pages in insertion order, and
    by score alone with a query). Fine for the tests and demos it is for: a search reads every item.

    A batch whose items hold the same indexed text (two messages saying "thanks" in one delivery) is
    stored: InMemoryStore embeds each distinct text once, then failed matching the vectors to the places
    (``ValueError: Number of embeddings (1) does not match number of indices (2)``, langgraph#8822).
    """

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        results = super().batch([_everything(op) for op in ops])
        return [self._page(op, result) for op, result in zip(ops, results, strict=True)]

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        results = await super().abatch([_everything(op) for op in ops])
        return [self._page(op, result) for op, result in zip(ops, results, strict=True)]

    def _insertinmem_store(
        self, to_embed: dict[str, list[tuple[tuple[str, ...], str, str]]], embeddings: list[list[float]]
    ) -> None:
        """Each distinct text's vector (``to_embed`` is text -> the places holding it, in the order the
        texts were embedded) to every place holding that text."""
        if len(embeddings) != len(to_embed):
            raise ValueError(f"{len(embeddings)} embeddings for {len(to_embed)} texts")
        for embedding, places in zip(embeddings, to_embed.values(), strict=True):
            for namespace, key, path in places:
                self._vectors[namespace][key][path] = embedding

    def _page(self, op: Op, result: Any) -> Any:
        if not isinstance(op, SearchOp):
            return result
        ordered = stable_sort(result, by_score=bool(op.query and self.index_config))
        return ordered[op.offset : op.offset + op.limit]


def _everything(op: Op) -> Op:
    return op._replace(limit=sys.maxsize, offset=0) if isinstance(op, SearchOp) else op
