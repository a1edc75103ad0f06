"""reducing_saver.service: the HTTP service that hosts the reducer over a LangGraph checkpointer.

The web application is ``reducing_saver.service.http.app.create_app``; the command line is
``reducing_saver.service.cli``. The reducer core moved to :mod:`reducing_saver.reducer`; its names are
still importable from here for this release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = frozenset(
    {"MessageReducer", "ReduceResult", "ReducerConfig", "ReducingSaver", "apply_reducer", "memory_namespace"}
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"reducing_saver.service.{name} moved to reducing_saver.reducer.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        import reducing_saver.reducer

        return getattr(reducing_saver.reducer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
