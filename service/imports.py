"""Operator-named callables (``module:callable``): extractors and on_prune hooks."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


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
