"""The project's own checks: ruff's lint rules and its formatting, and mypy over the packages.

The rules are pyproject.toml's (``[tool.ruff]``, ``[tool.mypy]``); docs/architecture.md says how to run
them by hand. Each check is also shown code it must refuse, so that a tool that checks nothing fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
#: mypy's cache, and the tree it checks: mypy cannot follow the install's package-dir mapping, so
#: ``reducing_saver/<package>`` links to each package's folder there.
MYPY_CACHE = ROOT / ".mypy_cache"


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


def mypy_tree() -> Path:
    """``reducing_saver/<package>`` -> the package's folder, for every package pyproject.toml maps."""
    tree = MYPY_CACHE / "tree"
    for package, folder in PACKAGES.items():
        link = tree.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if not (link.is_symlink() and link.resolve() == (ROOT / folder).resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(ROOT / folder, target_is_directory=True)
    return tree


def mypy(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """mypy with pyproject.toml's configuration and the project's cache, on ``args``."""
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    return subprocess.run(
        [*command, "--cache-dir", str(MYPY_CACHE), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_mypy_finds_nothing() -> None:
    """mypy over the four packages with pyproject.toml's ``[tool.mypy]``: no module's errors ignored."""
    packages = [arg for package in PACKAGES for arg in ("-p", package)]
    result = mypy(*packages, cwd=mypy_tree())
    assert result.returncode == 0, result.stdout + result.stderr
    # Every module of every package was read: a mapping that hid a package would pass with nothing checked.
    checked = int(re.search(r"no issues found in (\d+) source files", result.stdout).group(1))
    assert checked == sum(len(list((ROOT / folder).rglob("*.py"))) for folder in PACKAGES.values())


def test_mypy_ignores_no_module() -> None:
    """No override hides a module's errors: every module of the four packages is reported."""
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"].get("overrides", [])
    hiding = [
        o["module"] for o in overrides if o.get("ignore_errors") and "reducing_saver" in str(o["module"])
    ]
    assert not hiding, hiding


def test_mypy_sees_an_error(tmp_path: Path) -> None:
    """The control: with the project's configuration, mypy refuses a wrongly typed assignment."""
    module = tmp_path / "wrong.py"
    module.write_text("count: int = 'three'\n")
    result = mypy(str(module), cwd=tmp_path)
    assert result.returncode == 1
    assert "[assignment]" in result.stdout, result.stdout
