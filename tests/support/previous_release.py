"""The previous release of reducing-saver, in a virtual environment of its own.

``tests/fixtures/`` keeps the wheel of every release (docs/releasing.md); the previous release is the
newest of them older than this checkout's version (0.1.0, commit fa41e61, before 0.2.0), so a clone of any
depth can run it. :func:`build` makes a virtual environment holding only that wheel, whose other packages
(langgraph, psycopg, FastAPI, ...) come from the test environment through a path file: ``import
reducing_saver`` there imports the old code and nothing of this checkout.

Run as ``python -m tests.support.previous_release ACTION JSON`` inside that environment, this module is
an agent of the previous release: it runs a LangGraph chat graph on the old ``RemoteReducingSaver`` and
store calls on the old ``RemoteStore``, and prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import tomllib
from contextlib import contextmanager
from pathlib import Path

from tests.support.server import free_port, run_ready

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def release_wheels() -> dict[str, Path]:
    """The kept wheel of each release, by version."""
    return {path.name.split("-")[1]: path for path in FIXTURES.glob("reducing_saver-*-py3-none-any.whl")}


def previous_version() -> str:
    """The newest release older than this checkout's version (``pyproject.toml``)."""
    current = version_key(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
    older = [version for version in release_wheels() if version_key(version) < current]
    if not older:
        raise RuntimeError(
            f"tests/fixtures holds no wheel of a release before {current}: see docs/releasing.md"
        )
    return max(older, key=version_key)


VERSION = previous_version()
WHEEL = release_wheels()[VERSION]


class PreviousRelease:
    """The environment :func:`build` made: its python and its ``reducing-saver`` command."""

    def __init__(self, home: Path) -> None:
        self.home = home
        #: The schema version the release leaves a database at, per backend (-1: none recorded).
        self.schema: dict[str, int] = {}
        self.python = home / "bin" / "python"
        self.cli = home / "bin" / "reducing-saver"
        #: A folder holding only a link to this checkout's ``tests``: on the old processes' path instead of
        #: the checkout itself, whose ``reducing_saver.egg-info`` (this release's metadata) would make
        #: ``importlib.metadata`` report this release's version for the old code.
        self.tests_path = home / "tests-path"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment its processes run in: no setting of ours, ``tests`` importable."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_") and k != "PYTHONPATH"
        }
        return {**env, "PYTHONPATH": str(self.tests_path), **extra}

    def agent(self, action: str, **args: object) -> dict:
        """Run :func:`main` ``action`` in the old environment; its JSON answer."""
        result = subprocess.run(
            [str(self.python), "-m", "tests.support.previous_release", action, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=300,
            env=self.env(),
            cwd=self.tests_path,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"the previous release's agent failed ({action}):\n{result.stderr}")
        return json.loads(result.stdout.splitlines()[-1])


@contextmanager
def run_previous_service(
    release: PreviousRelease, log_dir: Path, *args: str, env: dict[str, str] | None = None
):
    """The previous release's ``reducing-saver serve ARGS`` on a free port (a real uvicorn process), until
    the block ends; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(release.cli), "serve", "--port", str(port), "--log-format", "text", *args]
    with run_ready(
        command, url, log_dir / f"previous-{port}.log", env=release.env(**(env or {})), cwd=release.tests_path
    ):
        yield url


def build(home: Path) -> PreviousRelease:
    """A virtual environment at ``home`` with the previous release's wheel installed, and the test
    environment's other packages visible behind it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True)
    release = PreviousRelease(home)
    release.tests_path.mkdir()
    (release.tests_path / "tests").symlink_to(ROOT / "tests")
    purelib = subprocess.run(
        [str(release.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The test environment's packages, after the environment's own (a path line adds a folder to
    # sys.path; the path files inside it, such as this checkout's editable install, are not run).
    ours = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    Path(purelib, "test-environment.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(release.python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            str(WHEEL),
        ],
        check=True,
    )
    seen = release.agent("identify")
    assert seen["version"] == VERSION, seen
    assert seen["package"].startswith(str(home)), seen  # the old code, not this checkout's
    release.schema = seen["schema"]
    return release


# -- the agent of the previous release (runs inside its environment) ------------------------------------


def _identify() -> dict:
    import importlib.metadata
    import importlib.util

    import reducing_saver.client

    schema = {}
    for backend in ("postgres", "sqlite"):
        name = f"reducing_saver.service.storage.{backend}.migrations"
        # -1: the release kept no schema version (0.1.0 had no migrations).
        schema[backend] = importlib.import_module(name).LATEST if importlib.util.find_spec(name) else -1
    # The distribution installed in this environment: the checkout's own metadata (an editable install's
    # egg-info in the repository, on the path as the working folder) may come first on sys.path.
    (installed,) = [
        dist
        for dist in importlib.metadata.distributions(name="reducing-saver")
        if Path(dist.locate_file("")).resolve().is_relative_to(Path(sys.prefix).resolve())
    ]
    return {
        "version": installed.version,
        "package": str(Path(reducing_saver.client.__file__).resolve()),
        "schema": schema,
    }


def _chat(url: str, threads: list[str], turns: int) -> dict:
    """``turns`` chat turns on each thread; the message ids of each thread's state afterwards."""
    from reducing_saver.client import RemoteReducingSaver
    from tests.support.chat import build_chat_graph, human

    seen = {}
    with RemoteReducingSaver(url) as saver:
        for thread in threads:
            graph = build_chat_graph(saver, prefix=thread, length=60)
            config = {"configurable": {"thread_id": thread}}
            for turn in range(turns):
                graph.invoke({"messages": [human(turn, thread, 60)]}, config)
            seen[thread] = [m.id for m in graph.get_state(config).values["messages"]]
    return seen


def _threads(url: str, threads: list[str]) -> dict:
    """The message ids of each thread's latest checkpoint, read with the old client."""
    from reducing_saver.client import RemoteReducingSaver

    with RemoteReducingSaver(url) as saver:
        found = {}
        for thread in threads:
            stored = saver.get_tuple({"configurable": {"thread_id": thread}})
            found[thread] = (
                None if stored is None else [m.id for m in stored.checkpoint["channel_values"]["messages"]]
            )
    return found


def _store(url: str, namespace: list[str], items: dict[str, dict]) -> dict:
    """Put ``items`` under ``namespace`` with the old ``RemoteStore``, read them back, search, list the
    namespaces, and delete the item ``gone`` if there is one."""
    from reducing_saver.client import RemoteStore

    ns = tuple(namespace)
    with RemoteStore(url) as store:
        for key, value in items.items():
            store.put(ns, key, value)
        got = {key: store.get(ns, key).value for key in items}
        searched = sorted(item.key for item in store.search(ns, limit=100))
        namespaces = [list(found) for found in store.list_namespaces(prefix=ns[:1])]
        if "gone" in items:  # the item named "gone" is deleted again
            store.delete(ns, "gone")
        deleted = store.get(ns, "gone") is None
    return {"got": got, "searched": searched, "namespaces": namespaces, "deleted": deleted}


def refuses_doomed(messages: list, namespace: tuple[str, ...], store) -> None:
    """An extractor for the previous release's service: fails on the messages of threads whose id starts
    with ``doomed`` (so they end as dead letters), writes the others into the store."""
    if any(label.startswith("doomed") for label in namespace):
        raise RuntimeError("this thread's messages are refused on purpose")
    for message in messages:
        store.put(namespace, message.id, {"content": message.content})


def main(argv: list[str]) -> None:
    action, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    actions = {"identify": _identify, "chat": _chat, "threads": _threads, "store": _store}
    print(json.dumps(actions[action](**args)))


if __name__ == "__main__":
    main(sys.argv[1:])
