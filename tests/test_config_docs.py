"""One source for each setting: the reference, .env.example and the ConfigMap are rendered from Settings.

``python -m reducing_saver.service.configuration.docs`` rewrites them; these tests fail while a committed file
differs from its rendering, or while a setting has neither a flag nor a reason for having none.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from pydantic import Field

from reducing_saver.service.cli import build_parser
from reducing_saver.service.configuration import docs as config_docs
from reducing_saver.service.configuration.flags import ENV_ONLY, SERVE_FLAGS
from reducing_saver.service.configuration.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_files_are_the_rendering_of_the_settings():
    assert config_docs.stale(ROOT) == [], f"stale: run `{config_docs.COMMAND}` in the repository's root"


def test_every_setting_has_a_flag_or_a_reason_for_having_none():
    fields = set(Settings.model_fields)
    flagged = set(SERVE_FLAGS.values())
    assert fields - flagged - set(ENV_ONLY) == set(), (
        "give these a flag in flags.SERVE_FLAGS, or a reason in flags.ENV_ONLY"
    )
    assert flagged & set(ENV_ONLY) == set(), "a setting with a flag is not environment-only"
    assert set(ENV_ONLY) <= fields, (
        f"flags.ENV_ONLY names what is no setting: {sorted(set(ENV_ONLY) - fields)}"
    )
    assert all(reason.strip() for reason in ENV_ONLY.values())
    # And every flag is one `serve` really takes.
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = {option for action in serve._actions for option in action.option_strings}
    assert set(SERVE_FLAGS) <= options


def test_the_reference_lists_every_setting_with_its_flag_variable_and_default():
    reference = (ROOT / config_docs.REFERENCE).read_text()
    for setting in config_docs.settings_of():
        row = next(
            (line for line in reference.splitlines() if line.startswith(f"| `{setting.name}` |")), None
        )
        assert row is not None, f"{setting.name} is not in the reference"
        assert f"`{setting.variable}`" in row
        assert (f"`{setting.flag}`" in row) if setting.flag else ("| — |" in row)
    assert "| `max_messages` | `--max-messages` | `REDUCING_SAVER_MAX_MESSAGES` | `20` |" in reference


def test_the_configmap_comments_every_other_non_secret_setting(monkeypatch):
    text = (ROOT / config_docs.CONFIGMAP).read_text()
    data = yaml.safe_load(text)["data"]
    elsewhere = config_docs._set_elsewhere(ROOT)
    for setting in config_docs.settings_of():
        commented = f"  # {setting.variable}:" in text
        if setting.variable in elsewhere - {"REDUCING_SAVER_DATABASE", "REDUCING_SAVER_API_KEYS_FILE"}:
            # Set by a Deployment's own env (REDUCING_SAVER_ENCRYPTION beside its Secret's key ring).
            assert not commented and setting.variable not in data, f"{setting.variable}: set by a Deployment"
        elif setting.secret or setting.variable == "REDUCING_SAVER_DATABASE":
            assert not commented and setting.variable not in data, f"{setting.variable} belongs to a Secret"
        elif setting.variable == "REDUCING_SAVER_API_KEYS_FILE":
            assert not commented, "the Deployment sets the keys file"
        else:
            assert commented != (setting.variable in data), f"{setting.variable}: set, or commented, once"


class _WithANewSetting(Settings):
    frobnicate_seconds: float = Field(3.0, description="How long to frobnicate.")


def test_a_new_migration_reaches_the_migrations_page(monkeypatch):
    from reducing_saver.service.storage.sqlite import migrations as sqlite

    monkeypatch.setattr(
        sqlite, "MIGRATIONS", [*sqlite.MIGRATIONS, "ALTER TABLE reducing_saver_outbox ADD COLUMN note TEXT"]
    )
    monkeypatch.setattr(sqlite, "LATEST", sqlite.LATEST + 1)
    page = config_docs.rendered(ROOT)[config_docs.MIGRATIONS_PAGE]
    assert f"version **{sqlite.LATEST}** on SQLite" in " ".join(page.split())
    assert f"| {sqlite.LATEST} | `ALTER TABLE reducing_saver_outbox ADD COLUMN note TEXT` |" in page
    assert config_docs.stale(ROOT) == [config_docs.MIGRATIONS_PAGE]


def test_a_new_setting_reaches_every_file():
    texts = config_docs.rendered(ROOT, _WithANewSetting)
    settings_files = {config_docs.REFERENCE, config_docs.ENV_EXAMPLE, config_docs.CONFIGMAP}
    assert set(texts) == settings_files | {config_docs.MIGRATIONS_PAGE}
    for path in settings_files:
        text = texts[path]
        assert "REDUCING_SAVER_FROBNICATE_SECONDS" in text, path
        assert "How long to frobnicate." in text, path
    assert "# REDUCING_SAVER_FROBNICATE_SECONDS=3.0" in texts[config_docs.ENV_EXAMPLE]
    # Without a flag it is listed as environment-only, reason missing (the flag test then fails).
    assert "| `REDUCING_SAVER_FROBNICATE_SECONDS` | no reason given |" in texts[config_docs.REFERENCE]
    assert sorted(config_docs.stale(ROOT, _WithANewSetting)) == sorted(settings_files)


def test_the_command_checks_and_rewrites(tmp_path, capsys):
    for target in config_docs.TARGETS:
        (tmp_path / target.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / target.path, tmp_path / target.path)
    for manifest in (ROOT / "deploy").glob("*.yaml"):
        shutil.copy(manifest, tmp_path / "deploy" / manifest.name)
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 0

    env = tmp_path / config_docs.ENV_EXAMPLE
    env.write_text(env.read_text().replace("# REDUCING_SAVER_PORT=8080\n", ""))
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert ".env.example is stale" in capsys.readouterr().err
    assert config_docs.main(["--root", str(tmp_path)]) == 0
    assert env.read_text() == (ROOT / config_docs.ENV_EXAMPLE).read_text()
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 0
