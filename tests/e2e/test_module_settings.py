"""``module:attribute`` settings from the command line: the working folder is importable (as uvicorn's
``--app-dir`` makes it), and a setting that names nothing usable ends the command with one line saying
which of "module not found", "attribute not found", "not a callable", "provider package missing" (or
"module failed to import") it is.

The in-process rules, every setting against every kind of failure, are in tests/service/test_imports.py;
here the real command, started from a user's folder with nothing on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.server import CLI, free_port, run_ready

MY_MODULE = """
from langchain_core.messages import AIMessage


def summarize(previous, messages):
    return f"{len(messages)} messages cut"


def extract(messages, namespace, store):
    store.put(namespace, "count", {"n": len(messages)})


def hook(messages, namespace):
    pass


def embed(texts):
    return [[float(len(text)), 1.0, 0.0, 0.0] for text in texts]


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    """A folder holding the user's own module, as a new user writes it beside their service."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_module.py").write_text(MY_MODULE)
    (folder / "needs_a_package.py").write_text(
        "import no_such_package_anywhere\n\ndef summarize(p, m):\n    return ''\n"
    )
    return folder


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_") and k != "PYTHONPATH"}


def _index(embed: str) -> str:
    return json.dumps({"dims": 4, "embed": embed})


def test_every_module_setting_names_a_module_of_the_working_folder(user_folder: Path) -> None:
    port = free_port()
    command = [
        str(CLI),
        "serve",
        "--database",
        "memory://",
        "--port",
        str(port),
        "--log-format",
        "text",
        "--summarizer",
        "my_module:summarize",
        "--extractor",
        "my_module:extract",
        "--on-prune",
        "my_module:hook",
        "--store-index",
        _index("my_module:embed"),
    ]
    base = f"http://127.0.0.1:{port}"
    with run_ready(command, base, user_folder / "serve.log", env=_env(), cwd=user_folder):
        put = httpx.put(
            f"{base}/store/items", json={"namespace": ["notes"], "key": "k", "value": {"text": "tea"}}
        )
        assert put.status_code == 204, put.text
        search = {"namespace_prefix": ["notes"], "query": "tea"}
        found = httpx.post(f"{base}/store/items/search", json=search).json()["items"]
    # my_module:embed embedded the item (its value as JSON text, 15 characters) and the query ("tea"): the
    # score is the cosine of [15, 1, 0, 0] and [3, 1, 0, 0].
    cosine = (15 * 3 + 1) / (math.hypot(15, 1) * math.hypot(3, 1))
    assert [(item["key"], item["score"]) for item in found] == [("k", pytest.approx(cosine))]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--summarizer", "my_modul:summarize"), "--summarizer 'my_modul:summarize': module not found"),
        (("--summarizer", "my_module:summarise"), "--summarizer 'my_module:summarise': attribute not found"),
        (
            ("--summarizer", "my_module:NOT_CALLABLE"),
            "--summarizer 'my_module:NOT_CALLABLE': not a chat model or callable",
        ),
        (
            ("--summarizer", "groq:llama-3.1-8b-instant"),
            "--summarizer 'groq:llama-3.1-8b-instant': provider package missing",
        ),
        (
            ("--summarizer", "needs_a_package:summarize"),
            "--summarizer 'needs_a_package:summarize': module failed to import",
        ),
        (("--extractor", "my_module:extrakt"), "--extractor 'my_module:extrakt': attribute not found"),
        (("--on-prune", "my_modul:hook"), "--on-prune 'my_modul:hook': module not found"),
        (
            ("--store-index", _index("my_module:NOT_CALLABLE")),
            "--store-index embed 'my_module:NOT_CALLABLE': not an embeddings model or callable",
        ),
    ],
)
def test_a_setting_naming_nothing_usable_is_one_line_saying_what_is_missing(
    user_folder: Path, args: tuple[str, ...], expected: str
) -> None:
    result = subprocess.run(
        [str(CLI), "serve", "--database", "memory://", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        cwd=user_folder,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 2 and expected in result.stderr, result.stderr
