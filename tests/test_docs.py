"""The code blocks of README.md and docs/*.md, run as written: the text and its test cannot drift.

How a page is run (the convention a page's author writes to):

* Every fenced block labelled ``python``, ``sh`` or ``bash`` runs, in page order, unless the line
  ``<!-- not run: <reason> -->`` stands right above its fence (blank lines between are fine); the reason
  must say why (Docker, Kubernetes, a cloud model, minutes of benchmarks...). Such blocks are listed as
  skipped tests with their reason. Output examples are labelled ``text``; a fence with no label, or one
  that looks runnable under another name (``py``, ``shell``, ``console``...), fails
  :func:`test_every_block_is_labelled_and_says_why_it_does_not_run`.
* All blocks of a page run in one fresh temporary folder (their working directory), with the project's
  virtual environment first on ``PATH``, none of the test run's own ``REDUCING_SAVER_*`` variables, and
  ``DATABASE_URL`` naming an empty PostgreSQL database of the page's own.
* The ``python`` blocks of a page run one after another in one fresh Python process and one namespace,
  so a page's blocks share state (a later block may use what an earlier one defined); top-level
  ``await`` works, on one event loop per page. ``sh``/``bash`` blocks run with ``bash -e -o pipefail``.
* A shell block with ``<!-- install -->`` right above its fence installs the project into a fresh
  virtual environment, as a new user does (say ``python3 -m venv .venv && pip install -e '.[server]'``).
  The pages run here in the project's own environment, so such a block is listed as skipped;
  ``tests/e2e/test_readme_install.py`` runs each one of the README in a copy of the checkout, then the
  README's service and its Python blocks in the environment it made.
* A ``text`` block with ``<!-- output -->`` right above its fence is what the shell block before it prints
  (its stdout and stderr): the page's run compares them line by line, a line ``...`` standing for any
  number of lines and ``...`` within a line for any characters. Quoted outputs (versions, messages) then cannot drift from the code.
* A shell block with ``<!-- service -->`` right above its fence starts a long-running service (say
  ``reducing-saver serve``): it runs in the background with ``REDUCING_SAVER_PORT=0``, so it listens on a
  free port (the block must not give ``--port``); the test waits for its ``listening on http://...`` line
  and for ``/readyz``. From then on, every later block of the page has ``127.0.0.1:8080`` (where the
  service listens by default) replaced by the address it really listens on, and ``REDUCING_SAVER_URL``
  set to its URL. The service is stopped (SIGTERM) when the page ends, as is anything a shell block left
  running in the background (each block runs in a process group of its own).

A page that talks to a service must start one in a block of its own; nothing else is provided.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN_LANGUAGES = {"python", "sh", "bash"}
#: Labels that look runnable but are not run: write python or bash (or text, for output).
LOOKS_RUNNABLE = {"", "py", "python3", "pycon", "shell", "console", "zsh", "shell-session", "ipython"}
DEFAULT_ADDRESS = "127.0.0.1:8080"
BLOCK_TIMEOUT = 180.0

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<label>[^`\s]*)[^`]*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
_SERVICE = re.compile(r"^\s*<!--\s*service\s*-->\s*$")
_INSTALL = re.compile(r"^\s*<!--\s*install\s*-->\s*$")
_OUTPUT = re.compile(r"^\s*<!--\s*output\s*-->\s*$")
#: Why an install block does not run in the pages' runs.
INSTALL_REASON = "installs into a fresh virtual environment (tests/e2e/test_readme_install.py runs it)"
_LISTENING = re.compile(r"listening on (http://[0-9A-Za-z.\-\[\]:]+)")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # the first line of code, 1-based
    label: str
    source: str
    not_run: str | None  # the reason, "" when the annotation gives none
    service: bool
    install: bool = False
    output: bool = False

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the annotation above each."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        indent, fence, label = match["indent"], match["fence"], match["label"].lower()
        start = index + 1
        end = start
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[start:end]
        ]
        above = start - 2
        while above >= 0 and not lines[above].strip():
            above -= 1
        annotation = lines[above] if above >= 0 else ""
        not_run = _NOT_RUN.match(annotation)
        found.append(
            Block(
                page=str(path.relative_to(ROOT)),
                line=start + 1,
                label=label,
                source="\n".join(body) + "\n",
                not_run=not_run["reason"].strip() if not_run else None,
                service=bool(_SERVICE.match(annotation)),
                install=bool(_INSTALL.match(annotation)),
                output=bool(_OUTPUT.match(annotation)),
            )
        )
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def runs_here(block: Block) -> bool:
    """Whether a page's run runs ``block`` (in the project's environment)."""
    return block.label in RUN_LANGUAGES and block.not_run is None and not block.install


# -- the checks on the text itself -------------------------------------------------------------------


def test_the_pages_are_found_and_hold_runnable_blocks():
    assert (ROOT / "README.md") in PAGES
    runnable = [b for b in all_blocks() if runs_here(b)]
    assert any(b.page == "README.md" and b.label == "python" for b in runnable), "the quickstart does not run"
    assert any(b.page == "README.md" and b.service for b in runnable), "the README starts no service"


def test_every_block_is_labelled_and_says_why_it_does_not_run():
    problems = []
    for block in all_blocks():
        if block.label in LOOKS_RUNNABLE:
            problems.append(
                f"{block.where}: a ```{block.label} block: label it python or bash (it runs), or text"
            )
        if block.not_run == "":
            problems.append(f"{block.where}: `<!-- not run: -->` needs a reason")
        if block.not_run is not None and block.label not in RUN_LANGUAGES:
            problems.append(f"{block.where}: a ```{block.label} block never runs; drop its `not run` line")
        if block.service and (block.label not in {"sh", "bash"} or block.not_run is not None):
            problems.append(f"{block.where}: `<!-- service -->` marks a shell block that runs")
        if block.install and block.label not in {"sh", "bash"}:
            problems.append(f"{block.where}: `<!-- install -->` marks a shell block")
    for page in PAGES:
        found = blocks(page)
        for before, block in zip([None, *found], found, strict=False):
            if block.output and (
                block.label != "text"
                or before is None
                or before.label not in {"sh", "bash"}
                or not runs_here(before)
                or before.service
            ):
                problems.append(
                    f"{block.where}: `<!-- output -->` marks a text block right after a shell block that runs"
                )
    assert not problems, "\n".join(problems)


def test_the_parser_reads_annotations_and_fences(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- not run: needs Docker -->\n\n```bash\ndocker compose up\n```\n\n"
        "<!-- service -->\n```sh\nreducing-saver serve\n```\n\n- a list:\n\n  ```python\n  x = 1\n  ```\n"
        "\n```text\noutput\n```\n\n<!-- not run: -->\n```python\npass\n```\n"
        "\n<!-- install -->\n```bash\npip install -e .\n```\n"
        "\n<!-- output -->\n```text\nok\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = blocks(page)
    assert [(b.label, b.line, b.not_run, b.service, b.install) for b in found] == [
        ("bash", 6, "needs Docker", False, False),
        ("sh", 11, None, True, False),
        ("python", 17, None, False, False),
        ("text", 21, None, False, False),
        ("python", 26, "", False, False),
        ("bash", 31, None, False, True),
        ("text", 36, None, False, False),
    ]
    assert found[-1].output and not found[-2].output
    assert found[2].source == "x = 1\n"


#: ``--flags`` the pages name that belong to other programs than ours, and whose.
FOREIGN_FLAGS = {
    "--build": "docker compose up",
    "--wait": "docker compose up (Compose v2)",
    "--build-arg": "docker build",
    "--no-deps": "pip wheel",
    "--wheel-dir": "pip wheel",
    "--short": "git status",
    "--tool": "valgrind",
    "--gil": "py-spy",
    "--runtime-mode": "granian",
    "--app-dir": "uvicorn",
    "--fix": "ruff check",
}
#: The project's programs besides `reducing-saver`, whose flags the pages name: their sources declare them.
OWN_PROGRAMS = ("benchmarks/*.py", "service/configuration/docs.py", "scripts/test")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_DECLARED = re.compile(r"""["'](--[a-z][a-z0-9-]*)["']""")


def reducing_saver_flags() -> set[str]:
    """Every option of every `reducing-saver` command (``--no-`` twins included)."""
    from reducing_saver.service.cli import build_parser

    found: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            found.update(option for option in action.option_strings if option.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return found


def test_every_flag_the_pages_name_exists():
    ours = reducing_saver_flags()
    declared = {
        flag
        for pattern in OWN_PROGRAMS
        for path in ROOT.glob(pattern)
        for flag in _DECLARED.findall(path.read_text())
    }
    unknown = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for flag in _FLAG.findall(line):
                if flag not in ours and flag not in declared and flag not in FOREIGN_FLAGS:
                    unknown.append(f"{page.relative_to(ROOT)}:{number}: {flag}")
    assert not unknown, (
        "no command takes these flags (another program's? add it to FOREIGN_FLAGS):\n" + "\n".join(unknown)
    )


#: Paths of the repository a page may name that a clean clone does not hold, and why.
NOT_IN_A_CLONE = {"benchmarks/results": "the benchmarks' output folder, git-ignored"}
_TOP = "tests|service|client|reducer|wire|benchmarks|deploy|docs|examples|scripts|\\.ci"
_PATH = re.compile(rf"(?<![\w/.<>$-])(?:{_TOP})/[\w./{{}},*<>$-]*")
_LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s]+)\)")


def _expanded(path: str) -> list[str]:
    """``a/{b,c}/<name>.py`` as globs: ``a/b/*.py``, ``a/c/*.py``."""
    match = re.search(r"\{([^}]*)\}", path)
    if match:
        return [
            g
            for part in match[1].split(",")
            for g in _expanded(path[: match.start()] + part + path[match.end() :])
        ]
    return [re.sub(r"<[^>]*>|\$\w+", "*", path)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def test_every_path_and_link_the_pages_name_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        where = page.relative_to(ROOT)
        for token in _PATH.findall(text):
            path = token.split(":", 1)[0].rstrip(".,;)")
            if path.rstrip("/") in NOT_IN_A_CLONE:
                continue
            if not all(any(ROOT.glob(glob.rstrip("/"))) for glob in _expanded(path)):
                missing.append(f"{where}: {token}")
        for target in _LINK.findall(text):
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                missing.append(f"{where}: link {target}")
            elif anchor and linked.suffix == ".md":
                headings = {_slug(line) for line in linked.read_text().splitlines() if line.startswith("#")}
                if anchor not in headings:
                    missing.append(f"{where}: link {target} (no such heading)")
    assert not missing, "the pages name what the repository does not hold:\n" + "\n".join(missing)


def test_the_path_and_flag_checks_see_what_they_look_for():
    assert _PATH.findall(
        "see `service/storage/{postgres,sqlite}/migrations.py` and tests/e2e/ (or /app/tests/x)"
    ) == ["service/storage/{postgres,sqlite}/migrations.py", "tests/e2e/"]
    assert _expanded("service/storage/<backend>/{a,b}.py") == [
        "service/storage/*/a.py",
        "service/storage/*/b.py",
    ]
    assert _expanded("tests/fixtures/reducing_saver-$VERSION-py3-none-any.whl") == [
        "tests/fixtures/reducing_saver-*-py3-none-any.whl"
    ]
    assert _FLAG.findall("`serve --no-migrate`, a |---| table, grep -A1 -- '--max-messages'") == [
        "--no-migrate",
        "--max-messages",
    ]
    assert _slug("## The latest checkpoint from memory") == "the-latest-checkpoint-from-memory"
    assert {"--no-migrate", "--summarizer", "--png", "--dry-run", "--version"} <= reducing_saver_flags()


def test_the_migrations_page_holds_the_schema_of_the_code():
    """The latest version, every table and every index of each backend's migrations, as the code has them
    (the page's list is rendered from it: ``python -m reducing_saver.service.configuration.docs``)."""
    from reducing_saver.service.storage.postgres import migrations as postgres
    from reducing_saver.service.storage.sqlite import migrations as sqlite

    page = (ROOT / "docs" / "migrations.md").read_text()
    for backend, module in (("PostgreSQL", postgres), ("SQLite", sqlite)):
        assert f"version **{module.LATEST}** on {backend}" in " ".join(page.split()), backend
        names = re.findall(
            r"(?:TABLE|INDEX)(?: CONCURRENTLY)? IF NOT EXISTS (\w+)", " ".join(module.MIGRATIONS)
        )
        assert [name for name in names if f"`{name}`" not in page] == [], backend


def _openapi_document() -> dict:
    from reducing_saver.service.configuration.settings import Settings
    from reducing_saver.service.http.app import create_app

    return create_app(Settings(database="memory://", sweep=False, extract=False, _env_file=None)).openapi()


def test_the_http_api_page_lists_every_route():
    document = _openapi_document()
    page = (ROOT / "docs" / "http-api.md").read_text()
    routes = [
        (method.upper(), path) for path, operations in document["paths"].items() for method in operations
    ]
    assert len(routes) >= 20
    missing = [f"{method} {path}" for method, path in routes if f"`{method} {path}" not in page]
    assert not missing, f"docs/http-api.md's table lacks {missing}"


def test_the_put_header_is_in_the_openapi_document_and_on_the_pages():
    from reducing_saver.wire import PARENT_MESSAGES_HEADER, PARENT_MESSAGES_KEPT, PUT_PATH

    parameters = _openapi_document()["paths"][PUT_PATH]["post"]["parameters"]
    assert [(p["name"], p["in"]) for p in parameters] == [(PARENT_MESSAGES_HEADER, "header")]
    for page in ("http-api.md", "memory.md"):
        text = " ".join((ROOT / "docs" / page).read_text().split())
        assert f"`{PARENT_MESSAGES_HEADER}: {PARENT_MESSAGES_KEPT}`" in text, page


def output_problem(expected: str, actual: str) -> str | None:
    """Why ``actual`` is not the output ``expected`` quotes, or ``None``: a line ``...`` stands for any
    lines, ``...`` within a line for any characters (a path that differs from run to run)."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?"
        if line.strip() == "..."
        else r"[^\n]*".join(re.escape(part) for part in line.rstrip().split("...")) + r"[ \t]*\n"
        for line in expected.splitlines()
    )
    if re.fullmatch(pattern, actual if actual.endswith("\n") else actual + "\n"):
        return None
    return f"the page quotes:\n{expected}\nthe command printed:\n{actual}"


def test_quoted_output_is_compared_line_by_line():
    printed = "applied migration 0: a\napplied migration 1: b...\napplied migration 2: c\ndone\n"
    assert output_problem("applied migration 0: a\n...\ndone\n", printed) is None
    assert output_problem("applied migration 1: b...\n", printed) is not None  # not the whole output
    assert output_problem("...\ndone\n", printed) is None
    assert output_problem("...\napplied migration 9: z\n...\n", printed) is not None
    assert output_problem("...\napplied migration 2: ...\ndone\n", printed) is None


# -- running a page ----------------------------------------------------------------------------------

#: Runs a page's Python blocks in one namespace: one JSON request per line on stdin, one JSON answer per
#: line on the original stdout (the blocks' own output goes to stderr, into the page's log).
_DRIVER = r"""
import ast, asyncio, inspect, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
namespace = {"__name__": "__main__"}
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
for request in sys.stdin:
    request = json.loads(request)
    os.environ.update(request["env"])
    try:
        code = compile("\n" * (request["line"] - 1) + request["source"], request["page"], "exec",
                       flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if code.co_flags & inspect.CO_COROUTINE:
            loop.run_until_complete(eval(code, namespace))
        else:
            exec(code, namespace)
        answer = {"ok": True}
    except BaseException:
        answer = {"ok": False, "error": traceback.format_exc()}
    sys.stderr.flush()
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
"""


class PageRun:
    """One page's run: its folder, its environment, its Python process and its services."""

    def __init__(self, folder: Path, database_url: str) -> None:
        self.folder = folder
        self.log = folder.parent / f"{folder.name}.log"
        venv_bin = str(Path(sys.executable).parent)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")},
            "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "DATABASE_URL": database_url,
            "NO_PROXY": "*",
            "PYTHONUNBUFFERED": "1",
        }
        self.address: str | None = None
        self.python: subprocess.Popen[str] | None = None
        #: The process groups its shell blocks and services started, stopped when the page ends.
        self.groups: list[subprocess.Popen[bytes]] = []

    def source(self, block: Block) -> str:
        if self.address is None:
            return block.source
        return block.source.replace(DEFAULT_ADDRESS, self.address).replace("localhost:8080", self.address)

    def run(self, block: Block) -> str | None:
        """Run ``block``; a shell block's output."""
        if block.service:
            self.start_service(block)
        elif block.label == "python":
            self.run_python(block)
        else:
            return self.run_shell(block)
        return None

    def run_shell(self, block: Block) -> str:
        """Run a shell block to its end. Its output goes to a file, not a pipe, so that a process it leaves
        in the background (``... &``) does not hold the block open; its process group is stopped when the
        page ends."""
        output = self.folder.parent / f"{self.folder.name}-shell-{block.line}.log"
        with output.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", self.source(block)],
                cwd=self.folder,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.groups.append(process)
        try:
            code = process.wait(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: the shell block ran longer than {BLOCK_TIMEOUT:.0f} s")
        text = output.read_text(errors="replace")
        if code != 0:
            pytest.fail(f"{block.where}: the shell block exited {code}\noutput:\n{text}")
        return text

    def run_python(self, block: Block) -> None:
        if self.python is None:
            with self.log.open("a") as log:
                self.python = subprocess.Popen(
                    [sys.executable, "-c", _DRIVER],
                    cwd=self.folder,
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
        assert self.python.stdin and self.python.stdout
        request = {"page": block.page, "line": block.line, "source": self.source(block), "env": self.env}
        self.python.stdin.write(json.dumps(request) + "\n")
        self.python.stdin.flush()
        ready, _, _ = select.select([self.python.stdout], [], [], BLOCK_TIMEOUT)
        line = self.python.stdout.readline() if ready else ""
        if not line:
            pytest.fail(
                f"{block.where}: no answer from the Python block in {BLOCK_TIMEOUT:.0f} s\n{self.output()}"
            )
        answer = json.loads(line)
        if not answer["ok"]:
            pytest.fail(
                f"{block.where}: the Python block failed\n{answer['error']}\noutput:\n{self.output()}"
            )

    def start_service(self, block: Block) -> None:
        log = self.folder.parent / f"{self.folder.name}-service-{block.line}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", block.source],
                cwd=self.folder,
                env={**self.env, "REDUCING_SAVER_PORT": "0"},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.groups.append(process)
        deadline = time.monotonic() + 60
        url = None
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if process.poll() is not None:
                pytest.fail(f"{block.where}: the service exited with {process.returncode}\n{text}")
            if url is None and (match := _LISTENING.search(text)):
                url = match[1]
            if url is not None:
                try:
                    if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        else:
            pytest.fail(
                f"{block.where}: the service was not ready within 60 s\n{log.read_text(errors='replace')}"
            )
        self.address = url.removeprefix("http://")
        self.env["REDUCING_SAVER_URL"] = url

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def close(self) -> None:
        if self.python is not None:
            assert self.python.stdin
            self.python.stdin.close()
            try:
                self.python.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.python.kill()
                self.python.wait()
            if self.python.stdout:
                self.python.stdout.close()
        for group in self.groups:
            _stop_group(group)


def _stop_group(leader: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group a block started (a service, or what a shell block left running), then
    SIGKILL whatever is left of it after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(leader.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            leader.poll()  # reap the leader: a zombie still counts as a member of its group
            try:
                os.killpg(leader.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.fixture
def page_run(tmp_path, fresh_pg) -> Iterator[PageRun]:
    folder = tmp_path / "page"
    folder.mkdir()
    run = PageRun(folder, fresh_pg)
    try:
        yield run
    finally:
        run.close()


def _runnable_pages() -> list[str]:
    return [str(page.relative_to(ROOT)) for page in PAGES if any(runs_here(b) for b in blocks(page))]


@pytest.mark.e2e
@pytest.mark.parametrize("page", _runnable_pages())
def test_page_runs_as_written(page, page_run):
    printed = None
    for block in blocks(ROOT / page):
        if runs_here(block):
            printed = page_run.run(block)
        elif block.output:
            assert printed is not None
            if problem := output_problem(block.source, printed):
                pytest.fail(f"{block.where}: {problem}")


@pytest.mark.parametrize(
    "block",
    [b for b in all_blocks() if b.label in RUN_LANGUAGES and (b.not_run or b.install)],
    ids=lambda b: b.where,
)
def test_block_not_run(block):
    pytest.skip(f"{block.where}: not run: {block.not_run or INSTALL_REASON}")
