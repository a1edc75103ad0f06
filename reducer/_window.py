"""The message reducer: which messages of a conversation stay in a stored checkpoint.

Pure code: no HTTP, no database. It works on LangChain message objects and their ``model_dump()`` dicts
alike, never invents, copies or truncates a message, and keeps a window a chat-model API accepts; the
messages that leave it go to the ``on_prune`` hooks. docs/reducer.md ("What the reducer keeps") states
the rules.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeAlias

import orjson
from langchain_core.messages import BaseMessage, ChatMessage, messages_from_dict
from langchain_core.messages.utils import count_tokens_approximately

logger = logging.getLogger(__name__)

#: A message as a LangChain object or as its ``model_dump()`` dict.
MessageLike: TypeAlias = BaseMessage | Mapping[str, Any]
#: ``hook(pruned_messages, namespace)``, called after a prune.
PruneHook: TypeAlias = Callable[[list[Any], tuple[str, ...]], Any]
TokenCounter: TypeAlias = Callable[[Sequence[Any]], int]


@dataclass(frozen=True)
class ReducerConfig:
    """How a :class:`MessageReducer` bounds a messages list.

    Count and token limits can be combined: a list is reduced when it breaks either trigger, and then
    cut until it meets both targets.

    Attributes:
        max_messages: Reduce when the list holds more than this many messages. ``None`` turns count mode
            off.
        min_messages: Reduce down to this many messages (the gap to ``max_messages`` makes a prune
            happen once every few messages instead of on every put). Defaults to ``max_messages``.
        max_tokens: Reduce when the list holds more than this many tokens. ``None`` turns token mode off.
        target_tokens: Reduce down to this many tokens. Defaults to ``max_tokens``.
        token_counter: Counts the tokens of a list of messages (objects or dicts, as handed to the
            reducer); applied to one message at a time. Defaults to langchain_core's
            ``count_tokens_approximately``, which counts a ``model_dump()`` dict as the message it dumps.
        preserve_first: Never prune the leading system messages.
        cascade_tool_messages: Keep or prune an AI tool call together with the tool messages that answer
            it. With ``False`` a cut may orphan tool messages (the window is then not always API-valid).
        start_on: ``"human"``: the first kept message after the system prompt is a human message.
            ``None``: a window may start on any message type.
        on_prune: Hooks called as ``hook(pruned_messages, namespace)`` after a prune (a single callable
            is accepted too). A hook that raises is logged and does not break the reduce.
        dedupe_on_prune: Deliver each message to the hooks once per reducer and namespace, although
            LangGraph hands every put of a turn the same unreduced list. Messages are told apart by id;
            id-less messages of the same type and content in one namespace count as one.
        dedupe_capacity: How many delivered message keys the reducer remembers.
        namespace_key: The ``config["configurable"]`` key that names a run's memory namespace.
    """

    max_messages: int | None = 20
    min_messages: int | None = None
    max_tokens: int | None = None
    target_tokens: int | None = None
    token_counter: TokenCounter | None = None
    preserve_first: bool = True
    cascade_tool_messages: bool = True
    start_on: Literal["human"] | None = "human"
    on_prune: Sequence[PruneHook] = field(default_factory=tuple)
    dedupe_on_prune: bool = True
    dedupe_capacity: int = 100_000
    namespace_key: str = "memory_namespace"

    def __post_init__(self) -> None:
        for name in ("max_messages", "min_messages", "max_tokens", "target_tokens", "dedupe_capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.token_counter is not None and not callable(self.token_counter):
            raise TypeError(f"token_counter must be callable, got {self.token_counter!r}")
        hooks = (self.on_prune,) if callable(self.on_prune) else tuple(self.on_prune)
        for hook in hooks:
            if not callable(hook):
                raise TypeError(f"on_prune hooks must be callable, got {hook!r}")
        if self.max_messages is None and self.max_tokens is None:
            raise ValueError("ReducerConfig needs max_messages or max_tokens (or both)")
        if self.max_messages is not None and self.max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {self.max_messages}")
        if self.min_messages is not None:
            if self.max_messages is None:
                raise ValueError("min_messages needs max_messages")
            if not 1 <= self.min_messages <= self.max_messages:
                raise ValueError(
                    f"min_messages must be between 1 and max_messages ({self.max_messages}), "
                    f"got {self.min_messages}"
                )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.target_tokens is not None:
            if self.max_tokens is None:
                raise ValueError("target_tokens needs max_tokens")
            if not 1 <= self.target_tokens <= self.max_tokens:
                raise ValueError(
                    f"target_tokens must be between 1 and max_tokens ({self.max_tokens}), "
                    f"got {self.target_tokens}"
                )
        if self.start_on not in ("human", None):
            raise ValueError(f"start_on must be 'human' or None, got {self.start_on!r}")
        if self.dedupe_capacity < 1:
            raise ValueError(f"dedupe_capacity must be at least 1, got {self.dedupe_capacity}")
        object.__setattr__(self, "on_prune", hooks)

    @property
    def count_target(self) -> int | None:
        return self.min_messages if self.min_messages is not None else self.max_messages

    @property
    def token_target(self) -> int | None:
        return self.target_tokens if self.target_tokens is not None else self.max_tokens


class ReduceResult(NamedTuple):
    """The split of a messages list: ``kept[:head] + pruned + kept[head:]`` is the input, same objects.

    ``head`` is :meth:`MessageReducer.head_length` of the input.
    """

    kept: list[Any]
    pruned: list[Any]


def message_field(message: MessageLike, name: str, default: Any = None) -> Any:
    """Read a field from a message object or its ``model_dump()`` dict."""
    # isinstance(dict) first: the service reduces dicts, and an ABC check (Mapping) costs a microsecond
    # per call, many times per message and put.
    if isinstance(message, (dict, Mapping)):
        return message.get(name, default)
    return getattr(message, name, default)


def message_type(message: MessageLike) -> str:
    """``"human"``, ``"ai"``, ``"system"``, ``"tool"``, ... (chunks count as their message type)."""
    kind = message_field(message, "type") or ""
    return _CHUNK_TYPES.get(kind, kind)


_CHUNK_TYPES = {
    "AIMessageChunk": "ai",
    "HumanMessageChunk": "human",
    "SystemMessageChunk": "system",
    "ToolMessageChunk": "tool",
    "ChatMessageChunk": "chat",
    "FunctionMessageChunk": "function",
}
#: The ``type`` fields :func:`message_type` reads as ``"system"``.
SYSTEM_TYPES = frozenset({"system", *(chunk for chunk, kind in _CHUNK_TYPES.items() if kind == "system")})


#: ``additional_kwargs["lc_source"]`` of a summary message (LangChain's ``SummarizationMiddleware`` marks its
#: summaries so; the service's running summaries too).
SUMMARY_SOURCE = "summarization"


def is_summary_message(message: MessageLike) -> bool:
    """A summary of earlier conversation: a message marked ``lc_source: "summarization"``."""
    kwargs = message_field(message, "additional_kwargs")
    return isinstance(kwargs, Mapping) and kwargs.get("lc_source") == SUMMARY_SOURCE


def _tool_call_ids(message: MessageLike) -> list[str]:
    return [call["id"] for call in message_field(message, "tool_calls") or () if call.get("id")]


def message_key(message: MessageLike, namespace: Sequence[str]) -> str:
    """A stable key for a message: its id, or a digest of its namespace, type and content.

    LangGraph's ``add_messages`` gives every message an id; the digest covers lists built by hand. An id
    holding U+0000, which PostgreSQL's text (the outbox's and the store's key columns) cannot hold, is
    keyed by its digest instead (``"id-sha256:"``); the message itself keeps its id.
    """
    message_id = message_field(message, "id")
    if message_id:
        message_id = str(message_id)
        if "\x00" in message_id:
            return "id-sha256:" + hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()
        return message_id
    payload = orjson.dumps(
        [list(namespace), message_type(message), message_field(message, "content")],
        option=orjson.OPT_SORT_KEYS,
        default=str,
    )
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def _default_token_counter(messages: Sequence[Any]) -> int:
    return count_tokens_approximately([_as_message(m) for m in messages])


def _as_message(message: MessageLike) -> Any:
    """The message object a ``model_dump()`` dict came from, so both forms count the same.

    ``count_tokens_approximately`` coerces dicts itself but refuses chunk types (``"AIMessageChunk"``);
    rebuilding the object by its type handles every LangChain message type.
    """
    if not isinstance(message, Mapping):
        return message
    try:
        return messages_from_dict([{"type": message.get("type"), "data": dict(message)}])[0]
    except Exception:  # noqa: BLE001 - unknown type or malformed dict (validators raise anything)
        content = message.get("content")
        if not isinstance(content, (str, list)):
            content = "" if content is None else str(content)
        return ChatMessage(role=message_type(message) or "unknown", content=content)


class MessageReducer:
    """Bounds a messages list to a valid window and hands what leaves it to ``on_prune`` hooks.

    Example:
        >>> reducer = MessageReducer(ReducerConfig(max_messages=6, min_messages=4))
        >>> kept, pruned = reducer.reduce(messages, namespace=("memories", "thread-1"))
    """

    def __init__(self, config: ReducerConfig | None = None, **options: Any) -> None:
        """Build a reducer from a config, or from ``ReducerConfig`` keyword arguments."""
        if config is not None and options:
            raise TypeError("pass either a ReducerConfig or keyword options, not both")
        self.config = config if config is not None else ReducerConfig(**options)
        self._count_tokens: TokenCounter = self.config.token_counter or _default_token_counter
        self._delivered: OrderedDict[tuple[tuple[str, ...], str], None] = OrderedDict()
        # The service reduces puts from many threads with one reducer.
        self._delivered_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles carry the dedupe memory, not the lock.
        state = self.__dict__.copy()
        del state["_delivered_lock"]
        with self._delivered_lock:
            state["_delivered"] = OrderedDict(self._delivered)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._delivered_lock = threading.Lock()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"MessageReducer(max_messages={c.max_messages}, min_messages={c.count_target}, "
            f"max_tokens={c.max_tokens}, target_tokens={c.token_target})"
        )

    # -- window selection -------------------------------------------------------------------------

    def system_length(self, messages: Sequence[MessageLike]) -> int:
        """How many leading system messages the window preserves (0 without ``preserve_first``)."""
        if not self.config.preserve_first:
            return 0
        count = 0
        while count < len(messages) and message_type(messages[count]) == "system":
            count += 1
        return count

    def head_length(self, messages: Sequence[MessageLike]) -> int:
        """How many leading messages are never cut: the preserved system messages, then a summary
        message right after them (:func:`is_summary_message`)."""
        head = self.system_length(messages)
        if head < len(messages) and is_summary_message(messages[head]):
            head += 1
        return head

    def select(self, messages: Sequence[MessageLike], *, head: int | None = None) -> int:
        """Return how many messages right after the head to prune.

        Args:
            messages: The messages list, oldest first.
            head: How many leading messages are never cut (default :meth:`head_length`).

        Pure: no hook is called. ``0`` means the list is kept whole.
        """
        config = self.config
        if head is None:
            head = self.head_length(messages)
        tokens = None
        over_tokens = False
        if config.max_tokens is not None:
            tokens = [self._count_tokens([m]) for m in messages]
            over_tokens = sum(tokens) > config.max_tokens
        over_count = config.max_messages is not None and len(messages) > config.max_messages
        if not (over_count or over_tokens):
            return 0

        cuts = self._valid_cuts(messages, head)
        if not cuts:
            return 0
        # Keep the longest valid window that meets every target; when none does, the shortest one.
        head_tokens = sum(tokens[:head]) if tokens is not None else 0
        suffix_sums: dict[int, int] = {}
        if tokens is not None:
            running = 0
            for index in range(len(messages) - 1, head - 1, -1):
                running += tokens[index]
                suffix_sums[index] = running
        token_target = config.token_target  # set whenever max_tokens is, so whenever tokens are counted
        for cut in cuts:
            kept_count = head + len(messages) - cut
            if config.count_target is not None and kept_count > config.count_target:
                continue
            if (
                token_target is not None
                and tokens is not None
                and head_tokens + suffix_sums[cut] > token_target
            ):
                continue
            return cut - head
        return cuts[-1] - head

    def is_valid_cut(self, messages: Sequence[MessageLike], head: int, cut: int) -> bool:
        """Whether the window may drop ``messages[head:cut]`` and start its tail at ``cut``."""
        return cut in self._valid_cuts(messages, head)

    def _valid_cuts(self, messages: Sequence[MessageLike], head: int) -> list[int]:
        """Indices ``cut > head`` where the kept window ``messages[cut:]`` may start, ascending.

        A window never starts with the whole tail pruned: the newest message is always kept.
        """
        config = self.config
        n = len(messages)
        # A cut inside a tool-call group (AI call ... its last answer) would orphan one side.
        inside_group = [False] * (n + 1)
        kinds = [message_type(message) for message in messages]
        if config.cascade_tool_messages:
            last_answer: dict[str, int] = {}
            for index in range(head, n):
                if kinds[index] == "tool" and (call_id := message_field(messages[index], "tool_call_id")):
                    last_answer[call_id] = index
            if last_answer:  # no tool answers, no groups
                for index in range(head, n):
                    ends = [last_answer[c] for c in _tool_call_ids(messages[index]) if c in last_answer]
                    for inner in range(index + 1, max(ends, default=index) + 1):
                        inside_group[inner] = True
        cuts = []
        for cut in range(head + 1, n):
            if inside_group[cut]:
                continue
            kind = kinds[cut]
            if config.start_on == "human" and kind != "human":
                continue
            if config.cascade_tool_messages and kind == "tool":
                continue
            cuts.append(cut)
        return cuts

    # -- reduce -----------------------------------------------------------------------------------

    def split(self, messages: Sequence[MessageLike]) -> ReduceResult:
        """Cut ``messages`` to the window without calling any hook.

        Returns:
            ``ReduceResult(kept, pruned)``, holding the same objects as the input.
        """
        messages = list(messages)
        pruned_count = self.select(messages)
        if not pruned_count:
            return ReduceResult(messages, [])
        head = self.head_length(messages)
        return ReduceResult(
            messages[:head] + messages[head + pruned_count :], messages[head : head + pruned_count]
        )

    def reduce(self, messages: Sequence[MessageLike], namespace: Sequence[str] = ()) -> ReduceResult:
        """Cut ``messages`` to the window and deliver the pruned messages to the hooks.

        Args:
            messages: The messages list, oldest first (objects or ``model_dump()`` dicts).
            namespace: The memory namespace handed to the hooks.

        Returns:
            ``ReduceResult(kept, pruned)``; ``kept`` holds the same objects as the input.
        """
        result = self.split(messages)
        if result.pruned:
            self.deliver(result.pruned, tuple(namespace))
        return result

    def deliver(self, pruned: Sequence[Any], namespace: tuple[str, ...]) -> list[Any]:
        """Hand ``pruned`` to the hooks, once per message key when deduping; return what was handed.

        Thread-safe: concurrent calls deliver each key once (while the reducer remembers it). The hooks
        run outside the lock, so a slow hook does not hold up other threads' bookkeeping.
        """
        if self.config.dedupe_on_prune:
            keyed = [((namespace, message_key(message, namespace)), message) for message in pruned]
            fresh = []
            with self._delivered_lock:
                for key, message in keyed:
                    if key in self._delivered:
                        self._delivered.move_to_end(key)
                        continue
                    self._delivered[key] = None
                    fresh.append(message)
                while len(self._delivered) > self.config.dedupe_capacity:
                    self._delivered.popitem(last=False)
        else:
            fresh = list(pruned)
        if fresh:
            for hook in self.config.on_prune:
                try:
                    hook(list(fresh), namespace)
                except Exception:
                    logger.exception("on_prune hook %r failed; the reduce goes on", hook)
        return fresh
