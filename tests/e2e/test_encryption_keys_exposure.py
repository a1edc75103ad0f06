"""The key ring never shows: not in worker processes' environments, command lines, logs, /docs, /metrics
or errors of a service run in ``required`` mode with ``--workers 2``."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest
from langchain_core.messages import HumanMessage

from reducing_saver.client import RemoteReducingSaver
from tests.support.encrypted_graph import graph
from tests.support.encryption import new_key, ring_json
from tests.support.server import run_service

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _forms(key: str) -> list[str]:
    """The key as base64 and as hex: neither may appear."""
    return [key, base64.b64decode(key).hex()]


def test_the_key_never_shows(tmp_path, fresh_pg):
    key = new_key()
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=key)}
    args = ("--database", fresh_pg, "--encryption", "required", "--workers", "2", "--log-level", "debug")
    with run_service(tmp_path, *args, env=env) as process:
        with RemoteReducingSaver(process.url) as saver:  # the workers decrypt what they encrypt
            app = graph(saver)
            for turn in range(3):
                app.invoke({"messages": [HumanMessage(f"turn {turn}")]}, {"configurable": {"thread_id": "t"}})
            assert len(saver.get_tuple({"configurable": {"thread_id": "t"}}).checkpoint["channel_values"]["messages"]) == 6
        workers = _children(process.process.pid)
        assert len(workers) >= 2
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert "REDUCING_SAVER_ENCRYPTION_KEYS=/" in environ  # a path, not the ring
            for form in _forms(key):
                assert form not in environ and form not in cmdline
        keys_file = next(
            line.split("=", 1)[1] for line in environ.split("\0") if line.startswith("REDUCING_SAVER_ENCRYPTION_KEYS=")
        )
        assert Path(keys_file).stat().st_mode & 0o077 == 0
        pages = [httpx.get(process.url + path).text for path in ("/docs", "/openapi.json", "/metrics")]
        pages.append(httpx.post(process.url + "/v1/checkpoints/get", json={"config": {}}).text)
        for page in pages:
            for form in _forms(key):
                assert form not in page
    assert not Path(keys_file).exists()  # removed when the service stopped
    log = process.log.read_text()
    assert log.strip()  # the run logged
    for form in _forms(key):
        assert form not in log
