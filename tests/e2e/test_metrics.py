"""``/metrics`` and the request counters of a real service: what they count, when they answer."""

from __future__ import annotations

import itertools
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.postgres import PG_HOST, PG_PORT
from tests.support.proxy import tcp_proxy
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

GET_BODY = {"config": {"configurable": {"thread_id": "metrics", "checkpoint_ns": ""}}}
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


# -- while the database is down ---------------------------------------------------------------------------


def test_metrics_answer_from_memory_at_once_while_the_database_hangs(fresh_pg: str, tmp_path: Path) -> None:
    with tcp_proxy((PG_HOST, int(PG_PORT))) as proxy:
        args = ("--database", proxy.url(fresh_pg), "--db-timeout-seconds", "5", "--pool-size", "2")
        with run_service(tmp_path, *args) as service, httpx.Client(base_url=service.url, timeout=30) as http:
            for _ in range(3):
                assert http.post("/v1/checkpoints/get", json=GET_BODY).status_code == 200
            healthy = http.get("/metrics").text
            assert samples(healthy, "reducing_saver_outbox_pending"), "outbox figures show while it answers"
            assert samples(healthy, "reducing_saver_outbox_status_age_seconds")[0][1] < 5

            proxy.hang()
            scrapes = []
            for _ in range(3):
                started = time.monotonic()
                response = http.get("/metrics")
                scrapes.append((response.status_code, time.monotonic() - started, response.text))
                time.sleep(1.0)
        for status, seconds, _ in scrapes:
            assert status == 200 and seconds < 1.5, (status, seconds)
        last = scrapes[-1][2]
        # Everything the process knows itself is there...
        counted = requests_by_status(last)
        assert counted.get("200", 0) >= 4, counted
        assert samples(last, "reducing_saver_backend_savers")
        # ... and the database's figures say how old they are (or are absent).
        ages = samples(last, "reducing_saver_outbox_status_age_seconds")
        assert not samples(last, "reducing_saver_outbox_pending") or (ages and ages[0][1] >= 2.0), ages


# -- several workers ------------------------------------------------------------------------------------


def test_each_scrape_of_two_workers_adds_up_both(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    requests = 60
    args = ("--database", "memory://", "--workers", "2", "--no-extract", "--no-sweep")
    with run_service(tmp_path, *args, env={"TMPDIR": str(temp)}) as service:
        assert list(temp.iterdir()), "the service keeps its workers' metrics in a folder of its own"
        with httpx.Client(base_url=service.url, timeout=30) as http:
            before = [requests_by_route(http.get("/metrics").text) for _ in range(4)]
            for _ in range(requests):
                # A new connection each time, so both workers get requests.
                assert httpx.post(f"{service.url}/v1/checkpoints/get", json=GET_BODY).status_code == 200
            scrapes = [http.get("/metrics").text for _ in range(6)]
        process = service.process
        _stop(process)
    after = [requests_by_route(text) for text in scrapes]
    gets = [counts.get("/v1/checkpoints/get", 0) for counts in after]
    assert gets == [requests] * 6, gets
    # Counters never go backwards from one scrape to the next, whichever worker answers.
    series = [*before, *after]
    for earlier, later in itertools.pairwise(series):
        assert all(later.get(route, 0) >= value for route, value in earlier.items()), (earlier, later)
    scraped = [counts.get("/metrics", 0) for counts in series]
    assert scraped == sorted(scraped) and scraped[-1] >= len(series) - 1, scraped
    # Gauges are combined too: no series per process id.
    assert "pid=" not in scrapes[-1], [line for line in scrapes[-1].splitlines() if "pid=" in line][:5]
    assert samples(scrapes[-1], "reducing_saver_backend_savers")
    assert process.returncode == 0
    assert not list(temp.iterdir()), "the workers' metrics folder is removed at exit"


def requests_by_route(text: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in samples(text, "reducing_saver_http_requests_total"):
        totals[labels["route"]] = totals.get(labels["route"], 0.0) + value
    return totals


def _stop(process, timeout: float = 30.0) -> None:
    process.terminate()
    process.wait(timeout=timeout)
