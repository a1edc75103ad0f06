"""Replay the hostile-input corpus (tests/hostile/corpus.py) against a running service.

One real uvicorn process (`reducing-saver serve`) on a PostgreSQL database of this module's own, with an
API key configured, serves every case. After each case: its status is one the case expects (4xx), the
detail names the field or cap setting, no table holds a row (checkpoints, blobs, writes, outbox), no
marker file exists (nothing was executed, nothing imported), and an ordinary request is served.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import ormsgpack
import psycopg
import pytest

from tests.hostile import corpus
from tests.hostile.corpus import CASES, SNAPSHOT_CASE, Case, Context
from tests.support.postgres import pg_url
from tests.support.server import ROOT, ServiceProcess, run_service

KEY = "hostile-corpus-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes", "reducing_saver_outbox", "store")


@pytest.fixture(scope="module")
def corpus_db() -> Iterator[str]:
    name = f"rs_hostile_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url(name)
    finally:
        with psycopg.connect(pg_url("postgres"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Context:
    root = tmp_path_factory.mktemp("hostile")
    (root / "markers").mkdir()
    return Context(markers=root / "markers", tripwire=root / "markers" / "tripwire-imported")


@pytest.fixture(scope="module")
def service(
    corpus_db: str, context: Context, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    logs = tmp_path_factory.mktemp("hostile-service")
    env = {"REDUCING_SAVER_API_KEYS": f"acme={KEY}", "HOSTILE_TRIPWIRE": str(context.tripwire)}
    with run_service(
        logs, "--database", corpus_db, "--max-messages", "4", "--min-messages", "2", env=env
    ) as svc:
        yield svc


def stored_rows(database: str) -> dict[str, int]:
    with psycopg.connect(database, autocommit=True) as conn:
        return {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in TABLES}


def markers(context: Context) -> list[str]:
    return sorted(p.name for p in context.markers.iterdir())


def raw_post(url: str, case: Case, body: bytes) -> tuple[int, bytes]:
    """POST over a bare socket, reading the answer while the body is still being sent.

    A server that refuses a large body answers before reading it and then closes the connection; an HTTP
    client still sending would see a reset instead of the answer.
    """
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    chunked = case.headers.get("transfer-encoding") == "chunked"
    head = [
        f"POST {case.path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Authorization: Bearer {KEY}",
    ]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}")
    answer = bytearray()

    def read() -> None:
        try:
            while chunk := sock.recv(65536):
                answer.extend(chunk)
                if b"\r\n\r\n" in answer:
                    header, _, rest = bytes(answer).partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in header.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    if len(rest) >= length:
                        return
        except OSError:
            return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        step = 1024 * 1024
        for start in range(0, len(body), step):
            piece = body[start : start + step]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if not reader.is_alive():
                break
        if chunked and reader.is_alive():
            sock.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server stopped reading: its answer is what counts
    reader.join(60)
    sock.close()
    header, _, rest = bytes(answer).partition(b"\r\n\r\n")
    assert header, "no answer at all"
    return int(header.split(b" ")[1]), rest


def send(service: ServiceProcess, case: Case, context: Context) -> tuple[int, str]:
    body = case.body(context)
    if case.raw:
        status, content = raw_post(service.url, case, body)
    else:
        headers = {"Content-Type": "application/json", **AUTH, **case.headers}
        response = httpx.request(
            case.method, service.url + case.path, content=body, headers=headers, timeout=60
        )
        status, content = response.status_code, response.content
    return status, content.decode("utf-8", "replace")


def assert_served(service: ServiceProcess) -> None:
    """The next ordinary request is answered."""
    response = httpx.post(
        f"{service.url}/v1/checkpoints/get",
        json={"config": {"configurable": {"thread_id": "victim", "checkpoint_ns": ""}}},
        headers=AUTH,
        timeout=30,
    )
    assert response.status_code == 200 and response.json() == {"checkpoint": None}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_request_is_refused_and_harmless(
    case: Case, service: ServiceProcess, context: Context, corpus_db: str
):
    status, detail = send(service, case, context)
    assert status in case.expect, f"{case.name}: {status} {detail[:500]}"
    for name in case.names:
        assert name in detail, f"{case.name}: the detail does not name {name!r}: {detail[:500]}"
    assert stored_rows(corpus_db) == dict.fromkeys(TABLES, 0), f"{case.name} stored something"
    assert markers(context) == [], f"{case.name} executed something"
    assert_served(service)
    assert service.process.poll() is None


def test_a_snapshot_is_stored_as_sent(service: ServiceProcess, context: Context, corpus_db: str):
    """Ext 7 as the whole messages value is a DeltaChannel snapshot: stored without being reduced
    (LangGraph names DeltaChannel-backed channels `messages` in its own tests, so real graphs send these).

    Its content is still read for extensions: one naming code is a corpus case (SNAPSHOT_CASE, refused).
    """
    body = json.loads(corpus.benign_snapshot_body(context))
    response = httpx.post(service.url + SNAPSHOT_CASE.path, json=body, headers=AUTH, timeout=30)
    try:
        assert response.status_code == 200, response.text
        got = httpx.post(
            f"{service.url}/v1/checkpoints/get", json={"config": body["config"]}, headers=AUTH, timeout=30
        ).json()["checkpoint"]
        assert got["values"]["messages"] == body["values"]["messages"], "stored as sent, byte for byte"
        assert stored_rows(corpus_db)["reducing_saver_outbox"] == 0, "nothing was decoded, so nothing pruned"
    finally:
        httpx.post(
            f"{service.url}/v1/threads/delete", json={"thread_id": "snapshot"}, headers=AUTH, timeout=30
        )
    assert stored_rows(corpus_db) == dict.fromkeys(TABLES, 0)


def test_an_ordinary_conversation_works_after_the_corpus(
    service: ServiceProcess, corpus_db: str, context: Context
):
    from reducing_saver.client import RemoteReducingSaver
    from tests.support.chat import build_chat_graph, human

    with RemoteReducingSaver(service.url, api_key=KEY) as saver:
        graph = build_chat_graph(saver, prefix="after")
        config = {"configurable": {"thread_id": "after-corpus"}}
        for turn in range(4):
            graph.invoke({"messages": [human(turn, "after")]}, config)
        assert len(graph.get_state(config).values["messages"]) <= 4
        saver.delete_thread("after-corpus")
    assert markers(context) == []


def test_the_attacks_are_live(tmp_path: Path, context: Context):
    """The corpus's payloads are real: LangGraph's stock decoder runs codes 0 and 1 and imports the tripwire.

    Run in a subprocess of its own, with the tripwire pointed into tmp_path, so this proof cannot leave a
    marker where the corpus tests look.
    """
    live = Context(markers=tmp_path, tripwire=tmp_path / "tripwire-imported")
    values = [
        corpus.attack(0, ("os", "system"), live.marker("os-system")),
        corpus.attack(1, ("subprocess", "Popen"), live.marker("popen")),
        corpus.attack(0, ("importlib", "import_module"), live.marker("unused")),
        # What a snapshot holds is decoded with the same hook: nested code runs too.
        ormsgpack.Ext(7, ormsgpack.packb([corpus.attack(0, ("os", "system"), live.marker("in-snapshot"))])),
        # Third-party functions are gadgets as well.
        corpus.ext(
            0, "yaml", "unsafe_load", f"!!python/object/apply:os.system ['touch {live.marker('yaml')}']"
        ),
        # So are standard-library classes re-exported by the service's own packages.
        *(build(live, f"reexport-{module}.{name}") for module, name, build in corpus.REEXPORTS[:3]),
    ]
    data = ormsgpack.packb(values)
    script = (
        "import sys, time\n"
        "from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer\n"
        "JsonPlusSerializer().loads_typed(('msgpack', sys.stdin.buffer.read()))\n"
        "time.sleep(0.5)\n"  # Popen runs touch in the background
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOSTILE_TRIPWIRE": str(live.tripwire)}
    env.pop("LANGGRAPH_STRICT_MSGPACK", None)
    result = subprocess.run(
        [sys.executable, "-c", script], input=data, env=env, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stderr.decode()
    assert live.marker("os-system").exists(), "code 0 naming os.system ran"
    assert live.marker("popen").exists(), "code 1 naming subprocess.Popen ran"
    assert live.tripwire.exists(), "code 0 naming importlib.import_module imported the tripwire"
    assert live.marker("in-snapshot").exists(), "code 0 inside a snapshot ran"
    assert live.marker("yaml").exists(), "code 0 naming yaml.unsafe_load ran"
    made = {path.name for path in tmp_path.iterdir()}
    assert "reexport-pip._internal.utils.wheel.ZipFile.marker" in made, "pip's ZipFile truncated a file"
    assert any(made_name.startswith("reexport-pip._internal.utils.filesystem") for made_name in made)
    assert "reexport-sqlite_vec.Connection.marker" in made, "sqlite_vec's Connection created a database"
    assert markers(context) == [], "the proof ran in its own folder"


def test_the_corpus_covers_what_the_issue_lists():
    names = {case.name for case in CASES}
    for code in range(8):
        for module, name in corpus.TARGETS:
            for placement in corpus.PLACEMENTS:
                assert f"ext{code}-{module}.{name}-{placement}" in names
    for code in corpus.STATE_CODES:
        for module, name in corpus.STATE_TARGETS:
            for place in corpus.STATE_PLACES:
                assert f"ext{code}-{module}.{name}-{place}" in names
                assert f"msgpack-ext{code}-{module}.{name}-{place}" in names
    for needed in (
        SNAPSHOT_CASE.name,
        "ext1-subprocess.Popen-in-state-dataclass",
        "ext0-os.system-pending-write-in-message",
        "deep-metadata-100000",
        "messages-million-entries",
        "body-100mb-declared",
        "truncated-msgpack",
        "bad-base64-messages",
        "non-utf8-latin1",
        "duplicate-top-level-key",
        "limit-negative",
        "limit-huge",
        "thread-nul-put",
        "thread-slash-traversal-get",
        "thread-dotdot-delete",
        "thread-10kb-put",
        "writes-10000",
        "channels-10000-values",
        "checkpoint-id-not-uuid",
    ):
        assert needed in names
    for module, name, _ in corpus.REEXPORTS:
        for place in corpus.REEXPORT_PLACES:
            assert f"reexport-{module}.{name}-{place}" in names
    assert len(CASES) >= 150


def test_the_security_page_gives_the_corpus_size():
    page = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    assert f"holds {len(CASES)} named hostile requests" in " ".join(page.split())
