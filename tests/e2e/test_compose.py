"""The Docker image and the compose stack, for real: build, up, chat, restart, down.

These tests need a Docker engine and docker-compose (v1 ``docker-compose`` or v2 ``docker compose``).
Without an engine they skip, with the reason, on a developer's machine, and fail in CI (``CI=true``),
so CI can never pass without having run them. Deselect them locally with ``-m "not compose"``.

Every run uses a compose project and an image tag of its own and a free host port, so it never meets
a developer's stack; this module ends with ``down -v``, and the run (which may run the service in the
same image elsewhere: ``service_image`` in conftest.py) with the removal of the image and
``docker image prune -f``.
The figures a run measures (image size, times, turns, memories) are printed in pytest's summary.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import ROOT, free_port
from tests.test_deploy import AGENT, COMPOSE_FILE, POSTGRES, SERVICE, compose, dockerfile_uid, environment

pytestmark = pytest.mark.timeout(1800)

#: Turns each worker makes before the restart, and after it.
TURNS_BEFORE_RESTART = 8
TURNS_AFTER_RESTART = 4
#: How long the stack may take to answer, or the workers a turn, before the test gives up.
READY_TIMEOUT = 240.0
TURN_TIMEOUT = 180.0


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def no_engine(reason: str) -> None:
    """Skip on a developer's machine, fail in CI: CI must run these tests."""
    if in_ci():
        pytest.fail(f"{reason}; CI=true, so the compose tests must run, not skip")
    pytest.skip(f"{reason} (deselect with -m 'not compose')")


def compose_command() -> list[str] | None:
    """``docker-compose`` when installed (v1, or v2's standalone binary), else ``docker compose`` (v2)."""
    if path := shutil.which("docker-compose"):
        return [path]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], check=False, capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return None


def buildkit_env() -> dict[str, str]:
    """Environment that makes compose build with BuildKit, where a docker CLI on PATH can.

    Compose v2 always does. Compose v1 hands builds to the ``docker`` CLI it finds on PATH when
    ``COMPOSE_DOCKER_CLI_BUILD=1``; that CLI does BuildKit if it has the buildx plugin, or if it is
    older than 23.0 (BuildKit built in). The first such CLI on PATH is put in front; with none, the
    legacy builder (slower, same image).
    """
    path = os.environ.get("PATH", "")
    for directory in path.split(os.pathsep):
        cli = Path(directory) / "docker"
        if not (cli.is_file() and os.access(cli, os.X_OK)):
            continue
        if subprocess.run([str(cli), "buildx", "version"], check=False, capture_output=True).returncode == 0:
            usable = True
        else:
            version = subprocess.run(
                [str(cli), "version", "--format", "{{.Client.Version}}"],
                check=False,
                capture_output=True,
                text=True,
            ).stdout.strip()
            usable = bool(re.match(r"(\d+)\.", version)) and int(version.split(".")[0]) < 23
        if usable:
            return {
                "PATH": f"{directory}{os.pathsep}{path}",
                "DOCKER_BUILDKIT": "1",
                "COMPOSE_DOCKER_CLI_BUILD": "1",
            }
    return {"DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}


def log_time(stamp: str) -> float:
    """A ``docker logs -t`` timestamp (RFC 3339, nanoseconds, Z) as a Unix time."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.fromisoformat(whole).replace(tzinfo=UTC)
    return moment.timestamp() + float(f"0.{fraction or '0'}")


@dataclass
class Worker:
    """What one agent worker's log says: its thread, each turn's stored window, its failed turns."""

    container: str
    thread_id: str | None = None
    #: (turn, stored window, messages written so far, log time) per successful turn.
    turns: list[tuple[int, int, int, float]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    @property
    def last_turn(self) -> int:
        return self.turns[-1][0] if self.turns else 0

    def first_cut(self) -> float | None:
        """Log time of the first turn whose stored window is smaller than the turn before's."""
        for (_, before, _, _), (_, after, _, at) in itertools.pairwise(self.turns):
            if after < before:
                return at
        return None


LOG_LINE = re.compile(r"^(?P<container>\S+)\s+\|\s+(?P<stamp>\d{4}-\d\d-\d\dT[\d:.]+Z)\s(?P<text>.*)$")
THREAD_LINE = re.compile(r"agent on thread '(?P<thread>[^']+)'")
TURN_LINE = re.compile(
    r"turn (?P<turn>\d+): stored window (?P<window>\d+) messages, (?P<written>\d+) written"
)
FAILED_LINE = re.compile(r"turn (?P<turn>\d+): \w+(Error|Exception)\b")


class Stack:
    """One compose project of docker-compose.yml: its own name, image tag, host port and empty .env."""

    def __init__(self, work: Path) -> None:
        command = compose_command()
        assert command is not None
        self.project = f"rstest{os.getpid()}{uuid.uuid4().hex[:6]}"
        self.image = f"reducing-saver:test-{self.project}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        empty = work / "empty.env"  # a developer's .env must not change what is tested
        empty.write_text("")
        self.base = [*command, "-f", str(COMPOSE_FILE), "-p", self.project, "--env-file", str(empty)]
        variables = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
        self.env = {k: v for k, v in os.environ.items() if k not in variables}
        self.env |= {"PUBLISHED_PORT": str(self.port), "SERVICE_IMAGE": self.image}
        if command[-1] != "compose":
            self.env |= buildkit_env()
        # The stack's defaults, as a fresh clone gets them (checked by tests/test_deploy.py).
        services = compose({})["services"]
        self.api_key = environment(services[AGENT])["REDUCING_SAVER_API_KEY"]
        self.max_messages = int(environment(services[SERVICE])["REDUCING_SAVER_MAX_MESSAGES"])
        self.pg = environment(services[POSTGRES])

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [*self.base, *args],
            check=False,
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def docker(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", *args], check=False, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", "-t", service, timeout=60).stdout

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"the service did not become ready in {timeout} s:\n{self.logs(SERVICE)[-5000:]}"
        )

    def extraction_status(self) -> dict:
        response = httpx.get(f"{self.url}/v1/extraction/status", headers=self.headers(), timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def workers(self) -> dict[str, Worker]:
        found: dict[str, Worker] = {}
        for line in self.logs(AGENT).splitlines():
            if not (match := LOG_LINE.match(line)):
                continue
            worker = found.setdefault(match["container"], Worker(match["container"]))
            text = match["text"]
            if thread := THREAD_LINE.search(text):
                worker.thread_id = thread["thread"]
            elif turn := TURN_LINE.search(text):
                worker.turns.append(
                    (int(turn["turn"]), int(turn["window"]), int(turn["written"]), log_time(match["stamp"]))
                )
            elif failed := FAILED_LINE.search(text):
                worker.failed.append(int(failed["turn"]))
        return found

    def wait_turns(self, at_least: dict[str, int] | int, replicas: int = 2) -> dict[str, Worker]:
        """Wait until each worker's last successful turn reaches its mark."""
        deadline = time.monotonic() + TURN_TIMEOUT
        while True:
            workers = self.workers()
            marks = at_least if isinstance(at_least, dict) else {name: at_least for name in workers}
            if len(workers) >= replicas and all(
                workers[name].last_turn >= marks.get(name, 0) for name in workers
            ):
                return workers
            if time.monotonic() > deadline:
                raise AssertionError(f"workers too slow: {workers}\n{self.logs(AGENT)[-5000:]}")
            time.sleep(1)

    def store_rows(self) -> list[tuple[str, str, str]]:
        """``(prefix, key, content)`` of every item in PostgresStore's table, read with psql."""
        query = (
            "SELECT coalesce(json_agg(json_build_array(prefix, key, value->'data'->>'content')), '[]')"
            " FROM store"
        )
        result = self.run(
            "exec",
            "-T",
            POSTGRES,
            "psql",
            "-U",
            self.pg["POSTGRES_USER"],
            "-d",
            self.pg["POSTGRES_DB"],
            "-At",
            "-c",
            query,
            timeout=60,
        )
        return [tuple(row) for row in json.loads(result.stdout)]

    def window(self, thread_id: str) -> list:
        """The thread's stored messages, read through the service as the workers' tenant."""
        with RemoteReducingSaver(self.url, api_key=self.api_key) as saver:
            stored = saver.get_tuple({"configurable": {"thread_id": thread_id}})
        assert stored is not None, f"thread {thread_id} not found"
        return stored.checkpoint["channel_values"]["messages"]


def require_engine() -> None:
    if shutil.which("docker") is None:
        no_engine("no docker CLI on PATH")
    if subprocess.run(["docker", "info"], check=False, capture_output=True).returncode != 0:
        no_engine("no Docker engine answers `docker info`")
    if compose_command() is None:
        no_engine("neither docker-compose nor `docker compose` is installed")


@pytest.fixture(scope="module")
def stack(service_image) -> Iterator[tuple[Stack, dict[str, str]]]:
    """The image (built once per run: ``service_image`` in conftest.py) and its compose project, taken down
    with its volumes after this module's tests."""
    stack, figures = service_image
    try:
        yield stack, figures
    finally:
        stack.run("down", "-v", "--remove-orphans", timeout=300, check=False)


def expected_package_files() -> dict[str, str]:
    """sha256 of every module the wheel must hold, keyed by installed path, from pyproject.toml.

    setuptools' rules: each listed package's folder is found through the longest ``package-dir``
    prefix, and the package gets that folder's ``*.py`` files (sub-folders are packages of their own).
    A ``find`` directive instead of a list: every folder with ``__init__.py`` under a mapped folder.
    """
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    packages = setuptools["packages"]
    if not isinstance(packages, list):
        packages = [
            ".".join([name, *folder.relative_to(ROOT / directory).parts])
            for name, directory in package_dir.items()
            for folder in [ROOT / directory, *(ROOT / directory).rglob("*")]
            if folder.is_dir() and (folder / "__init__.py").is_file()
        ]

    def folder_of(package: str) -> Path:
        prefixes = [p for p in package_dir if p and (package == p or package.startswith(p + "."))]
        if not prefixes:
            return ROOT / package_dir.get("", "") / package.replace(".", "/")
        prefix = max(prefixes, key=len)
        rest = package[len(prefix) :].lstrip(".")
        return ROOT / package_dir[prefix] / rest.replace(".", "/")

    expected: dict[str, str] = {}
    for package in packages:
        folder = folder_of(package)
        modules = sorted(folder.glob("*.py"))
        assert modules, f"package {package}: no modules in {folder}"
        for module in modules:
            installed = "/".join([*package.split("."), module.name])
            expected[installed] = hashlib.sha256(module.read_bytes()).hexdigest()
    return expected


#: Run in the image: sha256 of every file of the installed reducing_saver packages, and the client's
#: public names imported the way agents import them.
IMAGE_PROBE = """
import hashlib, importlib, importlib.util, json, os, pathlib
found = {}
for location in importlib.util.find_spec("reducing_saver").submodule_search_locations:
    root = pathlib.Path(location).parent
    for path in pathlib.Path(location).rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            found[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
try:
    client = importlib.import_module("reducing_saver.client")
    names = {name: type(getattr(client, name)).__name__ for name in client.__all__}
    importlib.import_module("reducing_saver.service.http.app")
except Exception as exc:
    names = repr(exc)
print(json.dumps({"files": found, "client": names, "src": os.path.exists("/src"), "uid": os.getuid()}))
"""


def test_image_holds_exactly_the_repository_packages(stack):
    stack, figures = stack
    result = stack.docker("run", "--rm", "--entrypoint", "python", stack.image, "-c", IMAGE_PROBE)
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)

    expected = expected_package_files()
    installed = {path: digest for path, digest in probe["files"].items() if path.endswith(".py")}
    assert set(installed) == set(expected), (
        f"missing from the image: {sorted(set(expected) - set(installed))}; "
        f"not in the repository: {sorted(set(installed) - set(expected))}"
    )
    differ = sorted(path for path in expected if installed[path] != expected[path])
    assert not differ, f"the image's files differ from the repository's: {differ}"

    from reducing_saver import client  # the names the repository's client exports, all importable

    assert isinstance(probe["client"], dict), f"the image cannot import its packages: {probe['client']}"
    assert probe["client"] and set(probe["client"]) == set(client.__all__)
    assert probe["client"]["RemoteReducingSaver"] == "type"
    assert not probe["src"], "the runtime stage holds no source tree"
    assert probe["uid"] == dockerfile_uid() != 0

    # The entrypoint is the service's CLI.
    result = stack.docker("run", "--rm", stack.image, "--help")
    assert result.returncode == 0 and "--port" in result.stdout, result.stdout + result.stderr

    size = int(stack.docker("image", "inspect", "--format", "{{.Size}}", stack.image).stdout)
    figures["image"] = f"{size / 1e6:.0f} MB"
    figures["files"] = f"{len(expected)} modules identical"


def test_stack_bounds_windows_delivers_memories_and_survives_restarts(stack, record_property):
    """docker-compose.yml as a fresh clone runs it: PostgreSQL, the service, two example workers."""
    stack, figures = stack
    started = time.monotonic()
    up_at = time.time()
    stack.run("up", "-d", timeout=600)
    stack.wait_ready()
    figures["up to ready"] = f"{time.time() - up_at:.0f} s"

    # The workers chat; every stored window stays within the reducer's, and each is cut at some turn.
    workers = stack.wait_turns(TURNS_BEFORE_RESTART)
    assert len(workers) == 2, workers
    cuts = [worker.first_cut() for worker in workers.values()]
    assert all(cut is not None for cut in cuts), f"a worker's window was never cut: {workers}"
    figures["up to first reduced turn"] = f"{min(cuts) - up_at:.0f} s"
    for worker in workers.values():
        assert worker.thread_id, worker
        assert max(window for _, window, _, _ in worker.turns) <= stack.max_messages, worker
        assert 0 < len(stack.window(worker.thread_id)) <= stack.max_messages

    # The pruned messages reach long-term memory: delivered, and in PostgresStore's table.
    deadline = time.monotonic() + 60
    while (before := stack.extraction_status())["delivered"] == 0 and time.monotonic() < deadline:
        time.sleep(1)
    assert before["delivered"] > 0 and before["dead"] == 0, before
    rows_before = stack.store_rows()
    assert rows_before, "nothing in the store"

    # Restart the service mid-run: the workers carry on after it, and nothing is lost.
    marks = {name: worker.last_turn + TURNS_AFTER_RESTART for name, worker in stack.workers().items()}
    restarted = time.monotonic()
    stack.run("restart", SERVICE, timeout=300)
    stack.wait_ready()
    figures["service restart"] = f"{time.monotonic() - restarted:.0f} s"
    stack.wait_turns(marks)
    stack.run("stop", AGENT, timeout=300)
    workers = stack.workers()
    deadline = time.monotonic() + 120
    while (after := stack.extraction_status())["pending"] + after[
        "in_flight"
    ] and time.monotonic() < deadline:
        time.sleep(1)
    assert after["pending"] == after["in_flight"] == after["dead"] == 0, after
    assert after["delivered"] > before["delivered"], (before, after)

    rows = stack.store_rows()
    keys = {(prefix, key) for prefix, key, _ in rows}
    lost = {(prefix, key) for prefix, key, _ in rows_before} - keys
    assert not lost, f"memories delivered before the restart are gone: {lost}"
    assert after["delivered"] == len(rows), f"{after['delivered']} delivered, {len(rows)} in the store"

    # Per thread: every message a successful turn wrote is either in the window or in the store, once.
    for worker in workers.values():
        window = stack.window(worker.thread_id)
        assert len(window) <= stack.max_messages
        prefix = f"tenants.dev.memories.{worker.thread_id}"
        stored = [(key, content) for row_prefix, key, content in rows if row_prefix == prefix]
        assert not {key for key, _ in stored} & {message.id for message in window}, "pruned and kept at once"
        contents = [content for _, content in stored] + [message.content for message in window]
        questions = [int(n) for n in re.findall(r"^Question (\d+):", "\n".join(contents), re.MULTILINE)]
        assert len(questions) == len(set(questions)), f"a question stored twice: {sorted(questions)}"
        successful = {turn for turn, _, _, _ in worker.turns}
        assert successful <= set(questions), f"lost: {sorted(successful - set(questions))}"
        if not worker.failed:
            assert len(contents) == worker.turns[-1][2], (len(contents), worker.turns[-1])

    # The data survives down and up: the volume is named, and only `down -v` deletes it.
    stack.run("down", timeout=300)
    stack.run("up", "-d", POSTGRES, SERVICE, timeout=600)
    stack.wait_ready()
    assert set(stack.store_rows()) == set(rows)
    assert stack.extraction_status()["delivered"] == after["delivered"]

    turns = sum(worker.last_turn for worker in workers.values())
    figures["turns"] = f"{turns} by 2 workers (window <= {stack.max_messages})"
    figures["memories"] = (
        f"{len(rows)} in the store, {after['delivered']} delivered ({before['delivered']} before the restart)"
    )
    figures["stack test"] = f"{time.monotonic() - started:.0f} s"
    record_property("compose figures", "; ".join(f"{name}: {value}" for name, value in figures.items()))
