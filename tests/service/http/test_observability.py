"""Metrics, request ids, JSON logs and graceful shutdown.

In-process (FastAPI TestClient) for the metrics and logs; a real `reducing-saver serve` process for
SIGTERM, whose logs must be JSON lines from start to finish.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from prometheus_client.parser import text_string_to_metric_families

from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.http.app import create_app
from reducing_saver.service.http.observability import (
    LATENCY_BUCKETS,
    JsonFormatter,
    ObservabilityMiddleware,
    ServiceMetrics,
    TextFormatter,
    WorkersCollector,
    log_handler,
    url_secrets,
)
from reducing_saver.service.messages_codec import SafeMessagesCodec
from reducing_saver.wire import blob_to_wire
from tests.support.bodies import messages_put_body as _put_body
from tests.support.server import run_service

SERDE = JsonPlusSerializer()


# -- helpers --------------------------------------------------------------------------------------


def _messages(n: int) -> list:
    out = [SystemMessage("sys", id="s")]
    for i in range(n):
        out.append(HumanMessage(f"q{i}", id=f"h{i}"))
        out.append(AIMessage(f"a{i}", id=f"a{i}"))
    return out


def _metrics(client: TestClient) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(Settings(database="memory://", max_messages=4, min_messages=2, max_body_bytes=64 * 1024))
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Everything logged while the test runs, formatted as the service's JSON lines."""
    stream = io.StringIO()
    handler = log_handler("json", stream=stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


# -- metrics --------------------------------------------------------------------------------------


def test_a_scrape_passes_over_the_metrics_file_a_starting_worker_has_not_sized_yet(tmp_path):
    """With several workers, a worker starting creates each of its metrics files empty and sizes it a
    moment later: a scrape in that moment must still answer, with every other worker's figures
    (prometheus_client's own ``MultiProcessCollector`` raises ``struct.error`` there, failing it)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    sized = MmapedDict(str(tmp_path / "counter_4241.db"))
    sized.write_value(mmap_key("requests", "requests_total", [], [], "Requests."), 3.0, 0.0)
    sized.close()
    (tmp_path / "counter_4242.db").touch()  # the starting worker's, not sized yet

    registry = CollectorRegistry()
    WorkersCollector(registry, path=str(tmp_path))
    figures = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    assert figures["requests_total"] == 3.0


def test_the_extraction_outbox_shows_in_the_metrics(client):
    body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(4))))
    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        samples = _metrics(client)
        if _value(samples, "reducing_saver_outbox_delivered") == 6 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # The 6 pruned messages were recorded, then the service's deliverer moved them to the store.
    assert _value(samples, "reducing_saver_outbox_delivered") == 6
    assert _value(samples, "reducing_saver_outbox_pending") == 0
    assert _value(samples, "reducing_saver_outbox_in_flight") == 0
    assert _value(samples, "reducing_saver_outbox_dead") == 0
    assert _value(samples, "reducing_saver_outbox_oldest_pending_age_seconds") == 0


def test_a_pruning_put_shows_in_the_metrics(client):
    messages = _messages(4)  # system + 8 messages; the window keeps s, h3, a3
    received = SERDE.dumps_typed(messages)[1]
    stored = SERDE.dumps_typed([messages[0], *messages[-2:]])[1]
    body = _put_body(blob_to_wire("msgpack", received))

    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    samples = _metrics(client)
    put = {"method": "POST", "route": "/v1/checkpoints/put", "status": "200"}
    assert _value(samples, "reducing_saver_http_requests_total", **put) == 1
    assert _value(samples, "reducing_saver_http_request_duration_seconds_count", **put) == 1
    assert _value(samples, "reducing_saver_messages_received_bytes_total") == len(received)
    assert _value(samples, "reducing_saver_messages_stored_bytes_total") == len(stored)
    assert len(received) > len(stored)
    assert _value(samples, "reducing_saver_messages_pruned_total") == 6
    assert _value(samples, "reducing_saver_messages_delivered_total") == 6
    assert _value(samples, "reducing_saver_messages_unreadable_total") == 0
    assert _value(samples, "reducing_saver_backend_savers") == 1
    assert _value(samples, "reducing_saver_backend_savers_borrowed") == 0

    # LangGraph hands the next put of the turn the same list: pruned again, delivered once (dedupe).
    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    samples = _metrics(client)
    assert _value(samples, "reducing_saver_http_requests_total", **put) == 2
    assert _value(samples, "reducing_saver_messages_pruned_total") == 12
    assert _value(samples, "reducing_saver_messages_delivered_total") == 6
    assert _value(samples, "reducing_saver_messages_stored_bytes_total") == 2 * len(stored)


def test_a_put_decodes_its_messages_once(client, monkeypatch):
    """The put's operation decodes the messages channel (its extension check) and hands the messages to
    the reducer, which does not read the value again; the metrics count the put all the same."""
    decoded = []
    decode = SafeMessagesCodec.decode
    monkeypatch.setattr(
        SafeMessagesCodec, "decode", lambda self, value: decoded.append(value) or decode(self, value)
    )
    received = SERDE.dumps_typed(_messages(4))[1]

    body = _put_body(blob_to_wire("msgpack", received))
    assert client.post("/v1/checkpoints/put", json=body).status_code == 200
    assert [value.data for value in decoded] == [received]
    samples = _metrics(client)
    assert _value(samples, "reducing_saver_messages_received_bytes_total") == len(received)
    assert _value(samples, "reducing_saver_messages_pruned_total") == 6


def test_a_put_within_the_window_is_stored_as_received(client):
    received = SERDE.dumps_typed(_messages(1))[1]
    assert (
        client.post("/v1/checkpoints/put", json=_put_body(blob_to_wire("msgpack", received))).status_code
        == 200
    )
    samples = _metrics(client)
    assert _value(samples, "reducing_saver_messages_received_bytes_total") == len(received)
    assert _value(samples, "reducing_saver_messages_stored_bytes_total") == len(received)
    assert _value(samples, "reducing_saver_messages_pruned_total") == 0


def test_unreadable_messages_are_counted_and_stored_unreduced(client):
    opaque = b"\x00secret bytes"
    assert (
        client.post("/v1/checkpoints/put", json=_put_body(blob_to_wire("msgpack+aes", opaque))).status_code
        == 200
    )
    samples = _metrics(client)
    assert _value(samples, "reducing_saver_messages_unreadable_total") == 1
    assert _value(samples, "reducing_saver_messages_received_bytes_total") == len(opaque)
    assert _value(samples, "reducing_saver_messages_stored_bytes_total") == len(opaque)


def test_a_refused_put_counts_its_status_but_no_bytes(client):
    import ormsgpack

    payload = ormsgpack.packb([ormsgpack.Ext(0, ormsgpack.packb(("os", "system", "true", "x")))])
    assert (
        client.post("/v1/checkpoints/put", json=_put_body(blob_to_wire("msgpack", payload))).status_code
        == 422
    )
    samples = _metrics(client)
    labels = {"method": "POST", "route": "/v1/checkpoints/put", "status": "422"}
    assert _value(samples, "reducing_saver_http_requests_total", **labels) == 1
    assert _value(samples, "reducing_saver_messages_received_bytes_total") == 0
    assert _value(samples, "reducing_saver_messages_stored_bytes_total") == 0


def test_routes_are_labelled_by_template_never_by_raw_path(client):
    assert client.get("/no/such/path/123").status_code == 404
    big = client.post(
        "/v1/checkpoints/put", content=b"x" * (65 * 1024), headers={"content-type": "application/json"}
    )
    assert big.status_code == 413  # answered by the body limit, before routing
    assert len(big.headers["x-request-id"]) == 32
    samples = _metrics(client)
    assert (
        _value(samples, "reducing_saver_http_requests_total", method="GET", route="unmatched", status="404")
        == 1
    )
    assert (
        _value(
            samples,
            "reducing_saver_http_requests_total",
            method="POST",
            route="/v1/checkpoints/put",
            status="413",
        )
        == 1
    )
    assert not any("/no/such" in str(labels) for _, labels in samples)


async def test_a_request_that_raises_counts_as_500_and_the_error_propagates(log_lines):
    metrics = ServiceMetrics(SafeMessagesCodec())

    async def broken(scope, receive, send):
        raise RuntimeError("bug")

    middleware = ObservabilityMiddleware(broken, metrics)
    scope = {"type": "http", "method": "POST", "path": "/x", "headers": [(b"x-request-id", b"r-500")]}
    with pytest.raises(RuntimeError, match="bug"):
        await middleware(scope, None, None)
    labels = {"method": "POST", "route": "unmatched", "status": "500"}
    assert metrics.registry.get_sample_value("reducing_saver_http_requests_total", labels) == 1
    access = next(r for r in _records(log_lines) if r["logger"] == "reducing_saver.access")
    assert (access["status"], access["request_id"]) == (500, "r-500")


def test_the_release_shows_in_the_metrics_the_capabilities_and_the_command_line(client):
    """An operator tells the replicas of two releases apart during a rollout: the installed version, read
    from the package metadata, in reducing_saver_build_info, /v1/capabilities and `reducing-saver --version`."""
    from reducing_saver.service.cli import build_parser
    from reducing_saver.service.version import __version__

    assert f'reducing_saver_build_info{{version="{__version__}"}} 1.0' in client.get("/metrics").text
    assert client.get("/v1/capabilities").json()["version"] == __version__
    parser = build_parser()
    version = next(action for action in parser._actions if "--version" in action.option_strings)
    assert version.version == f"reducing-saver {__version__}"
    assert __version__ == importlib.metadata.version("reducing-saver") != "0.0.0"


def test_a_background_failure_of_the_database_is_one_warning_then_counted(client, log_lines):
    """An outage fails every round of a background task: the first is one WARNING line without a traceback,
    the rest are counted only, until a round goes through again."""
    from reducing_saver.service.storage import DatabaseUnavailable
    from reducing_saver.service.storage.background import FailureLog

    failures = FailureLog("delivery", logging.getLogger("reducing_saver.test"))
    for _ in range(3):
        try:
            raise DatabaseUnavailable(
                "the database is unavailable: OperationalError: server closed the connection"
            )
        except DatabaseUnavailable as exc:
            failures.failed(exc, "delivery round failed; retrying")
    failures.succeeded()
    try:
        raise KeyError("a fault of the code")
    except KeyError as exc:
        failures.failed(exc, "delivery round failed; retrying")
    lines = [json.loads(line) for line in log_lines.getvalue().splitlines() if "delivery" in line]
    assert [line["level"] for line in lines] == ["WARNING", "INFO", "ERROR"]
    assert "exception" not in lines[0] and "server closed the connection" in lines[0]["message"]
    assert "Traceback" in lines[2]["exception"]  # a fault keeps its traceback
    metrics = client.get("/metrics").text
    assert 'reducing_saver_background_errors_total{kind="transient",task="delivery"} 3.0' in metrics
    assert 'reducing_saver_background_errors_total{kind="fault",task="delivery"} 1.0' in metrics


def test_openapi_lists_metrics(client):
    assert "/metrics" in client.get("/openapi.json").json()["paths"]


def test_postgres_pool_and_savers_show_as_gauges(fresh_pg):
    # No deliverer, sweeper or storage pass: their background work would take pool connections at any moment.
    app = create_app(
        Settings(database=fresh_pg, pool_size=3, extract=False, sweep=False, storage_refresh_seconds=0)
    )
    with TestClient(app) as client:
        samples = _metrics(client)
        assert _value(samples, "reducing_saver_db_pool_size") == 3
        assert _value(samples, "reducing_saver_db_pool_available") == 3
        assert _value(samples, "reducing_saver_db_pool_in_use") == 0
        assert _value(samples, "reducing_saver_db_pool_requests_waiting") == 0
        assert _value(samples, "reducing_saver_backend_savers") == 3
        assert _value(samples, "reducing_saver_backend_savers_borrowed") == 0

        backend = app.state.service.savers
        with backend.borrow() as saver, saver.inner.conn.connection():
            samples = _metrics(client)
        assert _value(samples, "reducing_saver_backend_savers_borrowed") == 1
        assert _value(samples, "reducing_saver_db_pool_in_use") == 1
        assert _value(samples, "reducing_saver_db_pool_available") == 2


def test_memory_backend_has_no_pool_gauges(client):
    assert not any(name.startswith("reducing_saver_db_pool") for name, _ in _metrics(client))


# -- request ids ----------------------------------------------------------------------------------


def test_a_given_request_id_is_echoed(client):
    response = client.get("/healthz", headers={"X-Request-ID": "trace-abc.123"})
    assert response.headers["x-request-id"] == "trace-abc.123"


@pytest.mark.parametrize("given", [None, b"", b"x" * 129, "caf\u00e9".encode("latin-1"), b"tab\there"])
def test_a_missing_or_unusable_request_id_is_replaced(client, given):
    headers = {} if given is None else {"X-Request-ID": given}
    response = client.get("/healthz", headers=headers)
    generated = response.headers["x-request-id"]
    assert generated != given and len(generated) == 32 and int(generated, 16) >= 0


def test_request_ids_differ_between_requests(client):
    assert client.get("/healthz").headers["x-request-id"] != client.get("/healthz").headers["x-request-id"]


# -- logs -----------------------------------------------------------------------------------------


def test_json_logs_carry_the_request_id_into_the_route_thread(log_lines):
    hook_logger = logging.getLogger("tests.hook")

    def hook(messages, namespace):  # runs in the route's worker thread, inside the reducer
        hook_logger.info("got %d pruned messages", len(messages))

    app = create_app(Settings(database="memory://", max_messages=4, min_messages=2), on_prune=[hook])
    body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(4))))
    access_logger = logging.getLogger("reducing_saver.access")
    with TestClient(app) as client:
        # A successful per-step call is access-logged at DEBUG: nothing at INFO ...
        client.post("/v1/checkpoints/put", json=body, headers={"X-Request-ID": "req-41"})
        assert not any(
            r.get("request_id") == "req-41" and r["logger"] == "reducing_saver.access"
            for r in _records(log_lines)
        )
        # ... and a line once the access logger is at DEBUG.
        access_logger.setLevel(logging.DEBUG)
        try:
            response = client.post("/v1/checkpoints/put", json=body, headers={"X-Request-ID": "req-42"})
        finally:
            access_logger.setLevel(logging.NOTSET)
    assert response.status_code == 200

    records = _records(log_lines)  # every line is one JSON object
    hook_line = next(r for r in records if r["logger"] == "tests.hook")
    assert hook_line["request_id"] == "req-41"
    assert hook_line["message"] == "got 6 pruned messages"
    access = next(
        r for r in records if r["logger"] == "reducing_saver.access" and r["request_id"] == "req-42"
    )
    assert access["method"] == "POST"
    assert access["route"] == "/v1/checkpoints/put"
    assert access["status"] == 200
    assert access["duration_ms"] > 0
    assert access["level"] == "DEBUG"
    assert {"timestamp", "logger", "message"} <= set(access)
    startup = next(r for r in records if "ready" in r["message"])
    assert startup["request_id"] is None


def test_probe_requests_are_logged_at_debug(client, log_lines):
    client.get("/healthz")
    client.get("/metrics")
    assert not any(r["logger"] == "reducing_saver.access" for r in _records(log_lines))


def test_exceptions_are_one_json_line():
    formatter = JsonFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    line = formatter.format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "failed here"
    assert "ValueError: boom" in parsed["exception"]


def test_text_format_shows_the_request_id():
    formatter = TextFormatter()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
    assert formatter.format(record).endswith("INFO x [-] hello")
    record.request_id = "r1"
    assert formatter.format(record).endswith("INFO x [r1] hello")


def test_the_database_password_never_reaches_the_logs(fresh_pg):
    url = fresh_pg.replace("postgres@", "postgres:s3cret%2Fpass@")
    settings = Settings(database=url, pool_size=2)
    stream = io.StringIO()
    handler = log_handler("json", secrets=url_secrets(settings.database), stream=stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with TestClient(create_app(settings)) as client:
            body = _put_body(blob_to_wire(*SERDE.dumps_typed(_messages(4))))
            assert client.post("/v1/checkpoints/put", json=body).status_code == 200
            # A careless line: the raw URL, and the password as psycopg would see it.
            logging.getLogger("tests.careless").warning("connecting to %s as %s", url, "s3cret/pass")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    output = stream.getvalue()
    assert "s3cret" not in output
    assert "postgres:***@" in output
    _records(stream)  # still JSON


# -- graceful shutdown (a real process) -----------------------------------------------------------


def _stalled_put(
    url: str, release: threading.Event, started: threading.Event, result: dict
) -> threading.Thread:
    """A put whose body arrives in two parts, the second once ``release`` is set."""
    body = json.dumps(_put_body(blob_to_wire(*SERDE.dumps_typed(_messages(4))))).encode()

    def chunks():
        yield body[:100]
        started.set()
        release.wait(30)
        yield body[100:]

    def run():
        try:
            result["response"] = httpx.post(
                f"{url}/v1/checkpoints/put",
                content=chunks(),
                headers={"content-type": "application/json"},
                timeout=60,
            )
        except httpx.HTTPError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.e2e
def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(tmp_path, pg_database):
    url = pg_database.replace("postgres@", "postgres:s3cret-pass@")
    with run_service(
        tmp_path, "--database", url, "--shutdown-grace-seconds", "20", "--log-level", "debug"
    ) as service:
        release, started, result = threading.Event(), threading.Event(), {}
        thread = _stalled_put(service.url, release, started, result)
        assert started.wait(10)
        time.sleep(0.3)  # the server has the headers: the request is in flight
        service.process.send_signal(signal.SIGTERM)
        _wait_for(lambda: "Shutting down" in service.output())
        time.sleep(0.3)
        assert service.process.poll() is None  # still waiting for the request
        release.set()
        thread.join(10)
        assert result.get("response") is not None, result
        assert result["response"].status_code == 200
        assert service.process.wait(timeout=15) == 0

    records = [json.loads(line) for line in service.output().splitlines()]  # JSON from start to finish
    messages = [r["message"] for r in records]
    assert any(
        m.startswith("reducing-saver ") and "backend postgres (postgresql://postgres:***@" in m
        for m in messages
    )
    closed = messages.index("backend postgres closed; shutdown complete")
    access = next(i for i, r in enumerate(records) if r.get("route") == "/v1/checkpoints/put")
    assert access < closed  # the backend closed after the request finished
    assert "s3cret-pass" not in service.output()


@pytest.mark.e2e
def test_sigterm_cancels_a_request_that_outlives_the_grace(tmp_path):
    with run_service(tmp_path, "--database", "memory://", "--shutdown-grace-seconds", "1") as service:
        release, started, result = threading.Event(), threading.Event(), {}
        thread = _stalled_put(service.url, release, started, result)
        try:
            assert started.wait(10)
            time.sleep(0.3)
            sent = time.monotonic()
            service.process.send_signal(signal.SIGTERM)
            assert service.process.wait(timeout=10) == 0
            assert time.monotonic() - sent < 6
        finally:
            release.set()
            thread.join(10)
    output = service.output()
    assert "timeout graceful shutdown exceeded" in output
    assert "shutdown complete" in output


def test_request_metrics_count_and_bucket_each_request_as_prometheus_client_would():
    """observe_request adds to the children's values directly: the same figures as inc() and observe()."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    metrics = ServiceMetrics(SafeMessagesCodec())
    reference = CollectorRegistry()
    labels = ("method", "route", "status")
    counter = Counter("reducing_saver_http_requests", "", labels, registry=reference)
    histogram = Histogram(
        "reducing_saver_http_request_duration_seconds",
        "",
        labels,
        buckets=LATENCY_BUCKETS,
        registry=reference,
    )
    cases = [
        ("POST", "/v1/writes/put", 204, 0.0003),
        ("POST", "/v1/writes/put", 204, 0.001),  # on a bound: that bucket, as observe() counts it
        ("POST", "/v1/writes/put", 204, 99.0),  # past every bound: +Inf only
        ("GET", "/healthz", 200, 0.0),
        ("BREW", "/healthz", 418, 0.002),  # a method outside the known ones: "other"
        ("BREW", "/healthz", 418, 0.02),
    ]
    for method, route, status, seconds in cases:
        metrics.observe_request(method, route, status, seconds)
        label = (method if method != "BREW" else "other", route, str(status))
        counter.labels(*label).inc()
        histogram.labels(*label).observe(seconds)

    def samples(registry: Any) -> set[tuple[str, tuple, float]]:
        return {
            (sample.name, tuple(sorted(sample.labels.items())), sample.value)
            for family in registry.collect()
            if family.name.startswith("reducing_saver_http_request")
            for sample in family.samples
            if not sample.name.endswith("_created")
        }

    assert samples(metrics.registry) == samples(reference)


def test_delta_history_calls_are_logged_at_debug(client, log_lines):
    # LangGraph asks for a DeltaChannel's history at the start of every run: a per-step call.
    body = {"config": {"configurable": {"thread_id": "t-delta-log"}}, "channels": ["messages"]}
    response = client.post("/v1/checkpoints/delta-history", json=body)
    assert response.status_code == 200
    assert not any(r["logger"] == "reducing_saver.access" for r in _records(log_lines))
