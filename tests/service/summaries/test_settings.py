"""The summary settings: defaults, parsing, the hard limit against the window."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from reducing_saver.service.cli import build_parser, load_settings
from reducing_saver.service.configuration.settings import Settings


def test_off_by_default_and_the_hard_limit_defaults_to_twice_the_window(monkeypatch):
    for name in ("REDUCING_SAVER_SUMMARIZER", "REDUCING_SAVER_SUMMARY_HARD_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(_env_file=None, max_messages=20, min_messages=12)
    assert settings.summarizer is None
    hard = settings.summary_hard_reducer()
    assert (hard.max_messages, hard.count_target) == (40, 12)
    tokens = Settings(
        _env_file=None, max_messages=None, max_tokens=1000, target_tokens=600
    ).summary_hard_reducer()
    assert (tokens.max_messages, tokens.max_tokens, tokens.token_target) == (None, 2000, 600)


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("REDUCING_SAVER_SUMMARIZE_TENANTS", "acme, globex")
    args = build_parser().parse_args(
        [
            "serve",
            "--summarizer",
            "openai:gpt-4o-mini",
            "--summary-max-tokens",
            "300",
            "--summary-hard-limit",
            "50",
        ]
    )
    settings = load_settings(args)
    assert settings.summarizer == "openai:gpt-4o-mini" and settings.summary_max_tokens == 300
    assert settings.summary_hard_limit == 50 and settings.summarize_tenants == ["acme", "globex"]
    worker = load_settings(
        build_parser().parse_args(["worker", "--summarizer", "m:f", "--summary-concurrency", "4"])
    )
    assert worker.summarizer == "m:f" and worker.summary_concurrency == 4


def test_a_hard_limit_at_or_below_the_window_is_refused():
    with pytest.raises(ValidationError, match="summary_hard_limit .20. must be above max_messages .20."):
        Settings(_env_file=None, max_messages=20, summary_hard_limit=20)
    with pytest.raises(ValidationError, match="not provider:model or module:attribute"):
        Settings(_env_file=None, summarizer="gpt-4o")
