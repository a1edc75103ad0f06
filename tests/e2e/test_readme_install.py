"""README.md as a new user follows it: its install blocks, as written, each in a fresh copy of the
checkout; ``reducing-saver serve`` as written; then every Python block of the README as a file of its
own, in a fresh interpreter of each environment the install blocks made.

The pages' own runs (``tests/test_docs.py``) use the project's environment, which holds every extra: a
README whose install leaves out what its Quickstart imports passes there. Here nothing is installed but
what a block installs.

pip runs offline, from a wheelhouse: the wheels of what the install blocks ask for, built by ``pip
wheel`` once per ``pyproject.toml`` (the one step that may download) and kept in the user's cache folder
(``~/.cache/reducing-saver/wheelhouse``, or ``REDUCING_SAVER_TEST_WHEELHOUSE``), so that the installs take
seconds, fresh clones of the same ``pyproject.toml`` share it, and a machine without it builds it once.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tests.test_docs import _LISTENING, DEFAULT_ADDRESS, Block, _stop_group, blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Seconds an install block may take (offline, from the wheelhouse), and a Python block.
INSTALL_SECONDS = 300
BLOCK_SECONDS = 120


def readme_blocks() -> list[Block]:
    return blocks(README)


def install_blocks() -> list[Block]:
    return [block for block in readme_blocks() if block.install]


def _pip_install_arguments(source: str) -> list[str]:
    """The requirement arguments of every ``pip install`` in a shell block (options dropped)."""
    found: list[str] = []
    for line in source.splitlines():
        for command in re.split(r"&&|;|\|\|", line):
            words = shlex.split(command, comments=True)
            if words[:1] == ["python3"] or words[:1] == ["python"]:
                words = words[2:] if words[1:2] == ["-m"] else words
            if words[:2] != ["pip", "install"]:
                continue
            found += [word for word in words[2:] if not word.startswith("-")]
    return found


def _requirements(argument: str, project: dict) -> list[str]:
    """What a ``pip install`` argument brings, as requirements ``pip wheel`` takes: ``.[extras]`` (the
    checkout) is its dependencies and those of its extras, read from ``pyproject.toml`` so that nothing is
    built in the checkout."""
    if argument != "." and not argument.startswith(".["):
        return [argument]
    extras = [extra.strip() for extra in argument[1:].strip("[]").split(",") if extra.strip()]
    return [
        *project["dependencies"],
        *(req for extra in extras for req in project["optional-dependencies"][extra]),
    ]


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """Wheels of every requirement the README's install blocks name, and of the project's build
    requirements (an editable install builds the project in an isolated environment)."""
    pyproject = ROOT / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text())
    requirements = sorted(
        {
            req
            for block in install_blocks()
            for arg in _pip_install_arguments(block.source)
            for req in _requirements(arg, config["project"])
        }
        | set(config["build-system"]["requires"])
    )
    key = hashlib.sha256(pyproject.read_bytes() + "\n".join(requirements).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reducing-saver" / "wheelhouse"
    folder = Path(os.environ.get("REDUCING_SAVER_TEST_WHEELHOUSE") or cache) / key
    if folder.is_dir():
        os.utime(folder)  # in use: not stale
        return folder
    building = folder.with_name(f"{key}.{os.getpid()}.partial")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(building),
            *requirements,
        ],
        check=True,
        timeout=900,
    )
    try:
        building.rename(folder)
    except OSError:  # another run built the same wheelhouse meanwhile
        shutil.rmtree(building, ignore_errors=True)
    month_ago = time.time() - 30 * 86400
    for stale in folder.parent.iterdir():  # wheelhouses of pyproject.toml files unused for a month
        if stale != folder and stale.stat().st_mtime < month_ago:
            shutil.rmtree(stale, ignore_errors=True)
    os.utime(folder)
    return folder


def _checkout_copy(destination: Path) -> Path:
    """The checkout's files (tracked, and new ones not ignored), as a fresh clone would hold them."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _new_user_path(home: Path) -> str:
    """A ``PATH`` whose ``python3`` is a plain interpreter (this one's base, outside any virtual
    environment), and without the test environment's commands."""
    bin_dir = home / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    python3 = bin_dir / "python3"
    if not python3.exists():
        python3.symlink_to(getattr(sys, "_base_executable", sys.executable))
    ours = str(Path(sys.prefix))
    rest = [
        entry
        for entry in os.environ.get("PATH", "").split(os.pathsep)
        if entry and not entry.startswith(ours)
    ]
    return os.pathsep.join([str(bin_dir), *rest])


def _base_env(path: str, wheelhouse: Path) -> dict[str, str]:
    dropped = (
        "REDUCING_SAVER_",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONHOME",
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    return {
        **env,
        "PATH": path,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheelhouse),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "NO_PROXY": "*",
        "PYTHONUNBUFFERED": "1",
    }


def _activated(env: dict[str, str], venv: Path) -> dict[str, str]:
    """``env`` as ``. .venv/bin/activate`` leaves a shell."""
    return {**env, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}"}


def _run_shell(block: Block, cwd: Path, env: dict[str, str], log: Path, timeout: float) -> str:
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", block.source],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        pytest.fail(f"{block.where}: ran longer than {timeout:.0f} s\n{log.read_text(errors='replace')}")
    finally:
        _stop_group(process)
    text = log.read_text(errors="replace")
    assert code == 0, f"{block.where}: exited {code}\n{text}"
    return text


class Environment:
    """A copy of the checkout in which one install block ran: the virtual environment it made."""

    def __init__(self, block: Block, folder: Path, env: dict[str, str]) -> None:
        self.block = block
        self.folder = folder
        venvs = [path.parent.parent for path in folder.glob("*/bin/activate")]
        assert len(venvs) == 1, f"{block.where}: expected one virtual environment in {folder}, found {venvs}"
        self.venv = venvs[0]
        self.env = _activated(env, self.venv)
        self.python = self.venv / "bin" / "python"


def _install(block: Block, home: Path, env: dict[str, str]) -> Environment:
    folder = _checkout_copy(home / "checkout")
    _run_shell(block, folder, env, home / "install.log", INSTALL_SECONDS)
    return Environment(block, folder, env)


class Service:
    """README's service block, started as written (on a free port) in an environment."""

    def __init__(self, block: Block, environment: Environment, log: Path) -> None:
        self.block = block
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", block.source],
                cwd=environment.folder,
                env={**environment.env, "REDUCING_SAVER_PORT": "0"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        url = None
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            assert self.process.poll() is None, f"{block.where}: the service exited\n{text}"
            if url is None and (match := _LISTENING.search(text)):
                url = match[1]
            if url is not None:
                try:
                    if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        else:
            self.stop()
            pytest.fail(
                f"{block.where}: the service was not ready within 60 s\n{log.read_text(errors='replace')}"
            )
        self.url = url
        self.address = url.removeprefix("http://")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
        _stop_group(self.process)


def _run_python_file(block: Block, environment: Environment, service: Service, folder: Path) -> None:
    """``python block.py``: the block alone, in a fresh interpreter of the environment."""
    source = block.source.replace(DEFAULT_ADDRESS, service.address)
    path = folder / f"readme_line_{block.line}.py"
    path.write_text(source)
    done = subprocess.run(
        [str(environment.python), str(path)],
        cwd=environment.folder,
        env=environment.env,
        capture_output=True,
        text=True,
        timeout=BLOCK_SECONDS,
        check=False,
    )
    assert done.returncode == 0, (
        f"{block.where}, run on its own as a file with {environment.block.where}'s install:\n"
        f"{done.stdout}\n{done.stderr}"
    )


def test_the_readme_installs_and_every_python_block_runs_on_its_own(wheelhouse, tmp_path):
    found = readme_blocks()
    installs = [block for block in found if block.install]
    services = [block for block in found if block.service]
    pythons = [block for block in found if block.label == "python"]
    assert installs and len(services) == 1 and pythons, "README: an install block, a service, Python blocks"
    service_block = services[0]
    assert installs[0].line < service_block.line, "the first install block comes before the service"
    assert all(block.line > service_block.line for block in pythons), "Python blocks follow the service"

    env = _base_env(_new_user_path(tmp_path), wheelhouse)
    environments = [
        _install(block, tmp_path / f"install-{index}", env) for index, block in enumerate(installs)
    ]
    first = environments[0]
    service = Service(service_block, first, tmp_path / "service.log")
    try:
        # The first environment is the user's shell: README's other shell blocks run there too, in order.
        for block in found:
            if block.line <= service_block.line or block.not_run is not None or block.install:
                continue
            if block.label in {"sh", "bash"}:
                shell = replace(block, source=block.source.replace(DEFAULT_ADDRESS, service.address))
                _run_shell(
                    shell, first.folder, first.env, tmp_path / f"shell-{block.line}.log", BLOCK_SECONDS
                )
            elif block.label == "python":
                _run_python_file(block, first, service, tmp_path)
        # Every other install (an agent's machine, say) runs every Python block as well.
        for environment in environments[1:]:
            for block in pythons:
                if block.not_run is None:
                    _run_python_file(block, environment, service, tmp_path)
    finally:
        service.stop()
