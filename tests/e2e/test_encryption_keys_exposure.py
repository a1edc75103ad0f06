"""The key ring never shows: not in worker processes' environments, command lines, logs, /docs, /metrics
or errors of a service run in ``required`` mode with ``--workers 2``."""

from __future__ import annotations

import base64
import tempfile
import time
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
            assert (
                len(
                    saver.get_tuple({"configurable": {"thread_id": "t"}}).checkpoint["channel_values"][
                        "messages"
                    ]
                )
                == 6
            )
        workers = _children(process.process.pid)
        assert len(workers) >= 2
        # The supervisor read the ring from its environment: /proc keeps the environment a process started
        # with, whatever os.environ says since, so the service blanks the value there.
        supervisor = Path(f"/proc/{process.process.pid}/environ").read_bytes().decode(errors="replace")
        assert "REDUCING_SAVER_ENCRYPTION_KEYS=" in supervisor
        for form in _forms(key):
            assert form not in supervisor
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert "REDUCING_SAVER_ENCRYPTION_KEYS=/" in environ  # a path, not the ring
            for form in _forms(key):
                assert form not in environ and form not in cmdline
        keys_file = next(
            line.split("=", 1)[1]
            for line in environ.split("\0")
            if line.startswith("REDUCING_SAVER_ENCRYPTION_KEYS=")
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


def test_one_process_blanks_the_ring_in_its_environment(tmp_path):
    key = new_key()
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=key)}
    with run_service(tmp_path, "--database", "memory://", "--encryption", "required", env=env) as process:
        environ = Path(f"/proc/{process.process.pid}/environ").read_bytes().decode(errors="replace")
        for form in _forms(key):
            assert form not in environ
        with RemoteReducingSaver(process.url) as saver:  # and it still encrypts with it
            graph(saver).invoke({"messages": [HumanMessage("hi")]}, {"configurable": {"thread_id": "t"}})


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_killed_supervisor_takes_its_workers_and_the_key_file_along(tmp_path):
    """kill -9 of the --workers supervisor: its workers notice, stop serving and exit within seconds, and
    remove the key ring's file; a key folder a killed run left behind goes at the next start."""
    key = new_key()
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=key)}
    args = ("--database", "memory://", "--encryption", "required", "--workers", "2")
    stale = Path(tempfile.mkdtemp(prefix="reducing-saver-999999999-", dir="/dev/shm"))  # no such process
    (stale / "encryption-keys.json").write_text("{}")
    with run_service(tmp_path, *args, env=env) as process:
        assert not stale.exists(), "a key folder of a run no process serves is removed at start"
        workers = _children(process.process.pid)
        assert len(workers) >= 2
        environ = Path(f"/proc/{workers[0]}/environ").read_bytes().decode(errors="replace")
        keys_file = Path(
            next(
                line.split("=", 1)[1]
                for line in environ.split("\0")
                if line.startswith("REDUCING_SAVER_ENCRYPTION_KEYS=")
            )
        )
        assert keys_file.exists()
        process.process.kill()
        process.process.wait()
        started = time.monotonic()
        while not all(_gone(pid) for pid in workers) or keys_file.parent.exists():
            assert time.monotonic() - started < 10, (
                [pid for pid in workers if not _gone(pid)],
                sorted(p.name for p in keys_file.parent.glob("*")),
            )
            time.sleep(0.1)
        with pytest.raises(httpx.ConnectError):
            httpx.get(process.url + "/healthz", timeout=2)
