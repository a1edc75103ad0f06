"""A deterministic embedding for the store's semantic search tests (no network, no model).

``--store-index '{"dims": 64, "embed": "tests.support.embeddings:embed", ...}'``: like langchain_core's
``DeterministicFakeEmbedding``, the same text always gets the same vector (normal draws seeded by the
text's hash), so a query equal to an item's indexed text finds that item first with a score of 1. Plain
Python, not numpy: the project's Docker image, where SQLite's vector search is tested, has no numpy.
"""

from __future__ import annotations

import hashlib
import random

DIMS = 64


def embed(texts: list[str]) -> list[list[float]]:
    vectors = []
    for text in texts:
        draws = random.Random(hashlib.sha256(text.encode()).digest())
        vectors.append([draws.gauss(0.0, 1.0) for _ in range(DIMS)])
    return vectors
