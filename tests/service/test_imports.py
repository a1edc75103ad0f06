"""One way to resolve every ``module:attribute`` setting (``service/imports.py``): the working folder
is importable, and each setting that names nothing usable says which way it failed.

Every case runs against every setting that can meet it: ``--extractor`` and ``--on-prune`` (callables),
``--summarizer`` (a chat model or callable, or ``provider:model``) and ``--store-index``'s ``embed`` (an
embeddings model or callable, or ``provider:model``).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reducing_saver.service import imports
from reducing_saver.service.configuration.store import StoreConfigError, _embedder
from reducing_saver.service.imports import ResolveError, import_callable
from reducing_saver.service.summaries.summarizer import (
    CallableSummarizer,
    ModelSummarizer,
    SummarizerError,
    load_summarizer,
)

USER_MODULE = """
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.language_models.fake_chat_models import FakeListChatModel


def summarize(previous, messages):
    return "summary"


def extract(messages, namespace, store):
    pass


chat_model = FakeListChatModel(responses=["a summary"])
embeddings = DeterministicFakeEmbedding(size=4)
NOT_CALLABLE = 3
"""


def _summarizer(spec: str) -> object:
    return load_summarizer(spec, max_input_tokens=1000, max_tokens=100)


def _callable(setting: str) -> Callable[[str], object]:
    return lambda spec: import_callable(spec, setting)


#: setting -> (resolve the spec, the error it raises, the line's prefix, what "not usable" reads).
SETTINGS: dict[str, tuple[Callable[[str], object], type[Exception], str, str]] = {
    "extractor": (_callable("--extractor"), ResolveError, "--extractor", "not a callable"),
    "on_prune": (_callable("--on-prune"), ResolveError, "--on-prune", "not a callable"),
    "summarizer": (_summarizer, SummarizerError, "--summarizer", "not a chat model or callable"),
    "embed": (_embedder, StoreConfigError, "--store-index embed", "not an embeddings model or callable"),
}
USABLE = {"extractor": "extract", "on_prune": "extract", "summarizer": "summarize", "embed": "embeddings"}


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of the user's in the working folder (a fresh name each test), and the import path as it
    was afterwards."""
    name = f"user_module_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    (tmp_path / f"{name}_broken.py").write_text("import no_such_package_anywhere_at_all\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    for module in (name, f"{name}_broken"):
        sys.modules.pop(module, None)


def _refused(setting: str, spec: str) -> str:
    resolve, error, _, _ = SETTINGS[setting]
    with pytest.raises(error) as raised:
        resolve(spec)
    return str(raised.value)


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_module_of_the_working_folder_is_found(setting: str, user_module: str, tmp_path: Path) -> None:
    resolve = SETTINGS[setting][0]
    assert resolve(f"{user_module}:{USABLE[setting]}") is not None
    assert sys.path[0] == str(tmp_path)  # first, as uvicorn's --app-dir puts it


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_missing_module_is_module_not_found(setting: str, user_module: str, tmp_path: Path) -> None:
    prefix = SETTINGS[setting][2]
    message = _refused(setting, f"{user_module}_typo:{USABLE[setting]}")
    assert message.startswith(f"{prefix} '{user_module}_typo:{USABLE[setting]}': module not found: ")
    assert f"in the working folder ({tmp_path})" in message
    dotted = _refused(setting, "no_such.package_here:fn")
    assert f"{prefix} 'no_such.package_here:fn': module not found: no module named 'no_such'" in dotted


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_missing_attribute_is_attribute_not_found(setting: str, user_module: str, tmp_path: Path) -> None:
    message = _refused(setting, f"{user_module}:missing")
    assert f"'{user_module}:missing': attribute not found: module '{user_module}' ({tmp_path}" in message
    assert "has no attribute 'missing'" in message


@pytest.mark.parametrize("setting", SETTINGS)
def test_something_else_is_not_usable(setting: str, user_module: str) -> None:
    not_usable = SETTINGS[setting][3]
    assert f"'{user_module}:NOT_CALLABLE': {not_usable}: got an int" in _refused(
        setting, f"{user_module}:NOT_CALLABLE"
    )


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_module_that_raises_on_import_is_named_with_its_error(setting: str, user_module: str) -> None:
    message = _refused(setting, f"{user_module}_broken:fn")
    assert (
        f"'{user_module}_broken:fn': module failed to import: importing '{user_module}_broken' raised "
        in message
    )
    assert "No module named 'no_such_package_anywhere_at_all'" in message


@pytest.mark.parametrize("setting", ["summarizer", "embed"])
def test_a_provider_whose_package_is_missing_is_provider_package_missing(setting: str) -> None:
    # langchain knows groq and mistralai; their integration packages are not installed here.
    spec = "groq:llama-3.1-8b-instant" if setting == "summarizer" else "mistralai:mistral-embed"
    message = _refused(setting, spec)
    assert f"'{spec}': provider package missing: " in message
    assert "langchain-groq" in message if setting == "summarizer" else "langchain-mistralai" in message


@pytest.mark.parametrize("setting", ["summarizer", "embed"])
def test_without_langchain_a_model_name_is_provider_package_missing(setting: str, monkeypatch) -> None:
    monkeypatch.setattr(imports, "_langchain_providers", lambda kind: (False, None))
    assert "'openai:gpt-4o-mini': provider package missing: provider:model needs the langchain package" in (
        _refused(setting, "openai:gpt-4o-mini")
    )
    # A spec that reads as either is a missing module, with what the other reading would need.
    message = _refused(setting, "nothing_by_this_name:llama3")
    assert (
        "module not found" in message and "as provider:model it would need the langchain package" in message
    )


def test_a_summarizer_takes_a_chat_model_a_callable_or_a_provider(user_module: str, monkeypatch) -> None:
    assert isinstance(_summarizer(f"{user_module}:chat_model"), ModelSummarizer)
    assert isinstance(_summarizer(f"{user_module}:summarize"), CallableSummarizer)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-used")  # building the client needs no network
    assert isinstance(_summarizer("openai:gpt-4o-mini"), ModelSummarizer)


def test_a_provider_that_fails_is_named_with_langchains_reason(monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    message = _refused("summarizer", "openai:gpt-4o-mini")
    assert message.startswith("--summarizer 'openai:gpt-4o-mini': provider model failed to initialize: ")
    assert "\n" not in message


def test_a_spec_without_a_colon_says_what_form_it_takes() -> None:
    assert "not module:attribute: expected module:attribute" in _refused("extractor", "no_colon")
    assert "expected provider:model or module:attribute" in _refused("summarizer", "no_colon")
