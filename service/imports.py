"""Code an operator names in a setting, resolved one way for every such setting.

``--extractor`` and ``--on-prune`` name a callable as ``module:attribute``; ``--summarizer`` and the
``embed`` of ``--store-index`` take ``module:attribute`` or LangChain's ``provider:model``. For all of them:

* the working folder is importable, first on the import path, as uvicorn's ``--app-dir`` (default
  ``.``) makes an app's folder: ``--summarizer my_module:summarize`` started beside ``my_module.py``
  finds it;
* a dotted module part (``pkg.mod:fn``) is always an import path; a bare one is ``provider:model`` when
  no such module holds that attribute and LangChain knows the provider;
* a setting that names nothing usable raises :class:`ResolveError`, one line naming the setting, the
  spec and which of :data:`MODULE_NOT_FOUND`, :data:`MODULE_FAILED`, :data:`ATTRIBUTE_NOT_FOUND`,
  "not a ..." (what the setting needs), :data:`PROVIDER_MISSING` or :data:`PROVIDER_FAILED` it is.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

MODULE_NOT_FOUND = "module not found"
MODULE_FAILED = "module failed to import"
ATTRIBUTE_NOT_FOUND = "attribute not found"
PROVIDER_MISSING = "provider package missing"
PROVIDER_FAILED = "provider model failed to initialize"
MALFORMED = "not module:attribute"

#: ``attribute[.attribute...]``: what a spec's right side must be to name an attribute (a model name such
#: as ``gpt-4o-mini`` cannot).
_ATTRIBUTE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_MISSING = object()


class ResolveError(ValueError):
    """A setting names nothing usable.

    Attributes:
        setting: The flag (``--summarizer``, ``--store-index embed``, ...).
        spec: What it was given.
        kind: Which way it failed (:data:`MODULE_NOT_FOUND`, ...).
        detail: The rest of the line.
    """

    def __init__(self, setting: str, spec: str, kind: str, detail: str) -> None:
        self.setting, self.spec, self.kind, self.detail = setting, spec, kind, detail
        super().__init__(f"{setting} {spec!r}: {kind}: {detail}")


def working_folder_importable() -> str:
    """Put the working folder first on the import path (once); return it."""
    folder = os.getcwd()
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return folder


def _split(spec: str, setting: str, expected: str) -> tuple[str, str]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ResolveError(setting, spec, MALFORMED, f"expected {expected}")
    return module_name, attribute


def _import_module(name: str, setting: str, spec: str) -> ModuleType:
    folder = working_folder_importable()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise ResolveError(
                setting,
                spec,
                MODULE_NOT_FOUND,
                f"no module named {exc.name!r} in the working folder ({folder}) or the installed packages",
            ) from None
        raise ResolveError(setting, spec, MODULE_FAILED, _raised(f"importing {name!r}", exc)) from None
    except Exception as exc:  # noqa: BLE001 - the module's own error, reported on the setting's line
        raise ResolveError(setting, spec, MODULE_FAILED, _raised(f"importing {name!r}", exc)) from None


def _raised(what: str, exc: BaseException) -> str:
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{what} raised {type(exc).__name__}" + (f": {text}" if text else "")


def _attribute(module: ModuleType, path: str) -> Any:
    target: Any = module
    for part in path.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            break
    return target


def _no_attribute(module: ModuleType, path: str) -> str:
    where = getattr(module, "__file__", None)
    return f"module {module.__name__!r}{f' ({where})' if where else ''} has no attribute {path!r}"


def import_attribute(spec: str, setting: str) -> Any:
    """What ``module:attribute[.attribute...]`` names.

    Raises:
        ResolveError: Malformed, module not found or failed to import, attribute not found.
    """
    module_name, attribute = _split(spec, setting, "module:attribute")
    module = _import_module(module_name, setting, spec)
    target = _attribute(module, attribute)
    if target is _MISSING:
        raise ResolveError(setting, spec, ATTRIBUTE_NOT_FOUND, _no_attribute(module, attribute))
    return target


def import_callable(spec: str, setting: str) -> Callable[..., Any]:
    """What ``module:attribute`` names, which must be callable.

    Raises:
        ResolveError: As :func:`import_attribute`, or "not a callable".
    """
    target = import_attribute(spec, setting)
    if not callable(target):
        raise ResolveError(setting, spec, "not a callable", f"got {kind_of(target)}")
    return target


def kind_of(value: object) -> str:
    """``an int``, ``a str``: what a setting named, for messages."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _langchain_providers(kind: str) -> tuple[bool, frozenset[str] | None]:
    """(whether langchain is installed, the providers its ``init_*`` takes as ``provider:model``, or
    ``None`` when its registry cannot be read: then any provider is tried)."""
    try:
        registry = importlib.import_module(f"langchain.{kind}.base")
    except ImportError:
        return False, None
    known = getattr(registry, "_BUILTIN_PROVIDERS", None)
    return True, frozenset(known) if isinstance(known, dict) else None


def import_or_provider(
    spec: str, setting: str, *, providers: str, init: Callable[[str], Any]
) -> tuple[Any, bool]:
    """What ``module:attribute`` names, else the model ``init(spec)`` makes of ``provider:model``.

    Args:
        spec: The setting's value.
        setting: The flag, for messages.
        providers: ``"chat_models"`` or ``"embeddings"``: whose LangChain providers ``provider`` may be.
        init: Makes the model (``init_chat_model``, ``init_embeddings``), importing langchain itself.

    Returns:
        ``(target, True)`` for a provider's model, ``(target, False)`` for what a module holds (its type is
        the caller's to check).

    Raises:
        ResolveError: Naming what is missing.
    """
    module_name, attribute = _split(spec, setting, "provider:model or module:attribute")
    if "." in module_name:
        return import_attribute(spec, setting), False
    module: ModuleType | None = None
    not_found: ResolveError | None = None
    try:
        module = _import_module(module_name, setting, spec)
    except ResolveError as exc:
        if exc.kind != MODULE_NOT_FOUND:
            raise
        not_found = exc
    if module is not None and (target := _attribute(module, attribute)) is not _MISSING:
        return target, False
    installed, known = _langchain_providers(providers)
    if installed and (known is None or module_name in known):
        try:
            return init(spec), True
        except ImportError as exc:
            raise ResolveError(setting, spec, PROVIDER_MISSING, _raised("LangChain", exc)) from None
        except Exception as exc:  # noqa: BLE001 - any provider failure is a start-up refusal naming it
            raise ResolveError(setting, spec, PROVIDER_FAILED, _raised("LangChain", exc)) from None
    if not installed and not _ATTRIBUTE_PATH.fullmatch(attribute):
        raise ResolveError(
            setting,
            spec,
            PROVIDER_MISSING,
            "provider:model needs the langchain package and the provider's (e.g. langchain-openai) "
            "installed with the service",
        )
    if installed:
        hint = f"; nor is {module_name!r} a provider LangChain takes as provider:model"
    else:
        hint = "; as provider:model it would need the langchain package and the provider's installed"
    if not_found is not None:
        raise ResolveError(setting, spec, MODULE_NOT_FOUND, not_found.detail + hint)
    assert module is not None
    raise ResolveError(setting, spec, ATTRIBUTE_NOT_FOUND, _no_attribute(module, attribute) + hint)
