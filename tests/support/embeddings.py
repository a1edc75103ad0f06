"""A deterministic embedding for the store's semantic search tests (no network, no model).

``--store-index '{"dims": 64, "embed": "tests.support.embeddings:embed", ...}'``: langchain_core's
``DeterministicFakeEmbedding`` gives the same text the same vector, so a query equal to an item's
indexed text finds that item first with a score of 1.
"""

from __future__ import annotations

from langchain_core.embeddings import DeterministicFakeEmbedding

DIMS = 64
_FAKE = DeterministicFakeEmbedding(size=DIMS)


def embed(texts: list[str]) -> list[list[float]]:
    return _FAKE.embed_documents(list(texts))
