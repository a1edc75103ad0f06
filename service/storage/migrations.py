"""Versions of the service's own tables (``reducing_saver_*``): what every backend's migrations share.

Each database backend keeps its schema as a list, ``MIGRATIONS`` in ``postgres/migrations.py`` and
``sqlite/migrations.py``, the way langgraph's ``checkpoint-postgres`` does: the position of a statement
in the list is its version, and the table :data:`TABLE` records every version applied. Applying them
takes the backend's set-up lock and reads the recorded version again under it, so replicas starting
together apply each statement once. To change a table, append a statement to the end of the list;
never edit or remove one already released (databases have recorded it as applied).

The first statements are the ``CREATE TABLE IF NOT EXISTS`` of the first release, so a database it
created (tables, no version table) migrates like an empty one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from reducing_saver.service.storage import StorageError

#: The table recording the applied versions (one row ``v`` per statement of ``MIGRATIONS``).
TABLE = "reducing_saver_migrations"

#: What the version of a database without :data:`TABLE` reads as.
NO_VERSION = -1


class SchemaError(StorageError):
    """The service's tables in a database are not at the version this code uses: newer (written by a
    later reducing-saver) or, when the service may not migrate, older. One line, naming both versions."""


@dataclass(frozen=True)
class Applied:
    """A migration applied: its version and statement."""

    version: int
    statement: str

    def __str__(self) -> str:
        return f"applied migration {self.version}: {summary(self.statement)}"


def summary(statement: str, width: int = 100) -> str:
    """The statement on one line, cut at ``width`` characters."""
    text = " ".join(statement.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def latest(migrations: Sequence[str]) -> int:
    """The version a database has once every statement of ``migrations`` is applied."""
    return len(migrations) - 1


def refuse_newer(found: int, known: int, where: str) -> None:
    """Raise :class:`SchemaError` if a database records a version this code does not know.

    Such a database was migrated by a later reducing-saver; this one would misread its tables.
    """
    if found > known:
        raise SchemaError(
            f"the database {where} has reducing-saver schema version {found}, newer than this "
            f"reducing-saver knows (version {known}): upgrade reducing-saver"
        )


#: Why a database that is behind is refused rather than migrated, by default.
NO_MIGRATE = "the service was started with --no-migrate"


def check_version(found: int, known: int, where: str, why: str = NO_MIGRATE) -> None:
    """Raise :class:`SchemaError` unless the database is exactly at version ``known`` (``--no-migrate``,
    and commands that change no table).

    Args:
        why: Why this process does not migrate, said after the advice to run ``reducing-saver migrate``.

    Raises:
        SchemaError: Newer (upgrade reducing-saver) or older (run ``reducing-saver migrate``).
    """
    refuse_newer(found, known, where)
    if found < known:
        shown = "none" if found == NO_VERSION else str(found)
        raise SchemaError(
            f"the database {where} has reducing-saver schema version {shown}, this reducing-saver needs "
            f"version {known}: run `reducing-saver migrate` ({why})"
        )


def langgraph_changes(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """One line per langgraph version table whose version changed (its own migrations, which the
    checkpointer's and store's ``setup()`` apply)."""
    return [
        f"applied langgraph's {table} versions {before[table] + 1} to {after[table]}"
        for table in after
        if after[table] > before.get(table, NO_VERSION)
    ]


def summarized(applied: list[str], where: str) -> str:
    """What :meth:`migrate` applied (its lines, as :class:`Applied` and :func:`langgraph_changes` write
    them), in one line for a service's start-up log."""
    own = [int(match[1]) for line in applied if (match := re.match(r"applied migration (\d+):", line))]
    parts = []
    if own:
        before = "none" if own[0] == 0 else f"version {own[0] - 1}"
        parts.append(f"reducing-saver schema from {before} to version {own[-1]} ({len(own)} migrations)")
    parts += [line.removeprefix("applied ") for line in applied if line.startswith("applied langgraph's ")]
    if not parts:
        return f"the schema of {where} is current"
    return f"migrated {where}: " + "; ".join(parts)


def check_langgraph(found: dict[str, int], known: dict[str, int], where: str, why: str = NO_MIGRATE) -> None:
    """Raise :class:`SchemaError` if one of langgraph's version tables is behind what its code applies
    (``--no-migrate``; a newer one is langgraph's to judge)."""
    for table, version in known.items():
        if found.get(table, NO_VERSION) < version:
            shown = "none" if found.get(table, NO_VERSION) == NO_VERSION else found[table]
            raise SchemaError(
                f"the database {where} has langgraph's {table} at version {shown}, this reducing-saver "
                f"needs version {version}: run `reducing-saver migrate` ({why})"
            )
