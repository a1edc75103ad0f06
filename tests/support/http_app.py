"""A bare ASGI app under a uvicorn process of its own, for tests of the client's HTTP layer.

Every answer is JSON: the client's port (one per connection), the path, and the request body's ``token``.
``/close`` answers with ``Connection: close``; ``/slow?SECONDS`` waits that long before answering.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.server import ROOT, free_port


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(float(scope["query_string"] or 0))
    token = json.loads(body).get("token") if body else None
    answer = json.dumps({"port": scope["client"][1], "path": scope["path"], "token": token}).encode()
    headers = [(b"content-type", b"application/json")]
    if scope["path"] == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@contextmanager
def run_app(log_dir: Path, *uvicorn_args: str, scheme: str = "http") -> Iterator[str]:
    """``app`` under ``uvicorn ARGS`` on a free port of 127.0.0.1: yields its URL, stops it afterwards."""
    port = free_port()
    log = log_dir / f"uvicorn-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "tests.support.http_app:app",
                "--port",
                str(port),
                "--log-level",
                "warning",
                *uvicorn_args,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_listening(port, process, log)
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=15)


def _wait_listening(port: int, process: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = log.read_text(errors="replace")
            raise RuntimeError(f"uvicorn exited with {process.returncode}:\n{output}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s:\n{log.read_text(errors='replace')}")


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 that no CA signed (``openssl req -x509``), in ``folder``."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert
