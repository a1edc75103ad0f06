"""reducing_saver.client: use a reducing-saver service as a LangGraph checkpointer and store.

    from reducing_saver.client import RemoteReducingSaver, RemoteStore

    checkpointer = RemoteReducingSaver("http://reducing-saver:8000")   # instead of PostgresSaver
    store = RemoteStore("http://reducing-saver:8000")                  # instead of PostgresStore
    graph = builder.compile(checkpointer=checkpointer, store=store)

This package needs only httpx, orjson and langgraph-checkpoint: it imports neither FastAPI nor a
database driver.
"""

from reducing_saver.client._errors import (
    AuthenticationError,
    BadRequestError,
    CheckpointPrunedError,
    ConflictError,
    ConnectionSetupError,
    DatabaseTimeoutError,
    NotFoundError,
    PayloadTooLargeError,
    ReducingSaverError,
    RequestTimeoutError,
    ServerUnavailableError,
)
from reducing_saver.client._saver import RemoteReducingSaver
from reducing_saver.client._serde import SafeJsonPlusSerializer
from reducing_saver.client._server_info import RemoteReducer
from reducing_saver.client._store import RemoteStore
from reducing_saver.wire.nul import decode_memory_value
from reducing_saver.wire.version import __version__

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "CheckpointPrunedError",
    "ConflictError",
    "ConnectionSetupError",
    "DatabaseTimeoutError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ReducingSaverError",
    "RemoteReducer",
    "RemoteReducingSaver",
    "RemoteStore",
    "RequestTimeoutError",
    "SafeJsonPlusSerializer",
    "ServerUnavailableError",
    "__version__",
    "decode_memory_value",
]
