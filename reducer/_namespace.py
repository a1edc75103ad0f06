"""The memory namespace of a run: the one rule every part of reducing-saver uses.

A run names its long-term memory namespace in ``config["configurable"][namespace_key]`` (a list or tuple
of strings, or one string). Without one, its namespace is ``("memories", thread_id)`` with the thread id
escaped (``%`` -> ``%25``, ``.`` -> ``%2E``), because LangGraph stores refuse ``.`` in namespace labels:
thread ``user.42`` remembers under ``("memories", "user%2E42")``. The in-process reducer's hooks, the
service's outbox, its TTL sweeper and its tenant scoping all call :func:`namespace_for`, so a hook and
the store always see the same namespace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_NAMESPACE_KEY = "memory_namespace"
#: The first label of a thread's namespace when its runs name none.
FALLBACK_LABEL = "memories"


def escape_label(label: str) -> str:
    """A thread id as a store namespace label: ``%`` -> ``%25``, ``.`` -> ``%2E`` (stores refuse dots)."""
    return label.replace("%", "%25").replace(".", "%2E")


def thread_namespace(thread_id: str) -> tuple[str, ...]:
    """The namespace of a thread whose runs name none: ``("memories", escaped thread id)``."""
    return (FALLBACK_LABEL, escape_label(str(thread_id)))


def namespace_for(config: Mapping[str, Any], namespace_key: str = DEFAULT_NAMESPACE_KEY) -> tuple[str, ...]:
    """The memory namespace of the run ``config`` describes.

    ``config["configurable"][namespace_key]`` when present (labels as given; check them with
    :func:`validate_namespace` before storing), else :func:`thread_namespace` of its thread id.
    """
    configurable = config.get("configurable") or {}
    namespace = configurable.get(namespace_key)
    if namespace is None:
        return thread_namespace(str(configurable.get("thread_id", "")))
    if isinstance(namespace, str):
        return (namespace,)
    return tuple(str(label) for label in namespace)


def validate_namespace(namespace: Sequence[str]) -> None:
    """Refuse a memory namespace a LangGraph store would refuse, before anything is stored.

    The rules are those of ``BaseStore.put`` (PostgresStore joins labels with ``.``): at least one label;
    each a non-empty string without ``.`` or NUL; the first label not ``"langgraph"``.

    Raises:
        ValueError: Naming the offending label, e.g. for a 422 at put time.
    """
    labels = tuple(namespace)
    if not labels:
        raise ValueError("memory namespace is empty; it needs at least one label")
    for index, label in enumerate(labels):
        if not isinstance(label, str):
            raise ValueError(
                f"memory namespace {list(labels)!r}: label {index} ({label!r}) is a "
                f"{type(label).__name__}, not a string"
            )
        if not label:
            raise ValueError(f"memory namespace {list(labels)!r}: label {index} is an empty string")
        if "." in label:
            raise ValueError(
                f"memory namespace {list(labels)!r}: label {label!r} contains '.', which LangGraph stores "
                "refuse in namespace labels (a thread id used as a label must not contain dots either)"
            )
        if "\x00" in label:
            raise ValueError(f"memory namespace {list(labels)!r}: label {index} contains a NUL character")
    if labels[0] == "langgraph":
        raise ValueError(f"memory namespace {list(labels)!r}: the first label cannot be 'langgraph'")
