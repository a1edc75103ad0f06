"""Optional saver capabilities, and classes that carry exactly a given set of them.

LangGraph and the conformance suite detect an optional capability by whether ``type(saver)``
overrides the method of ``BaseCheckpointSaver``. A wrapper that defined every optional method would
claim capabilities its backend lacks, so wrappers build one subclass per capability set instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from langgraph.checkpoint.base import BaseCheckpointSaver

#: Optional capability -> (sync method, async method).
OPTIONAL_CAPABILITIES: dict[str, tuple[str, str]] = {
    "copy_thread": ("copy_thread", "acopy_thread"),
    "delete_for_runs": ("delete_for_runs", "adelete_for_runs"),
    "prune": ("prune", "aprune"),
    "delta_channel_history": ("get_delta_channel_history", "aget_delta_channel_history"),
}

T = TypeVar("T")

_VARIANTS: dict[tuple[type, frozenset[str]], type] = {}


def saver_capabilities(saver: BaseCheckpointSaver[Any] | type[BaseCheckpointSaver[Any]]) -> frozenset[str]:
    """The optional capabilities a saver implements: those whose sync or async method it overrides."""
    saver_type = saver if isinstance(saver, type) else type(saver)
    return frozenset(
        name
        for name, methods in OPTIONAL_CAPABILITIES.items()
        if any(getattr(saver_type, m) is not getattr(BaseCheckpointSaver, m) for m in methods)
    )


def with_capabilities(base: type[T], capabilities: frozenset[str], mixins: Mapping[str, type]) -> type[T]:
    """The subclass of ``base`` that adds ``mixins[name]`` for each capability (cached per set).

    The subclass keeps ``base``'s name and module, and a ``capabilities`` attribute naming the set.
    """
    unknown = capabilities - OPTIONAL_CAPABILITIES.keys()
    if unknown:
        raise ValueError(f"unknown capabilities {sorted(unknown)}")
    key = (base, capabilities)
    if key not in _VARIANTS:
        chosen = tuple(mixins[name] for name in OPTIONAL_CAPABILITIES if name in capabilities)
        namespace = {
            "capabilities": capabilities,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        }
        _VARIANTS[key] = type(base.__name__, (*chosen, base), namespace) if chosen else base
    return _VARIANTS[key]
