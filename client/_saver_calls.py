"""What ``RemoteReducingSaver`` sends and how it reads the answers: every decision of a saver method that is
not I/O, shared by its sync and async twins (``SaverCalls``, a base of the saver; no I/O here).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast, overload
from urllib.parse import quote

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata, CheckpointTuple
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from reducing_saver.client._calls import Call, as_given, no_content, post
from reducing_saver.client._server_info import RemoteReducer
from reducing_saver.client._values import decode_tuple, encode_value, encode_write, values_to_send
from reducing_saver.wire import (
    GET_PATH,
    LIST_PATH,
    PARENT_MESSAGES_HEADER,
    PARENT_MESSAGES_KEPT,
    PUT_PATH,
    STORAGE_PATH,
    THREAD_DELETE_PATH,
    THREAD_STORAGE_PATH,
    WRITES_PATH,
    bodies,
    checkpoint_fields,
    config_to_wire,
    ints_to_wire,
)
from reducing_saver.wire.bodies import StoredValues

logger = logging.getLogger(__name__)

#: Threads the client remembers having told about an unwindowed DeltaChannel (forgotten all at once past it).
NOTICED_THREADS = 10_000
_ABSENT = object()


def _parse_put(body: Any) -> RunnableConfig:
    return cast(RunnableConfig, body["config"])


#: Threads (and namespaces) whose last messages list the client remembers, least recently used dropped.
PARENT_LIST_THREADS = 1024
_KEPT_HEADERS = {PARENT_MESSAGES_HEADER: PARENT_MESSAGES_KEPT}


def message_ids(value: Any) -> frozenset[str] | None:
    """The ids of a messages list, when every message has one (a non-empty string without NUL, which the
    service keys the message by); else ``None``."""
    if not isinstance(value, list):
        return None
    ids = set()
    for message in value:
        message_id = message.get("id") if isinstance(message, dict) else getattr(message, "id", None)
        if type(message_id) is not str or not message_id or "\x00" in message_id:
            return None
        ids.add(message_id)
    return frozenset(ids)


class ParentLists:
    """The ids of the messages list of each thread's (and namespace's) last checkpoint this client put or
    read, so that a put can tell the service that the agent removed no message since its parent
    (``wire.PARENT_MESSAGES_HEADER``): the service then finds removals without reading the parent, which
    it must do whenever the parent was stored by another of its processes. Bounded to ``threads``."""

    def __init__(self, threads: int = PARENT_LIST_THREADS) -> None:
        self._threads = threads
        self._lists: OrderedDict[tuple[str, str], tuple[str, frozenset[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, config: RunnableConfig, checkpoint_id: str, ids: frozenset[str] | None) -> None:
        """The list of checkpoint ``checkpoint_id`` of the thread ``config`` names (``None``: unknown)."""
        thread = _thread_of(config)
        with self._lock:
            if ids is None:
                self._lists.pop(thread, None)
                return
            self._lists[thread] = (checkpoint_id, ids)
            self._lists.move_to_end(thread)
            while len(self._lists) > self._threads:
                self._lists.popitem(last=False)

    def parent(self, config: RunnableConfig) -> frozenset[str] | None:
        """The ids of the list of the checkpoint ``config`` names, when it is the one noted."""
        configurable = config.get("configurable") or {}
        with self._lock:
            held = self._lists.get(_thread_of(config))
        return held[1] if held is not None and held[0] == configurable.get("checkpoint_id") else None


def _thread_of(config: RunnableConfig) -> tuple[str, str]:
    configurable = config.get("configurable") or {}
    return str(configurable.get("thread_id")), str(configurable.get("checkpoint_ns") or "")


class SaverCalls:
    """The calls of ``RemoteReducingSaver``'s required methods and of ``storage``, built from what the
    service said about itself (set by the saver's constructor)."""

    serde: SerializerProtocol
    reducer: RemoteReducer
    messages_key: str
    max_list_limit: int | None
    #: Which channel values the service's backend stores: a put sends only those.
    _stored_values: StoredValues
    #: The per-step calls' bodies are msgpack (else JSON).
    _msgpack: bool
    #: The threads (and namespaces) already told that the service's window does not apply to them.
    _noticed: set[tuple[str, str]]
    #: Each thread's last messages list, for the puts' ``PARENT_MESSAGES_HEADER``.
    _parent_lists: ParentLists

    @overload
    def _config(self, config: RunnableConfig) -> bodies.RunConfigBody: ...
    @overload
    def _config(self, config: None) -> None: ...
    def _config(self, config: RunnableConfig | None) -> bodies.RunConfigBody | None:
        return config_to_wire(config, namespace_key=self.reducer.namespace_key)

    def _parse_get(self, body: Any) -> CheckpointTuple | None:
        wire = body["checkpoint"]
        if wire is None:
            return None
        item = decode_tuple(self.serde, wire)
        values = item.checkpoint["channel_values"]
        self._parent_lists.note(
            item.config, item.checkpoint["id"], message_ids(values.get(self.messages_key, _ABSENT))
        )
        return item

    def _parse_list(self, body: Any) -> list[CheckpointTuple]:
        return [decode_tuple(self.serde, wire) for wire in body["checkpoints"]]

    # -- calls, shared by sync and async ------------------------------------------------------------

    def _get_tuple_call(self, config: RunnableConfig) -> Call[CheckpointTuple | None]:
        body = bodies.GetCheckpointBody(config=self._config(config))
        return post(GET_PATH, body, self._parse_get, msgpack=self._msgpack)

    def _list_call(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> Call[list[CheckpointTuple]]:
        body = bodies.ListCheckpointsBody(
            config=self._config(config), filter=filter, before=self._config(before), limit=limit
        )
        return post(LIST_PATH, body, self._parse_list)

    def _list_page(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        remaining: int | None,
    ) -> tuple[Call[list[CheckpointTuple]], int | None]:
        """The call for the next page of a list, and the page's size (``None``: the answer is all there is).

        A page holds at most the service's ``max_list_limit`` checkpoints; ``remaining`` is what is left
        of the caller's ``limit`` (``None``: no limit). A service that does not say its cap gets the
        caller's request as it is.
        """
        cap = self.max_list_limit
        if cap is None:
            return self._list_call(config, filter, before, remaining), None
        size = cap if remaining is None else min(cap, remaining)
        return self._list_call(config, filter, before, size), size

    @staticmethod
    def _next_page(
        page: list[CheckpointTuple], size: int | None, remaining: int | None
    ) -> tuple[bool, int | None, RunnableConfig | None]:
        """``(more, remaining, before)`` after ``page``: the next page starts below its last checkpoint."""
        if remaining is not None:
            remaining -= len(page)
        if size is None or len(page) < size or not page or (remaining is not None and remaining <= 0):
            return False, remaining, None
        return True, remaining, page[-1].config

    def _put_call(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> Call[RunnableConfig]:
        values = checkpoint["channel_values"]
        lists = self._parent_lists
        parent = lists.parent(config)
        headers = None
        if self.messages_key in new_versions:
            value = values.get(self.messages_key, _ABSENT)
            self._notice_unwindowed(config, value)
            ids = message_ids(value)
            if parent is not None and ids is not None and parent <= ids:
                headers = _KEPT_HEADERS
        elif (config.get("configurable") or {}).get("checkpoint_id"):  # the list is the parent's
            ids = parent
        else:  # a thread's first checkpoint: no message yet
            ids = frozenset()
        lists.note(config, checkpoint["id"], ids)
        values = values_to_send(values, new_versions, self._stored_values)
        body = bodies.PutCheckpointBody(
            config=self._config(config),
            checkpoint=checkpoint_fields(checkpoint),
            values={channel: encode_value(self.serde, value) for channel, value in values.items()},
            metadata=ints_to_wire(metadata),
            new_versions=new_versions,
        )
        return post(PUT_PATH, body, _parse_put, msgpack=self._msgpack, headers=headers)

    def _notice_unwindowed(self, config: RunnableConfig, value: Any) -> None:
        """Log once per thread (and namespace) that the service's window cannot apply to its messages
        channel: a DeltaChannel (absent from the checkpoint, or a snapshot) is rebuilt from its writes, so
        the service stores it as written."""
        if value is not _ABSENT and not isinstance(value, _DeltaSnapshot):
            return
        reducer = self.reducer
        window = (
            f"max_messages={reducer.max_messages}"
            if reducer.max_messages
            else f"max_tokens={reducer.max_tokens}"
            if reducer.max_tokens
            else None
        )
        thread = _thread_of(config)
        if window is None or thread in self._noticed:
            return
        if len(self._noticed) >= NOTICED_THREADS:
            self._noticed.clear()
        self._noticed.add(thread)
        logger.info(
            "thread %r: channel %r is a DeltaChannel, rebuilt from its writes; the service's window (%s) "
            "does not apply to it: it is stored as written, and the messages the agent removes reach "
            "long-term memory (docs/memory.md)",
            thread[0],
            self.messages_key,
            window,
        )

    def _put_writes_call(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str
    ) -> Call[None]:
        body = bodies.PutWritesBody(
            config=self._config(config),
            writes=[(channel, encode_write(self.serde, value)) for channel, value in writes],
            task_id=task_id,
            task_path=task_path,
        )
        return post(WRITES_PATH, body, no_content, msgpack=self._msgpack)

    def _delete_thread_call(self, thread_id: str) -> Call[None]:
        return post(THREAD_DELETE_PATH, bodies.DeleteThreadBody(thread_id=str(thread_id)), no_content)

    @staticmethod
    def _storage_call(thread_id: str) -> Call[dict[str, Any]]:
        path = THREAD_STORAGE_PATH.format(thread_id=quote(str(thread_id), safe=""))
        return Call("GET", path, None, True, as_given)

    @staticmethod
    def _storage_summary_call(top: int) -> Call[dict[str, Any]]:
        return Call("GET", f"{STORAGE_PATH}?top={int(top)}", None, True, as_given)
