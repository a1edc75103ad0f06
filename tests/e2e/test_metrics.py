"""``/metrics`` and the request counters of a real service: what they count, when they answer."""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.server import run_service

pytestmark = pytest.mark.e2e

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` in a Prometheus text exposition: ``(labels, value)``."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
            out.append((labels, float(match["value"])))
    return out


def requests_by_status(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in samples(text, "reducing_saver_http_requests_total"):
        totals[labels["status"]] = totals.get(labels["status"], 0.0) + value
    return totals


def _cut_body(url: str, path: str) -> None:
    """A request announcing 100 bytes of body, sending one, then closing the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n{".encode()
        )
        time.sleep(0.05)


# -- a client that goes away mid-body -------------------------------------------------------------------


def test_a_client_that_disconnects_mid_body_is_counted_as_499_never_as_500(tmp_path: Path) -> None:
    cuts = 120
    with run_service(tmp_path, "--database", "memory://", "--log-format", "text") as service:
        paths = ["/v1/checkpoints/put", "/v1/checkpoints/list", "/store/batch"]
        with ThreadPoolExecutor(24) as pool:
            list(pool.map(lambda i: _cut_body(service.url, paths[i % len(paths)]), range(cuts)))
        deadline = time.monotonic() + 10
        while True:  # the service notices each disconnect on its own time
            totals = requests_by_status(httpx.get(f"{service.url}/metrics", timeout=10).text)
            if totals.get("499", 0) + totals.get("500", 0) >= cuts or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert httpx.get(f"{service.url}/healthz").status_code == 200
        output = service.output()
    assert "500" not in totals, totals
    assert totals.get("499") == cuts, totals
    assert "Traceback" not in output and " 500 " not in output, output[-3000:]
    assert output.count(" 499 ") == cuts, output[-3000:]
