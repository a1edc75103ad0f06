"""Outputs the documentation quotes, found by how they start, for tests to compare with the real ones."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quoted_line(page: str, start: str) -> str:
    """The line of ``page`` (a path from the repository's root) that starts with ``start``."""
    return next(line for line in (ROOT / page).read_text().splitlines() if line.startswith(start))
