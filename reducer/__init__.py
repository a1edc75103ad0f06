"""reducing_saver.reducer: the reducer core, usable in-process around any LangGraph saver.

    from reducing_saver.reducer import MessageReducer, ReducerConfig, ReducingSaver

    reducer = MessageReducer(ReducerConfig(max_messages=20, min_messages=12))
    graph = builder.compile(checkpointer=ReducingSaver(PostgresSaver(conn), reducer))

Pure code: no HTTP, no database. Importing it loads neither httpx, aiohttp, FastAPI nor psycopg (a test
pins this). The service hosts the same reducer behind its HTTP API; the namespace rule here
(:func:`namespace_for`) is the one its outbox, sweeper and tenant scoping use.
"""

from reducing_saver.reducer._namespace import (
    DEFAULT_NAMESPACE_KEY,
    escape_label,
    namespace_for,
    thread_namespace,
    validate_namespace,
)
from reducing_saver.reducer._removals import (
    REMEMBER_REMOVED_CHOICES,
    REMOVE_ALL_MESSAGES,
    Forget,
    RememberRemoved,
    Removals,
    split_removed,
)
from reducing_saver.reducer._saver import (
    LIST_CODEC,
    UNREADABLE,
    MessagesCodec,
    RecordPruned,
    ReducingSaver,
    apply_reducer,
    memory_namespace,
)
from reducing_saver.reducer._summary import (
    MARK_KEY,
    SUMMARY_PREFIX,
    MemorySummaryBook,
    StepInfo,
    StepRequest,
    Summaries,
    SummaryBook,
    SummaryForgeryError,
    SummaryPlan,
    WindowSummary,
    batch_fingerprint,
    message_digest,
    step_id,
    summary_content,
    summary_message_id,
)
from reducing_saver.reducer._window import (
    SUMMARY_SOURCE,
    MessageLike,
    MessageReducer,
    PruneHook,
    ReducerConfig,
    ReduceResult,
    is_summary_message,
    message_field,
    message_key,
    message_type,
)

__all__ = [
    "DEFAULT_NAMESPACE_KEY",
    "Forget",
    "LIST_CODEC",
    "MARK_KEY",
    "SUMMARY_PREFIX",
    "SUMMARY_SOURCE",
    "UNREADABLE",
    "MemorySummaryBook",
    "MessageLike",
    "MessageReducer",
    "MessagesCodec",
    "PruneHook",
    "REMEMBER_REMOVED_CHOICES",
    "REMOVE_ALL_MESSAGES",
    "RecordPruned",
    "RememberRemoved",
    "Removals",
    "ReduceResult",
    "ReducerConfig",
    "ReducingSaver",
    "StepInfo",
    "StepRequest",
    "Summaries",
    "SummaryBook",
    "SummaryForgeryError",
    "SummaryPlan",
    "WindowSummary",
    "apply_reducer",
    "batch_fingerprint",
    "escape_label",
    "is_summary_message",
    "memory_namespace",
    "message_digest",
    "message_field",
    "message_key",
    "message_type",
    "namespace_for",
    "split_removed",
    "step_id",
    "summary_content",
    "summary_message_id",
    "thread_namespace",
    "validate_namespace",
]
