"""reducing_saver.client: use a reducing-saver service as a LangGraph checkpointer.

    from reducing_saver.client import RemoteReducingSaver

    checkpointer = RemoteReducingSaver("http://reducing-saver:8000")   # instead of PostgresSaver
    graph = builder.compile(checkpointer=checkpointer)

This package needs only httpx, orjson and langgraph-checkpoint: it imports neither FastAPI nor a
database driver.
"""

from reducing_saver.client._client import RemoteReducer, RemoteReducingSaver, __version__
from reducing_saver.client._errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PayloadTooLargeError,
    ReducingSaverError,
    RequestTimeoutError,
    ServerUnavailableError,
)
from reducing_saver.wire.memory import decode_memory_value

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ReducingSaverError",
    "RemoteReducer",
    "RemoteReducingSaver",
    "RequestTimeoutError",
    "ServerUnavailableError",
    "__version__",
    "decode_memory_value",
]
