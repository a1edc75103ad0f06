"""Operator-named callables (``module:callable``): extractors and on_prune hooks; and the
``module:attribute`` or ``provider:model`` specs of the summarizer and the store's embeddings."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_attribute_or_provider(spec: str) -> Any | None:
    """What ``module:attribute[.attribute…]`` names, or ``None`` when ``spec`` is ``provider:model``.

    A dotted module part (``pkg.mod:fn``) is always an import path; a bare one (``openai:...``) is a
    provider unless such a module exists and holds that attribute.

    Raises:
        ValueError: If a dotted module part cannot be imported, or does not hold the attribute.
    """
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        if "." in module_name:
            raise ValueError(f"cannot be imported: {exc}") from None
        return None
    return target


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """Import ``module:attribute[.attribute…]`` and check it is callable.

    Raises:
        ValueError: Naming ``what`` and ``path``, if the path is malformed, cannot be imported, or names
            something that is not callable.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} {path!r} is not a module:callable import path")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be imported: {exc}") from None
    if not callable(target):
        raise ValueError(f"{what} {path!r} is a {type(target).__name__}, not a callable")
    return target
