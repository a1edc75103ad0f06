"""reducing_saver.service: the reducer core and the HTTP service that hosts it.

The reducer names below import neither FastAPI nor a database driver; the web application lives in
``reducing_saver.service.app``.
"""

from reducing_saver.service.reducer import MessageReducer, ReducerConfig, ReduceResult
from reducing_saver.service.saver import ReducingSaver, apply_reducer, memory_namespace

__all__ = [
    "MessageReducer",
    "ReduceResult",
    "ReducerConfig",
    "ReducingSaver",
    "apply_reducer",
    "memory_namespace",
]
