"""The `reducing-saver` command line: help, validation, and the default run command."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from reducing_saver.service.cli import SERVE_FLAGS, build_parser
from tests.support.server import CLI, run_service


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=60, env=env)


def test_help_documents_every_option():
    result = _run("serve", "--help")
    assert result.returncode == 0
    for flag, field in SERVE_FLAGS.items():
        assert flag in result.stdout
        assert f"REDUCING_SAVER_{field.upper()}" in result.stdout
    assert "serve" in _run("--help").stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-messages", "4", "--min-messages", "9"], "min_messages must be between 1 and max_messages"),
        (["--database", "mysql://x/y"], "--database / REDUCING_SAVER_DATABASE: Value error, unsupported database URL scheme 'mysql'"),
        (["--pool-size", "0"], "--pool-size / REDUCING_SAVER_POOL_SIZE"),
        (["--port", "http"], "--port / REDUCING_SAVER_PORT"),
        (["--on-prune", "nocolon"], "module:name"),
    ],
)
def test_invalid_settings_exit_2_with_a_clear_message(args, needle):
    result = _run("serve", *args)
    assert result.returncode == 2
    assert needle in result.stderr


def test_environment_variables_are_read_and_flags_win(monkeypatch):
    monkeypatch.setenv("REDUCING_SAVER_MAX_MESSAGES", "7")
    monkeypatch.setenv("REDUCING_SAVER_PORT", "9999")
    from reducing_saver.service.cli import load_settings

    settings = load_settings(build_parser().parse_args(["serve", "--port", "1234"]))
    assert (settings.max_messages, settings.port) == (7, 1234)


def test_default_serve_uses_a_sqlite_file_in_the_working_folder(tmp_path):
    with run_service(tmp_path) as service:
        capabilities = httpx.get(f"{service.url}/v1/capabilities").json()
        assert capabilities["backend"] == "sqlite"
        assert (tmp_path / "reducing-saver.sqlite").exists()
    assert "listening on http://127.0.0.1:" in service.output()
    assert "backend sqlite: sqlite:///reducing-saver.sqlite" in service.output()


def test_the_database_password_is_not_printed(tmp_path, pg_database):
    url = pg_database.replace("postgres@", "postgres:s3cret-pass@")
    with run_service(tmp_path, "--database", url) as service:
        pass
    assert "s3cret-pass" not in service.output()
    assert "postgres:***@" in service.output()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def test_workers_get_the_flags_but_no_setting_or_key_through_their_environment(tmp_path):
    """A key from .env stays out of every process's environment; flags reach the workers all the same."""
    (tmp_path / ".env").write_text("REDUCING_SAVER_API_KEYS=ops=dotenv-secret-key\n")
    with run_service(tmp_path, "--database", "memory://", "--workers", "2", "--max-messages", "7") as service:
        workers = _children(service.process.pid)
        assert len(workers) >= 2
        for pid in [service.process.pid, *workers]:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"dotenv-secret-key" not in environ
            assert b"REDUCING_SAVER_API_KEYS" not in environ
            assert b"REDUCING_SAVER_MAX_MESSAGES" not in environ
        headers = {"Authorization": "Bearer dotenv-secret-key"}
        for _ in range(6):  # several connections: the answers come from both workers
            answer = httpx.get(f"{service.url}/v1/capabilities", headers=headers, timeout=10)
            assert answer.status_code == 200
            assert answer.json()["reducer"]["max_messages"] == 7
        assert httpx.get(f"{service.url}/v1/capabilities", timeout=10).status_code == 401
