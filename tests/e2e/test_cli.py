"""The `reducing-saver` command line: help, validation, and the default run command."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from reducing_saver.service.cli import build_parser
from reducing_saver.service.configuration.flags import SERVE_FLAGS
from tests.support.server import CLI, run_service, wait_ready


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
        (
            ["--database", "mysql://x/y"],
            "--database / REDUCING_SAVER_DATABASE: unsupported database URL scheme 'mysql'",
        ),
        (["--pool-size", "0"], "--pool-size / REDUCING_SAVER_POOL_SIZE"),
        (["--port", "http"], "--port / REDUCING_SAVER_PORT"),
        (["--on-prune", "nocolon"], "module:name"),
    ],
)
def test_invalid_settings_exit_2_with_a_clear_message(args, needle):
    result = _run("serve", *args)
    assert result.returncode == 2
    assert needle in result.stderr


def test_version():
    """The installed release's version (its package metadata), so the replicas of two releases differ."""
    from reducing_saver.service.version import __version__

    result = _run("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"reducing-saver \d+\.\d+\.\d+\S*\n", result.stdout)
    assert result.stdout == f"reducing-saver {__version__}\n"


@pytest.mark.parametrize(
    ("flag", "choices"),
    [
        ("--log-level", "{debug,info,warning,error}"),
        ("--log-format", "{auto,json,text}"),
        ("--ttl-strategy", "{keep_latest,delete}"),
    ],
)
def test_help_lists_the_choices_and_argparse_refuses_others(flag, choices):
    assert f"{flag} {choices}" in _run("serve", "--help").stdout
    result = _run("serve", flag, "loud")
    assert result.returncode == 2
    assert f"argument {flag}: invalid choice: 'loud'" in result.stderr
    # One line that says where the choices are, not serve's thirty lines of usage.
    assert result.stderr.strip().splitlines() == [
        f"reducing-saver serve: argument {flag}: invalid choice: 'loud' (choose from "
        + ", ".join(repr(c) for c in choices.strip("{}").split(","))
        + "); see reducing-saver serve --help"
    ]


def test_a_usage_error_is_one_line_naming_help():
    result = _run("serve", "--no-such-flag")
    assert result.returncode == 2
    assert (
        result.stderr == "reducing-saver: unrecognized arguments: --no-such-flag; see reducing-saver --help\n"
    )
    assert _run("bogus").stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--max-messages", "4", "--min-messages", "9"], {}, ["--min-messages / ", "--max-messages / "]),
        (["--max-tokens", "10", "--target-tokens", "20"], {}, ["--target-tokens / ", "--max-tokens / "]),
        (
            [],
            {"REDUCING_SAVER_EXTRACTION_BASE_BACKOFF": "5", "REDUCING_SAVER_EXTRACTION_MAX_BACKOFF": "1"},
            ["REDUCING_SAVER_EXTRACTION_MAX_BACKOFF", "REDUCING_SAVER_EXTRACTION_BASE_BACKOFF"],
        ),
    ],
)
def test_a_check_across_settings_names_every_flag_involved(args, env, named):
    result = _run("serve", *args, env={**_clean_env(), **env})
    assert result.returncode == 2
    line = result.stderr.splitlines()[1]
    assert not line.lstrip().startswith("settings:"), line
    for needle in named:
        assert needle in line


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (["--default-ttl", "3q"], "'3q'"),
        (["--on-prune", "nocolon"], "'nocolon'"),
        (["--database", "mysql://x/y"], "'mysql://x/y'"),
        (["--port", "http"], "'http'"),
    ],
)
def test_setting_errors_show_the_value_once_and_no_pydantic_prefix(args, value):
    result = _run("serve", *args)
    assert result.returncode == 2
    assert "Value error," not in result.stderr
    assert result.stderr.count(value) == 1, result.stderr


def test_the_exposure_refusal_is_printed_once_with_exit_2(tmp_path):
    result, _ = _timed("serve", "--database", "memory://", "--host", "0.0.0.0", cwd=tmp_path)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count("refusing to listen on 0.0.0.0") == 1, output
    assert _one_line(result).startswith("reducing-saver: refusing to listen on 0.0.0.0")


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}


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
    assert "backend sqlite (sqlite:///reducing-saver.sqlite), window 20 messages" in service.output()


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


# -- what an operator sees when the service cannot start ----------------------------------------------

CLOSED_PORT_DB = "postgresql://postgres@127.0.0.1:1/x"  # nothing listens on port 1


def _timed(*args: str, cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=90, cwd=cwd, check=False
    )
    return result, time.monotonic() - started


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The command's whole complaint: exactly one line on stderr, no traceback, no false "listening"."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "listening" not in output, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("reducing-saver: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [["serve", "--port", "0"], ["worker"], ["extraction", "status"], ["extraction", "retry-dead"], ["sweep"]],
)
def test_an_unreachable_database_ends_every_command_at_once_with_one_line(tmp_path, command):
    result, seconds = _timed(*command, "--database", CLOSED_PORT_DB, cwd=tmp_path)
    assert result.returncode == 1
    assert seconds < 10
    line = _one_line(result)
    assert "cannot connect to PostgreSQL at postgresql://postgres@127.0.0.1:1/x" in line
    assert "Connection refused" in line


def test_a_missing_postgres_database_is_named(tmp_path, pg_database):
    missing = pg_database + "_missing"
    result, seconds = _timed("serve", "--database", missing, "--port", "0", cwd=tmp_path)
    assert result.returncode == 1 and seconds < 10
    assert f'database "{missing.rsplit("/", 1)[1]}" does not exist' in _one_line(result)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_named_and_nothing_claims_to_listen(tmp_path, workers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, seconds = _timed(
            "serve", "--database", "memory://", "--port", str(port), "--workers", workers, cwd=tmp_path
        )
    assert result.returncode == 1 and seconds < 10
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in _one_line(result)


@pytest.mark.parametrize(
    "command", [["extraction", "status"], ["extraction", "retry-dead"], ["sweep"], ["sweep", "--dry-run"]]
)
def test_read_only_commands_create_no_database(tmp_path, command):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    result, _ = _timed(*command, cwd=folder)  # the default database: reducing-saver.sqlite here
    assert result.returncode == 1
    assert f"the SQLite database {folder}/reducing-saver.sqlite does not exist" in _one_line(result)
    result, _ = _timed(*command, "--database", f"sqlite:///{tmp_path}/no/such/dir/x.sqlite", cwd=folder)
    assert result.returncode == 1
    assert "does not exist" in _one_line(result)
    assert list(folder.iterdir()) == [] and not (tmp_path / "no").exists()


def test_serve_creates_a_missing_sqlite_folder_and_says_so(tmp_path):
    with run_service(
        tmp_path, "--database", "sqlite:///data/sub/x.sqlite", "--log-format", "text"
    ) as service:
        pass
    assert (tmp_path / "data" / "sub" / "x.sqlite").exists()
    assert f"created the folder {tmp_path}/data/sub for the SQLite database x.sqlite" in service.output()


def test_the_listening_line_names_the_port_actually_bound(tmp_path):
    """With --port 0 the system picks the port: the line names that one, and the service answers there."""
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(CLI), "serve", "--database", "memory://", "--port", "0", "--log-format", "text"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"listening on (http://127\.0\.0\.1:(\d+))", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url, port = found.group(1), int(found.group(2))
        assert port != 0
        wait_ready(url, process, log)
        assert httpx.get(f"{url}/healthz").status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=15)


@pytest.mark.parametrize("encoding", ["SQL_ASCII", "LATIN1"])
def test_a_postgres_database_that_is_not_utf8_is_refused_at_start(tmp_path, pg_database, encoding):
    name = f"{pg_database.rsplit('/', 1)[1]}_{encoding.lower()}"
    admin = pg_database.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE \"{name}\" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        )
    try:
        url = pg_database.rsplit("/", 1)[0] + "/" + name
        for command in (["serve", "--port", "0"], ["worker"], ["sweep"]):
            result, seconds = _timed(*command, "--database", url, cwd=tmp_path)
            assert result.returncode == 1 and seconds < 10
            assert f"uses the encoding {encoding}; reducing-saver needs UTF8" in _one_line(result)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["serve", "--ttl-strategy", "foo"],
            "reducing-saver serve: argument --ttl-strategy: invalid choice: 'foo'",
        ),
        (["serve", "--no-such-flag"], "reducing-saver: unrecognized arguments: --no-such-flag"),
        (["sweep", "--dry-run", "--port", "1"], "reducing-saver: unrecognized arguments: --port 1"),
        (["frobnicate"], "reducing-saver: argument COMMAND: invalid choice: 'frobnicate'"),
    ],
)
def test_a_wrong_flag_is_one_line_not_a_usage_dump(args, needle):
    result = _run(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(needle), result.stderr
    assert "--help" in result.stderr and "usage:" not in result.stderr


def _serve_output(tmp_path, *args: str, terminal: bool) -> list[str]:
    """The lines `reducing-saver serve ARGS` prints until it listens and has started, on a terminal (a
    pseudo-terminal) or into a file, as under a process manager."""
    import pty

    log = tmp_path / f"serve-{'tty' if terminal else 'file'}.log"
    if terminal:
        leader, follower = pty.openpty()
        process = subprocess.Popen(
            [str(CLI), "serve", "--port", "0", *args],
            stdout=follower,
            stderr=follower,
            cwd=tmp_path,
            env=_clean_env(),
        )
        os.close(follower)
    else:
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(CLI), "serve", "--port", "0", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
                env=_clean_env(),
            )
    text = b""
    try:
        deadline = time.monotonic() + 30
        while b"Application startup complete" not in text:
            assert process.poll() is None and time.monotonic() < deadline, text.decode(errors="replace")
            if terminal:
                import select

                if select.select([leader], [], [], 0.2)[0]:
                    text += os.read(leader, 65536)
            else:
                time.sleep(0.1)
                text = log.read_bytes()
    finally:
        process.terminate()
        process.wait(timeout=15)
        if terminal:
            os.close(leader)
    return text.decode(errors="replace").replace("\r\n", "\n").splitlines()


def test_serve_on_a_terminal_logs_text_and_says_in_one_line_what_it_runs(tmp_path):
    lines = _serve_output(tmp_path, "--max-messages", "12", "--keep-checkpoints", "5", terminal=True)
    assert lines and not any(line.lstrip().startswith("{") for line in lines), lines
    # The migrations of a new database in one line, not one per statement.
    assert not any("applied migration" in line for line in lines), lines
    migrated = [line for line in lines if "reducing-saver schema" in line]
    assert len(migrated) == 1 and "to version" in migrated[0], lines
    # One line says what runs: backend, window, encryption, summarizer, kept checkpoints.
    (settings,) = [line for line in lines if "window" in line]
    for part in (
        "backend sqlite",
        "window 12 messages",
        "encryption off",
        "summarizer off",
        "keep-checkpoints 5",
    ):
        assert part in settings, settings


def test_serve_into_a_file_logs_json(tmp_path):
    lines = _serve_output(tmp_path, "--database", "memory://", terminal=False)
    records = [json.loads(line) for line in lines]
    assert any("listening on http://127.0.0.1:" in record["message"] for record in records)
