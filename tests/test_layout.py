"""The layout's contracts: which package may import which, and what the base install loads.

docs/architecture.md draws the rooms; these tests keep them apart. The import contracts live in
pyproject.toml (``[tool.importlinter]``) and are checked by ``lint-imports``, which is shown a contract
the code breaks so that a linter that checks nothing fails here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_import_contracts_hold() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    names = [contract["name"] for contract in PYPROJECT["tool"]["importlinter"]["contracts"]]
    for name in names:
        assert name.split(":")[0] in " ".join(result.stdout.split()), f"contract not checked: {name}"
    assert f"Contracts: {len(names)} kept, 0 broken." in result.stdout


def test_lint_imports_sees_a_broken_contract(tmp_path: Path) -> None:
    """The control: the service does import the reducer, so a contract forbidding it must break."""
    config = tmp_path / "broken.ini"
    roots = "\n    ".join(PYPROJECT["tool"]["importlinter"]["root_packages"])
    config.write_text(
        "[importlinter]\n"
        f"root_packages =\n    {roots}\n\n"
        "[importlinter:contract:broken]\n"
        "name = The service imports no reducer (false on purpose)\n"
        "type = forbidden\n"
        "source_modules = reducing_saver.service\n"
        "forbidden_modules = reducing_saver.reducer\n"
    )
    result = lint_imports("--config", str(config))
    assert result.returncode != 0
    assert "BROKEN" in result.stdout


def _layers_contract() -> dict:
    (contract,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return contract


def test_the_layers_contract_sees_an_import_upwards(tmp_path: Path) -> None:
    """The control of the layers: a scratch copy of the service where storage imports the HTTP edge and
    security imports encryption (its independent sibling) breaks the contract as pyproject.toml writes
    it, naming both imports; the copy as it is keeps it."""
    contract = _layers_contract()

    def scratch(name: str, wrong: dict[str, str]) -> Path:
        root = tmp_path / name
        for source in (ROOT / "service").rglob("*.py"):
            target = root / "scratch_service" / source.relative_to(ROOT / "service")
            target.parent.mkdir(parents=True, exist_ok=True)
            text = source.read_text().replace("reducing_saver.service", "scratch_service")
            target.write_text(text + wrong.get(str(source.relative_to(ROOT / "service")), ""))
        ignored = "".join(
            "\n    " + i.replace("reducing_saver.service", "scratch_service")
            for i in contract.get("ignore_imports", ())
        )
        layers = "\n    ".join(contract["layers"])
        (root / "layers.ini").write_text(
            "[importlinter]\n"
            "root_packages =\n    scratch_service\n\n"
            "[importlinter:contract:layers]\n"
            f"name = {contract['name']}\n"
            "type = layers\n"
            "containers =\n    scratch_service\n"
            f"exhaustive = {str(contract['exhaustive']).lower()}\n"
            f"layers =\n    {layers}\n" + (f"ignore_imports ={ignored}\n" if ignored else "")
        )
        return root

    def run(root: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(LINT_IMPORTS), "--no-cache", "layers.ini"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    kept = run(scratch("as-is", {}))
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "Contracts: 1 kept, 0 broken." in kept.stdout
    broken = run(
        scratch(
            "wrong",
            {
                "storage/paging.py": "\nfrom scratch_service.http import errors as _upwards  # noqa\n",
                "security/keys.py": "\nfrom scratch_service.encryption import keys as _sideways  # noqa\n",
            },
        )
    )
    assert broken.returncode != 0
    assert "BROKEN" in broken.stdout
    output = " ".join(broken.stdout.split())
    assert "scratch_service.storage.paging -> scratch_service.http.errors" in output, broken.stdout
    assert "scratch_service.security.keys -> scratch_service.encryption.keys" in output, broken.stdout


@pytest.mark.parametrize(
    "package", ["reducing_saver.reducer", "reducing_saver.wire", "reducing_saver.client"]
)
def test_the_base_install_packages_load_no_server_dependency(package: str) -> None:
    server_side = ("fastapi", "starlette", "uvicorn", "psycopg", "psycopg_pool", "pydantic_settings")
    io_side = ("httpx", "aiohttp") if package != "reducing_saver.client" else ()
    code = (
        f"import sys, {package}\n"
        f"found = sorted({{m.split('.')[0] for m in sys.modules}} & set({server_side + io_side!r}))\n"
        "assert not found, found\n"
        "assert not [m for m in sys.modules if m.startswith('reducing_saver.service')]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists every folder that holds an ``__init__.py`` under a mapped package."""
    config = PYPROJECT["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    assert found == listed


def test_no_code_comment_cites_a_file_outside_the_repository() -> None:
    sources = [
        p
        for folder in ("reducer", "wire", "client", "service", "tests", "benchmarks", "examples")
        for p in (ROOT / folder).rglob("*.py")
    ]
    needles = ("FACTS" + ".md", "../" + "shared")  # spelled apart, so this file does not cite them
    citing = [str(p.relative_to(ROOT)) for p in sources if any(n in p.read_text() for n in needles)]
    assert citing == []


# -- one protocol, written in wire ------------------------------------------------------------------

#: What a path of the protocol looks like: under /v1, the store's routes, the operations routes.
_PROTOCOL_PATH_PREFIXES = ("/v1/", "/store/", "/healthz", "/readyz", "/metrics")


def _own_path_literals(source: str, filename: str) -> list[str]:
    """String literals of code (docstrings aside) that are a protocol path or start like one."""
    import ast

    tree = ast.parse(source, filename)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{filename}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and node.value.startswith(_PROTOCOL_PATH_PREFIXES)
    ]


def test_neither_side_writes_a_path_of_its_own() -> None:
    """Every path of the protocol is a constant of reducing_saver.wire; the client and the service import it."""
    found = [
        hit
        for folder in ("client", "service")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in _own_path_literals(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == [], "\n".join(found)
    # The control: the check sees a path written as a literal.
    assert _own_path_literals('router.post("/v1/threads/delete")\n', "x.py") == [
        "x.py:1: '/v1/threads/delete'"
    ]


def _keys(body: type) -> set[str]:
    return set(body.__required_keys__ | body.__optional_keys__)


def _own_bodies(source: str, filename: str, wire_keys: list[set[str]]) -> list[str]:
    """Dict displays whose keys are all string literals naming fields of one wire body."""
    import ast

    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Dict) or not node.keys:
            continue
        keys = [
            key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
            for key in node.keys
        ]
        if None not in keys and any(set(keys) <= fields for fields in wire_keys):
            hits.append(f"{filename}:{node.lineno}: {sorted(keys)}")
    return hits


#: The service's HTTP edge: what reads requests and writes answers (storage and sweeps write LangGraph
#: configs, ``{"configurable": ...}``, which are no bodies).
_HTTP_EDGE = (
    "operations/saver.py",
    "operations/store.py",
    "http/errors.py",
    "http/hotpath.py",
    "http/schemas.py",
    "http/routes/*.py",
)


def test_neither_side_writes_a_body_of_its_own() -> None:
    """Every body the client sends and the service answers is built from wire/bodies.py, not a dict
    literal of its own."""
    from reducing_saver.wire import bodies

    wire_keys = [_keys(body) for body in bodies.BODIES]
    files = [
        *(ROOT / "client").glob("*.py"),
        *(path for edge in _HTTP_EDGE for path in (ROOT / "service").glob(edge)),
    ]
    found = [
        hit
        for path in sorted(files)
        for hit in _own_bodies(path.read_text(), str(path.relative_to(ROOT)), wire_keys)
    ]
    assert found == [], "\n".join(found)
    # The control: the check sees a body written as a dict literal.
    assert _own_bodies('post({"thread_id": "t"})\n', "x.py", wire_keys) == ["x.py:1: ['thread_id']"]


def test_every_release_keeps_its_wheel_and_the_next_one_is_open():
    """docs/releasing.md: each dated release of the changelog has its wheel in tests/fixtures (the upgrade
    test's previous release), and the one section still Unreleased is pyproject.toml's version."""
    import tomllib

    changelog = (ROOT / "CHANGELOG.md").read_text()
    sections = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - (Unreleased|\d{4}-\d{2}-\d{2})$", changelog, flags=re.MULTILINE
    )
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert [v for v, date in sections if date == "Unreleased"] == [version]
    released = [v for v, date in sections if date != "Unreleased"]
    assert released, "no release is dated"
    for release in released:
        assert (ROOT / "tests" / "fixtures" / f"reducing_saver-{release}-py3-none-any.whl").is_file(), release
