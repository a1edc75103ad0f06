"""What the wheel gives an agent's environment beyond the code: the type information of the client and the wire."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_marks_the_client_and_the_wire_as_typed(tmp_path: Path) -> None:
    """PEP 561: without ``py.typed`` in the installed package, a type checker ignores its annotations.
    setuptools (69 and later) ships a package folder's ``py.typed`` without a package-data entry."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in project["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("reducing_saver-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"reducing_saver/client/py.typed", "reducing_saver/wire/py.typed"} <= names
    assert "reducing_saver/client/_saver.py" in names  # the control: the listing is the package's
