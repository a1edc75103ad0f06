"""The documentation rendered from the code: the settings, and the schema's migrations.

One source for each setting: its field in
:class:`~reducing_saver.service.configuration.settings.Settings` (name, default, description, allowed
values) and its flag (``flags.SERVE_FLAGS``, or ``flags.ENV_ONLY`` with the reason it has none). From them
this module renders

* the reference of ``docs/configuration.md`` (a table per group of settings, the flags of each command,
  the settings without a flag);
* the service's section of ``.env.example`` (every variable, commented out, at its default);
* the comments of ``deploy/configmap.yaml`` listing every setting the manifests leave at its default;

and from each backend's ``MIGRATIONS`` list the schema versions and migrations of ``docs/migrations.md``.

Each file keeps a hand-written part; only the text between its ``BEGIN generated`` and ``END generated``
lines is rendered. In the repository's root, after adding or changing a setting::

    python -m reducing_saver.service.configuration.docs            # rewrite the three files
    python -m reducing_saver.service.configuration.docs --check    # exit 1 naming the files that differ

``tests/test_config_docs.py`` fails while a committed file differs from its rendering.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, SecretStr

from reducing_saver.service.configuration.flags import (
    ENV_ONLY,
    EXTRACTION_FLAGS,
    SERVE_FLAGS,
    SWEEP_FLAGS,
    WORKER_FLAGS,
)
from reducing_saver.service.configuration.settings import Settings

COMMAND = "python -m reducing_saver.service.configuration.docs"
REFERENCE = Path("docs/configuration.md")
ENV_EXAMPLE = Path(".env.example")
CONFIGMAP = Path("deploy/configmap.yaml")
MIGRATIONS_PAGE = Path("docs/migrations.md")
#: The commands and the flags each takes, in the order ``reducing-saver --help`` lists them.
COMMANDS: dict[str, dict[str, str]] = {
    "serve": SERVE_FLAGS,
    "worker": WORKER_FLAGS,
    "extraction status|retry-dead": EXTRACTION_FLAGS,
    "sweep": SWEEP_FLAGS,
}


@dataclass(frozen=True)
class Setting:
    """What the documentation says about one field of the settings."""

    name: str
    group: str
    group_doc: str  # the first line of its group's docstring
    variable: str
    flag: str | None
    default: str  # as an environment variable would spell it; "" when unset
    description: str
    choices: tuple[str, ...]
    secret: bool
    boolean: bool  # its flag comes with a --no- twin


def _spelled(value: Any) -> str:
    """A default as it would be written in the environment."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(item) for item in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _groups(settings: type[BaseModel]) -> list[type[BaseModel]]:
    """The groups of fields in the order ``Settings`` joins them, then the class itself (its own fields)."""
    bases = [
        cls
        for cls in settings.__mro__[1:]
        if isinstance(cls, type)
        and issubclass(cls, BaseModel)
        and cls.__module__.startswith("reducing_saver.")
    ]
    return [*bases, settings]


def _group_title(cls: type[BaseModel], settings: type[BaseModel]) -> str:
    """``ServerSettings`` -> ``Server``; fields declared on ``Settings`` itself are ``Other``."""
    return "Other" if cls is settings else cls.__name__.removesuffix("Settings") or cls.__name__


def settings_of(settings: type[BaseModel] = Settings) -> list[Setting]:
    """Every field of ``settings``, grouped as the classes it joins declare them."""
    prefix = settings.model_config.get("env_prefix", "")
    flags = {field: flag for flag, field in SERVE_FLAGS.items()}
    found: list[Setting] = []
    seen: set[str] = set()
    for cls in _groups(settings):
        own = [name for name in vars(cls).get("__annotations__", {}) if name in settings.model_fields]
        for name in own:
            if name in seen:
                continue
            seen.add(name)
            info = settings.model_fields[name]
            annotation = info.annotation
            choices = tuple(str(c) for c in get_args(annotation)) if get_origin(annotation) is Literal else ()
            found.append(
                Setting(
                    name=name,
                    group=_group_title(cls, settings),
                    group_doc=(cls.__doc__ or "").strip().split("\n")[0] if cls is not settings else "",
                    variable=f"{prefix}{name.upper()}",
                    flag=flags.get(name),
                    default=_spelled(info.get_default(call_default_factory=True)),
                    description=" ".join((info.description or "").split()),
                    choices=choices,
                    secret=SecretStr in (annotation, *get_args(annotation)),
                    boolean=annotation is bool,
                )
            )
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else "unset"


def _flag_cell(setting: Setting) -> str:
    if setting.flag is None:
        return "—"
    if setting.boolean:
        return f"`{setting.flag}` / `--no-{setting.flag[2:]}`"
    return f"`{setting.flag}`"


def render_reference(settings: list[Setting]) -> str:
    """The generated part of docs/configuration.md."""
    out: list[str] = []
    groups: dict[str, list[Setting]] = {}
    for setting in settings:
        groups.setdefault(setting.group, []).append(setting)
    for group, members in groups.items():
        out += [f"### {group}", ""]
        if members[0].group_doc:
            out += [members[0].group_doc, ""]
        out += ["| setting | flag | environment variable | default | meaning |", "|---|---|---|---|---|"]
        for s in members:
            meaning = s.description + (
                f" One of: {', '.join(f'`{c}`' for c in s.choices)}." if s.choices else ""
            )
            cells = [f"`{s.name}`", _flag_cell(s), f"`{s.variable}`", _cell(_code(s.default)), _cell(meaning)]
            out.append(f"| {' | '.join(cells)} |")
        out.append("")
    out += ["### The flags of each command", "", "| command | flags |", "|---|---|"]
    for command, flags in COMMANDS.items():
        out.append(f"| {_cell(f'`reducing-saver {command}`')} | {', '.join(f'`{flag}`' for flag in flags)} |")
    out += [
        "",
        "### Settings without a flag",
        "",
        "| environment variables | why they have no flag |",
        "|---|---|",
    ]
    reasons: dict[str, list[str]] = {}
    for s in settings:
        if s.flag is None:
            reasons.setdefault(ENV_ONLY.get(s.name, "no reason given"), []).append(f"`{s.variable}`")
    for reason, variables in reasons.items():
        out.append(f"| {', '.join(variables)} | {_cell(reason)} |")
    return "\n".join(out) + "\n"


def _comment(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        width=100,
        initial_indent=f"{indent}# ",
        subsequent_indent=f"{indent}# ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def render_env_example(settings: list[Setting]) -> str:
    """The generated part of .env.example: every setting, commented out, at its default."""
    out: list[str] = []
    group = None
    for s in settings:
        if s.group != group:
            group = s.group
            out += ["", f"# -- {group} " + "-" * (96 - len(group))]
        flag = f" Flag: {s.flag}." if s.flag else ""
        choices = f" One of: {', '.join(s.choices)}." if s.choices else ""
        out += _comment(f"{s.description}{choices}{flag}")
        out.append(f"# {s.variable}={s.default}")
    return "\n".join(out).lstrip("\n") + "\n"


def _set_elsewhere(root: Path) -> set[str]:
    """The variables the other manifests of deploy/ set (the Secret, the Deployments' env)."""
    names: set[str] = set()
    for path in sorted((root / CONFIGMAP).parent.glob("*.yaml")):
        if path.name == CONFIGMAP.name:
            continue
        for line in path.read_text().splitlines():
            # A mapping key (a Secret's data) or an env entry's name; comments only mention.
            if match := re.match(r"\s*(?:- name:\s*)?(REDUCING_SAVER_[A-Z0-9_]+)\b", line):
                names.add(match[1])
    return names


def render_configmap(settings: list[Setting], hand_written: str, elsewhere: set[str]) -> str:
    """The generated part of deploy/configmap.yaml: every setting neither the ConfigMap above nor another
    manifest sets, commented out at its default; secrets are left to the Secret."""
    active = set(re.findall(r"^\s+(REDUCING_SAVER_[A-Z0-9_]+):", hand_written, flags=re.MULTILINE))
    out: list[str] = []
    for s in settings:
        if s.secret or s.variable in active or s.variable in elsewhere:
            continue
        out += _comment(s.description, indent="  ")
        out.append(f"  # {s.variable}: {json.dumps(s.default) if s.default else '(unset by default)'}")
    return "\n".join(out) + "\n"


def _migration(statement: str) -> str:
    """What a migration does, in a table cell: the table or index it creates, or its statement."""
    from reducing_saver.service.storage.migrations import summary

    text = " ".join(statement.split())
    if match := re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", text):
        return f"table `{match[1]}`"
    if match := re.match(
        r"CREATE (UNIQUE )?INDEX (CONCURRENTLY )?IF NOT EXISTS (\w+) ON (\w+) \(([^)]*)\)(.*)", text
    ):
        where = f" {match[6].strip()}" if match[6].strip() else ""
        return _cell(f"{(match[1] or '').lower()}index `{match[3]}` on `{match[4]}` ({match[5]}){where}")
    return _cell(f"`{summary(statement, 90)}`")


def render_migrations() -> str:
    """The generated part of docs/migrations.md: the latest version and every migration, per backend."""
    from reducing_saver.service.storage.postgres import migrations as postgres
    from reducing_saver.service.storage.sqlite import migrations as sqlite

    backends = {"PostgreSQL": postgres, "SQLite": sqlite}
    tables = dict.fromkeys(
        name
        for module in backends.values()
        for statement in module.MIGRATIONS
        for name in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", statement)
    )
    versions = " and ".join(f"version **{module.LATEST}** on {name}" for name, module in backends.items())
    intro = (
        f"The service's own tables are {', '.join(f'`{name}`' for name in tables)}. This release's schema "
        f"is {versions}; each version is one statement of the backend's `MIGRATIONS` list:"
    )
    out = [*textwrap.wrap(intro, width=105, break_long_words=False, break_on_hyphens=False), ""]
    for name, module in backends.items():
        out += [f"| {name} version | what it does |", "|---|---|"]
        out += [
            f"| {version} | {_migration(statement)} |" for version, statement in enumerate(module.MIGRATIONS)
        ]
        out.append("")
    return "\n".join(out)


# -- the files ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    path: Path
    begin: str
    end: str
    render: Callable[[list[Setting], str, Path], str]


TARGETS = (
    Target(
        REFERENCE,
        f"<!-- BEGIN generated by `{COMMAND}` from Settings: edit service/configuration/settings.py, not this -->",
        "<!-- END generated -->",
        lambda settings, before, root: render_reference(settings),
    ),
    Target(
        ENV_EXAMPLE,
        f"# BEGIN generated by `{COMMAND}` from Settings: edit service/configuration/settings.py, not this",
        "# END generated",
        lambda settings, before, root: render_env_example(settings),
    ),
    Target(
        CONFIGMAP,
        f"  # BEGIN generated by `{COMMAND}`: the other settings, at their defaults",
        "  # END generated",
        lambda settings, before, root: render_configmap(settings, before, _set_elsewhere(root)),
    ),
    Target(
        MIGRATIONS_PAGE,
        f"<!-- BEGIN generated by `{COMMAND}` from MIGRATIONS: edit service/storage/<backend>/migrations.py, "
        "not this -->",
        "<!-- END generated -->",
        lambda settings, before, root: render_migrations(),
    ),
)


def rendered(root: Path, settings: type[BaseModel] = Settings) -> dict[Path, str]:
    """Each target file's text with its generated part rendered anew (the file must hold both markers)."""
    fields = settings_of(settings)
    texts: dict[Path, str] = {}
    for target in TARGETS:
        text = (root / target.path).read_text()
        begin, end = text.find(target.begin), text.find(target.end)
        if begin < 0 or end < begin:
            raise ValueError(f"{target.path} lacks the lines {target.begin!r} and {target.end!r}")
        before = text[: begin + len(target.begin)]
        texts[target.path] = f"{before}\n{target.render(fields, before, root)}{text[end:]}"
    return texts


def stale(root: Path, settings: type[BaseModel] = Settings) -> list[Path]:
    """The target files whose generated part differs from its rendering."""
    return [path for path, text in rendered(root, settings).items() if (root / path).read_text() != text]


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository's root (default: here)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is stale")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.check:
        paths = stale(args.root)
        for path in paths:
            print(f"{path} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if paths else 0
    for path, text in rendered(args.root).items():
        if (args.root / path).read_text() != text:
            (args.root / path).write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
