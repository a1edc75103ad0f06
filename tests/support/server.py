"""Start the real service in a uvicorn process of its own, through the `reducing-saver` CLI."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("reducing-saver")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcess:
    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"service exited with {process.returncode}:\n{log.read_text(errors='replace')}"
            )
        try:
            if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"service not ready after {timeout}s:\n{log.read_text(errors='replace')}")


@contextmanager
def run_ready(
    command: list[str],
    url: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stop_timeout: float = 15.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (its output into ``log``), wait until ``url``/readyz answers 200, stop it (SIGTERM,
    then SIGKILL after ``stop_timeout`` seconds) afterwards."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        wait_ready(url, process, log)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def run_service(
    log_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    program: tuple[str, ...] = (str(CLI),),
) -> Iterator[ServiceProcess]:
    """Run `reducing-saver serve ARGS --port PORT`, wait for /readyz, stop it (SIGTERM) afterwards.

    ``program``: the command standing for ``reducing-saver`` (a benchmark's variant of the service takes
    the same arguments)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"service-{port}.log"
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    command = [*program, "serve", "--port", str(port), *args]
    with run_ready(command, url, log, env=full_env, cwd=log_dir) as process:
        yield ServiceProcess(process, url, log)


@contextmanager
def run_services(
    log_dir: Path, *arg_lists: tuple[str, ...], env: dict[str, str] | None = None, timeout: float = 90.0
) -> Iterator[list[ServiceProcess]]:
    """Start one `reducing-saver serve ARGS` per argument list at the same moment (replicas starting
    together), wait until every one answers /readyz (each within ``timeout`` s of the start), stop them all
    (SIGTERM) afterwards."""
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    services: list[ServiceProcess] = []
    try:
        for args in arg_lists:
            port = free_port()
            log = log_dir / f"service-{port}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [str(CLI), "serve", "--port", str(port), *args],
                    stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=log_dir,
                )  # fmt: skip
            services.append(ServiceProcess(process, f"http://127.0.0.1:{port}", log))
        for service in services:
            wait_ready(service.url, service.process, service.log, timeout=timeout)
        yield services
    finally:
        for service in services:
            if service.process.poll() is None:
                service.process.terminate()
        for service in services:
            try:
                service.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()


class ImageService:
    """The service running in a container of the project's image (:func:`run_in_image`)."""

    def __init__(self, container: str, url: str) -> None:
        self.container = container
        self.url = url

    def output(self) -> str:
        done = subprocess.run(["docker", "logs", self.container], capture_output=True, text=True, check=False)
        return done.stdout + done.stderr


@contextmanager
def run_in_image(
    image: str,
    *args: str,
    env: dict[str, str] | None = None,
    files: tuple[str, ...] = (),
    timeout: float = 120.0,
) -> Iterator[ImageService]:
    """Run `reducing-saver serve ARGS` in a container of ``image`` (its entrypoint), published on a free
    loopback port; wait for /readyz; remove the container afterwards.

    ``files`` (paths relative to the repository, e.g. a test module an ``embed`` spec names) are copied to
    ``/app`` in the container, which is on its ``PYTHONPATH``; copied, not mounted, so the engine need not
    see this machine's folders.
    """
    port = free_port()
    container = f"rstest-{os.getpid()}-{port}"
    variables = {"PYTHONPATH": "/app", **(env or {})}
    environment = [f"--env={name}={value}" for name, value in variables.items()]
    create = ["docker", "create", "--name", container, "--publish", f"127.0.0.1:{port}:8080", *environment]
    subprocess.run([*create, image, *args], check=True, capture_output=True, timeout=120)
    service = ImageService(container, f"http://127.0.0.1:{port}")
    try:
        with tempfile.TemporaryDirectory() as staging:  # docker cp makes no parent folders: a tree
            for path in files:
                (Path(staging) / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / path, Path(staging) / path)
            subprocess.run(["docker", "cp", f"{staging}/.", f"{container}:/app"], check=True, timeout=60)
        subprocess.run(["docker", "start", container], check=True, capture_output=True, timeout=120)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{service.url}/readyz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = subprocess.run(
                ["docker", "inspect", "--format", "{{.State.Running}}", container],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            if state != "true" or time.monotonic() > deadline:
                raise RuntimeError(f"service in {image} not ready (running: {state}):\n{service.output()}")
            time.sleep(0.2)
        yield service
    except BaseException:
        print(f"--- docker logs {container} ---\n{service.output()}")  # in pytest's report of the failure
        raise
    finally:
        subprocess.run(["docker", "rm", "--force", container], capture_output=True, check=False, timeout=120)
