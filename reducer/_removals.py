"""Messages an agent removes from its own state: which of them long-term memory keeps, which it forgets.

An agent manages its context by removing messages itself: LangGraph's ``RemoveMessage`` for the oldest ones
(the trimming pattern), or ``RemoveMessage(REMOVE_ALL_MESSAGES)`` followed by a summary and the messages it
keeps (LangChain's ``SummarizationMiddleware``). Those removals are context management, like the window's
cut: the messages reach memory. A ``RemoveMessage`` of a message that is not among the oldest (a user
asking to forget something) is a deliberate deletion: the message never reaches memory, and leaves it if
it already had.

The rule (:func:`split_removed`): walking the state before the step from its oldest message, the removed
messages met before the first one that stays are *trimmed*; every removed message after it is *deleted*.
System messages and summaries (``lc_source: "summarization"``) are neither: they are passed over. A
:class:`Removals` policy can instead remember every removal (``"all"``) or none (``"none"``; deletions
are still forgotten).

This module is pure: the saver (``_saver.py``) finds the states before and after, and records.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from reducing_saver.reducer._window import (
    SUMMARY_SOURCE,
    SYSTEM_TYPES,
    is_summary_message,
    message_field,
    message_key,
    message_type,
)

#: The id of ``RemoveMessage(id=REMOVE_ALL_MESSAGES)`` (``langgraph.graph.message``): clear the state.
REMOVE_ALL_MESSAGES = "__remove_all__"

#: Which removals long-term memory keeps: the oldest-first trims (default), every one, or none.
RememberRemoved = Literal["trimmed", "all", "none"]
REMEMBER_REMOVED_CHOICES: tuple[str, ...] = ("trimmed", "all", "none")

#: ``forget(keys, namespace, config)``: the deleted messages' keys leave memory (and never enter it).
Forget = Callable[[list[str], tuple[str, ...], Any], None]


def is_removal(message: Any) -> bool:
    """A ``RemoveMessage`` (``type == "remove"``), as an object or its ``model_dump()`` dict."""
    return message_type(message) == "remove"


def fold(state: Sequence[Any], writes: Iterable[Sequence[Any]]) -> list[Any]:
    """``add_messages``' (and the messages DeltaChannel reducer's) result of applying ``writes`` in order.

    A message whose id is already in the state replaces it, a ``RemoveMessage`` removes its id, one with
    id :data:`REMOVE_ALL_MESSAGES` empties the state; anything else is appended.
    """
    result: list[Any] = list(state)
    for write in writes:
        for message in write:
            message_id = message_field(message, "id")
            if is_removal(message):
                if message_id == REMOVE_ALL_MESSAGES:
                    result = []
                else:
                    result = [m for m in result if message_field(m, "id") != message_id]
                continue
            if message_id is not None:
                for index, existing in enumerate(result):
                    if message_field(existing, "id") == message_id:
                        result[index] = message
                        break
                else:
                    result.append(message)
            else:
                result.append(message)
    return result


def _passed_over(message: Any) -> bool:
    return message_type(message) == "system" or is_summary_message(message)


def removal_keys(messages: Sequence[Any], namespace: Sequence[str]) -> tuple[tuple[str, bool], ...]:
    """Each message's key (``message_key``) and whether :func:`split_removed` passes it over."""
    return tuple(_removal_key(m, namespace) for m in messages)


def _removal_key(message: Any, namespace: Sequence[str]) -> tuple[str, bool]:
    """``(message_key(message), _passed_over(message))``. A put reads every message of its list here: a
    dict with a plain string id, type and ``additional_kwargs`` dict (every message the service decodes)
    is read with one lookup a field, anything else through ``message_key`` and ``_passed_over``."""
    if isinstance(message, dict):
        message_id, kind = message.get("id"), message.get("type")
        kwargs = message.get("additional_kwargs")
        if (
            type(message_id) is str
            and message_id
            and "\x00" not in message_id
            and type(kind) is str
            and (kwargs is None or type(kwargs) is dict)
        ):
            summary = kwargs is not None and kwargs.get("lc_source") == SUMMARY_SOURCE
            return message_id, kind in SYSTEM_TYPES or summary
    return message_key(message, namespace), _passed_over(message)


def split_removed(before: Sequence[tuple[str, bool]], kept_keys: set[str]) -> tuple[list[str], list[str]]:
    """The keys of ``before`` that are not in ``kept_keys``, as ``(trimmed, deleted)``.

    ``before`` is the state before the step, oldest first, as :func:`removal_keys` gives it; ``kept_keys``
    the keys of the state after it. Removed messages before the first message that stays are trimmed,
    the others deleted; system messages and summaries are passed over (neither).
    """
    trimmed: list[str] = []
    deleted: list[str] = []
    survivor_seen = False
    for key, passed_over in before:
        if passed_over:
            continue
        if key in kept_keys:
            survivor_seen = True
        elif survivor_seen:
            deleted.append(key)
        else:
            trimmed.append(key)
    return trimmed, deleted


class Removals:
    """What a saver does with the messages an agent removes, shared by a pool of savers.

    Args:
        remember: ``"trimmed"`` (default): trimmed messages reach memory, deleted ones are forgotten;
            ``"all"``: every removed message reaches memory; ``"none"``: none does, deleted ones are still
            forgotten.
        forget: Called with the deleted messages, their memory namespace and the put's config (the
            service drops them from memory); ``None``: deletions only stay out of memory.
        threads: How many threads' last message lists are remembered between puts (the keys of their newest
            ``keys_per_thread`` messages): the state before a step, where the stored one holds only the
            window. A put of a thread not among them reads its parent checkpoint instead.
        keys_per_thread: How many of a list's newest messages are remembered.
    """

    def __init__(
        self,
        remember: RememberRemoved = "trimmed",
        *,
        forget: Forget | None = None,
        threads: int = 1024,
        keys_per_thread: int = 256,
    ) -> None:
        if remember not in REMEMBER_REMOVED_CHOICES:
            raise ValueError(f"remember must be one of {REMEMBER_REMOVED_CHOICES}, got {remember!r}")
        self.remember = remember
        self.forget = forget
        self._threads = threads
        self._keys_per_thread = keys_per_thread
        self._last: OrderedDict[tuple[str, str], tuple[str, tuple[tuple[str, bool], ...]]] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Removals(remember={self.remember!r})"

    def decide(self, trimmed: list[str], deleted: list[str]) -> tuple[list[str], list[str]]:
        """``(remembered, forgotten)`` under this policy."""
        if self.remember == "all":
            return trimmed + deleted, []
        if self.remember == "none":
            return [], deleted
        return trimmed, deleted

    # -- the last message list of recent threads --------------------------------------------------

    def last(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str | None
    ) -> tuple[tuple[str, bool], ...] | None:
        """The keys of the message list this process last stored for the thread and namespace, with
        whether each is passed over, when that was checkpoint ``checkpoint_id``; else ``None``."""
        with self._lock:
            held = self._last.get((thread_id, checkpoint_ns))
        return held[1] if held is not None and held[0] == checkpoint_id else None

    def note(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, keys: tuple[tuple[str, bool], ...]
    ) -> None:
        """Remember the message list a put stored (its :func:`removal_keys`, before any window cut) for
        the thread's next put; only the newest ``keys_per_thread``."""
        keys = keys[-self._keys_per_thread :]
        with self._lock:
            self._last[(thread_id, checkpoint_ns)] = (checkpoint_id, keys)
            self._last.move_to_end((thread_id, checkpoint_ns))
            while len(self._last) > self._threads:
                self._last.popitem(last=False)

    def carry(self, thread_id: str, checkpoint_ns: str, parent_id: str | None, checkpoint_id: str) -> None:
        """A put of checkpoint ``checkpoint_id`` that does not write the messages channel keeps its parent's
        list: the note of ``parent_id``, when it is the one held, stands for the new checkpoint too, and a
        first checkpoint (no parent) holds no message (so the thread's next put finds its state before the
        step without reading its parent)."""
        if parent_id is None:
            self.note(thread_id, checkpoint_ns, checkpoint_id, ())
            return
        with self._lock:
            held = self._last.get((thread_id, checkpoint_ns))
            if held is not None and held[0] == parent_id:
                self._last[(thread_id, checkpoint_ns)] = (checkpoint_id, held[1])
                self._last.move_to_end((thread_id, checkpoint_ns))

    def forget_thread(self, thread_id: str) -> None:
        with self._lock:
            for key in [key for key in self._last if key[0] == thread_id]:
                del self._last[key]
