"""The project's own checks: ruff's lint rules and its formatting, and mypy over the packages.

The rules are pyproject.toml's (``[tool.ruff]``, ``[tool.mypy]``); docs/architecture.md says how to run
them by hand. Each check is also shown code it must refuse, so that a tool that checks nothing fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RUFF), *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


def test_ruff_finds_nothing() -> None:
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_formatted() -> None:
    result = ruff("format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_reads_the_projects_rules() -> None:
    """The control: an unused import, unsorted imports, a loop variable a closure captures, ``zip`` without
    ``strict=``, an old-style annotation: one rule of each family the project selects."""
    code = (
        "import sys\n"
        "import os\n"
        "from typing import Optional\n\n\n"
        "def f(values: Optional[list]) -> list:\n"
        "    return [lambda: v for v in zip(values, values)]\n"
    )
    result = ruff("check", "--no-cache", "--stdin-filename", "reducer/example.py", "-", stdin=code)
    assert result.returncode == 1
    for rule in ("F401", "I001", "B023", "B905", "UP045"):
        assert rule in result.stdout, (rule, result.stdout)
