"""The command line's own text, in process: the start-up lines and ``serve --help``.

tests/e2e/test_cli.py runs the real command.
"""

from __future__ import annotations

from reducing_saver.service.cli import startup_line
from reducing_saver.service.configuration.settings import Settings
from reducing_saver.service.storage.migrations import Applied, langgraph_changes, summarized


def _settings(**values: object) -> Settings:
    return Settings(_env_file=None, **values)


def test_the_startup_line_says_what_runs() -> None:
    line = startup_line(_settings(database="postgresql://app:secret@db:5432/agents"))
    assert line.startswith("reducing-saver ")
    assert (
        "backend postgres (postgresql://app:***@db:5432/agents), window 20 messages, encryption off, "
        "summarizer off, keep-checkpoints off (every checkpoint kept)"
    ) in line
    assert "secret" not in line
    line = startup_line(
        _settings(
            database="memory://",
            max_messages=30,
            min_messages=20,
            max_tokens=8000,
            target_tokens=6000,
            keep_checkpoints=10,
            summarizer="tests.support.summarizers:facts",
        )
    )
    assert (
        "window 30 messages, cut to 20 or 8000 tokens, cut to 6000, encryption off, "
        "summarizer tests.support.summarizers:facts, keep-checkpoints 10"
    ) in line


def test_the_migrations_of_a_start_are_one_line() -> None:
    applied = [str(Applied(v, f"CREATE TABLE t{v} (x int)")) for v in range(12)]
    applied += langgraph_changes({"store_migrations": -1}, {"store_migrations": 4})
    assert summarized(applied, "sqlite:///a.sqlite") == (
        "migrated sqlite:///a.sqlite: reducing-saver schema from none to version 11 (12 migrations); "
        "langgraph's store_migrations versions 0 to 4"
    )
    later = [str(Applied(v, "CREATE INDEX i ON t (x)")) for v in (12, 13)]
    assert (
        summarized(later, "db")
        == "migrated db: reducing-saver schema from version 11 to version 13 (2 migrations)"
    )
    assert summarized([], "db") == "the schema of db is current"


def test_serve_help_is_grouped_as_the_settings_are() -> None:
    from reducing_saver.service.cli import HELP_GROUPS, build_parser, settings_group
    from reducing_saver.service.configuration.flags import SERVE_FLAGS

    # Every group of settings has a heading (a new group must get one).
    declaring = {settings_group(field).__name__ for field in Settings.model_fields}
    assert declaring <= set(HELP_GROUPS), declaring - set(HELP_GROUPS)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    assert text.startswith("usage: reducing-saver serve [OPTIONS]\n")
    headings = [title for title, description in HELP_GROUPS.values()]
    for group in serve._action_groups[2:]:  # after argparse's own positionals and options
        assert group.title.split(" (")[0] in headings
        for action in group._group_actions:
            field = SERVE_FLAGS[action.option_strings[0]]
            assert group.title.startswith(HELP_GROUPS[settings_group(field).__name__][0]), (
                action.option_strings
            )
    grouped = {
        option
        for group in serve._action_groups[2:]
        for a in group._group_actions
        for option in a.option_strings
    }
    assert set(SERVE_FLAGS) <= grouped
    assert "server (the database, the address, processes and logs):\n  --database URL" in text
