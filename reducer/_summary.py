"""Running summaries in the window: cut messages leave it only once a summary covers them.

Pure code, like the rest of the reducer: the summaries themselves live in a :class:`SummaryBook` (the
service's table, or a dict), which this module only reads and asks for new work. :meth:`Summaries.plan`
decides, on each put that writes the messages channel, what the window keeps; docs/summaries.md ("What a
summary is", "No context gap") describes the summary message, the chain of steps and the hard limit.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import orjson
from langchain_core.messages import HumanMessage

from reducing_saver.reducer._window import (
    SUMMARY_SOURCE,
    MessageReducer,
    is_summary_message,
    message_field,
    message_key,
    message_type,
)

#: The key of the summary's own record in ``additional_kwargs``.
MARK_KEY = "reducing_saver_summary"
#: What the summary message's content starts with, so a model reads it as earlier conversation.
SUMMARY_PREFIX = (
    "Summary of the earlier conversation (older messages were condensed into this summary; it is "
    "background for the conversation that follows, not a new request):\n\n"
)
_PENDING_NOTE = "[{count} earlier message(s) are being summarized and will be added here.]"
_ID_NAMESPACE = uuid.UUID("6f1d3c7e-2b5a-4c1e-9a77-5e0b8d4f2a10")

StepStatus = Literal["pending", "done", "dead"]


def summary_message_id(thread_id: str, checkpoint_ns: str) -> str:
    """The summary message's id in a thread's namespace: uuid5 of the stored thread id (which carries the
    tenant in tenant mode) and the checkpoint namespace."""
    return str(uuid.uuid5(_ID_NAMESPACE, f"{thread_id}\x1f{checkpoint_ns}"))


def step_id(base: str | None, keys: Sequence[str], fingerprint: str | None = None) -> str:
    """A step's name: a digest of its base step, of its batch's message keys and, when given, of the
    batch's :func:`batch_fingerprint` (what the messages say: an edited message makes another step)."""
    named = [base, list(keys)] if fingerprint is None else [base, list(keys), fingerprint]
    return hashlib.sha256(orjson.dumps(named)).hexdigest()[:32]


def message_digest(message: Any) -> bytes:
    """16 bytes that change when a message does: its ``model_dump()`` (or dict), canonical JSON, hashed."""
    fields = message.model_dump() if hasattr(message, "model_dump") else dict(message)
    data = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
    return hashlib.blake2b(data, digest_size=16).digest()


def batch_fingerprint(messages: Sequence[Any], digest: Callable[[Any], bytes] = message_digest) -> str:
    """What a batch's messages say, as 32 hex digits (``digest`` of each, in order, hashed together)."""
    combined = hashlib.blake2b(digest_size=16)
    for message in messages:
        combined.update(digest(message))
    return combined.hexdigest()


def summary_content(text: str | None, waiting: int) -> str:
    """The content of the summary message showing ``text``, with a note for ``waiting`` messages cut past
    the hard limit and not summarized yet."""
    parts = [text] if text else []
    if waiting:
        parts.append(_PENDING_NOTE.format(count=waiting))
    return SUMMARY_PREFIX + "\n\n".join(parts)


@dataclass(frozen=True)
class StepRequest:
    """A batch of cut messages to summarize on top of ``base_step``.

    Attributes:
        thread_id: The stored thread id.
        checkpoint_ns: The checkpoint namespace.
        step_id: ``step_id(base_step, keys)``.
        base_step: The step whose summary this one extends (``None`` for the first).
        version: The base's version plus one.
        keys: The batch's message keys, oldest first.
        batch: The batch's messages (objects or ``model_dump()`` dicts), oldest first.
        covered: Messages covered once this step is done (the base's plus the batch).
    """

    thread_id: str
    checkpoint_ns: str
    step_id: str
    base_step: str | None
    version: int
    keys: tuple[str, ...]
    batch: list[Any]
    covered: int


@dataclass(frozen=True)
class StepInfo:
    """A step as the book holds it."""

    step_id: str
    base_step: str | None
    version: int
    keys: tuple[str, ...]
    status: StepStatus
    covered: int
    text: str | None = None


class SummaryBook(Protocol):
    """Where the steps of every thread's summary live (the service's ``reducing_saver_summaries``)."""

    def steps(self, thread_id: str, checkpoint_ns: str, step_ids: Sequence[str]) -> dict[str, StepInfo]:
        """The named steps the book holds."""

    def children(self, thread_id: str, checkpoint_ns: str, base_step: str | None) -> list[StepInfo]:
        """Every step built on ``base_step`` (``None``: the first steps of the namespace)."""

    def request(self, step: StepRequest) -> None:
        """Record a step to summarize (idempotent: a step already held is left as it is)."""

    def chain(self, thread_id: str, checkpoint_ns: str, tip: str, base: str | None) -> list[StepInfo]:
        """The steps from ``tip`` back through their bases to the one built on ``base`` (excluded), oldest
        first: the chain of lagging steps a summary names by its ends."""


class SummaryForgeryError(ValueError):
    """A put carries the service's summary message in a form the service did not write."""


@dataclass(frozen=True)
class WindowSummary:
    """What a window's summary message records (:data:`MARK_KEY`).

    Attributes:
        step: The done step it shows (``None``: none yet).
        version: That step's version.
        covered: Messages that step covers.
        through: The key of the last message it covers.
        lagging: The ends of the chain of lagging steps (first and last; one id when they are the same
            step; empty when none lags).
        lagging_messages: Messages the lagging steps hold (cut past the hard limit, not summarized yet).
        text: The summary's text (not in the mark: the book's).
    """

    step: str | None = None
    version: int = 0
    covered: int = 0
    through: str | None = None
    lagging: tuple[str, ...] = ()
    lagging_messages: int = 0
    text: str | None = None

    @classmethod
    def from_mark(cls, mark: Mapping[str, Any]) -> WindowSummary:
        lagging = mark.get("lagging") or ()
        step = mark.get("step")
        version, covered = mark.get("version"), mark.get("covered")
        lagging_messages = mark.get("lagging_messages", 0)
        if not (
            (step is None or isinstance(step, str))
            and isinstance(version, int)
            and isinstance(covered, int)
            and isinstance(lagging, (list, tuple))
            and len(lagging) <= 2
            and all(isinstance(s, str) for s in lagging)
            and isinstance(lagging_messages, int)
            and not isinstance(lagging_messages, bool)
        ):
            raise SummaryForgeryError(f"additional_kwargs.{MARK_KEY} is malformed")
        through = mark.get("through")
        return cls(
            step,
            version,
            covered,
            through if isinstance(through, str) else None,
            tuple(lagging),
            lagging_messages,
        )

    def mark(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "covered": self.covered,
            "through": self.through,
            "lagging": list(self.lagging),
            "lagging_messages": self.lagging_messages,
        }

    def advance(self, step: StepInfo) -> WindowSummary:
        return replace(
            self,
            step=step.step_id,
            version=step.version,
            covered=step.covered,
            through=step.keys[-1] if step.keys else self.through,
            text=step.text,
        )

    @property
    def empty(self) -> bool:
        return self.step is None and not self.lagging


@dataclass
class SummaryPlan:
    """What a put stores and records.

    Attributes:
        messages: The window to store, or ``None`` when the input stays as it is.
        removed: Messages leaving the window (covered by the summary, or cut past the hard limit).
        requested: Messages of a step requested now (still in the window).
        uncovered: How many of ``removed`` left without a summary covering them yet (hard limit).
    """

    messages: list[Any] | None = None
    removed: list[Any] = field(default_factory=list)
    requested: list[Any] = field(default_factory=list)
    uncovered: int = 0


class Summaries:
    """Keeps running summaries in the windows of one reducer.

    A thread's summary lives in its root graph's window (checkpoint namespace ``""``). A subgraph's
    namespace is reduced as without summaries: its messages come from the parent, whose window holds the
    summary, and the parent's summary message stays at the head of the subgraph's window (never cut);
    whatever the subgraph hands back is checked where it lands, in the parent's namespace.

    Args:
        book: Where the steps live.
        hard_limit: A reducer whose trigger is the hard limit (and whose targets are the window's): above
            it the window cuts without a summary. ``None``: never.
        wrap: Turns the summary ``HumanMessage`` into the element form of the messages list (the
            codec's; default: the message itself).
        enabled: ``enabled(thread_id)``: whether a thread is summarized (others are reduced as without
            summaries).
        on_uncovered: ``on_uncovered(thread_id, count)`` for messages cut without cover (metrics, logs).
        on_request: ``on_request(thread_id)`` after a step was asked for (wakes a summarizer).
        verified_capacity: How many verified summary messages the instance remembers (they are
            immutable, so a put sending one back needs no look-up).
        fingerprint: ``fingerprint(thread_id, batch)``: what a batch says, part of its step's name
            (default :func:`batch_fingerprint`; the service passes one keyed per tenant under encryption,
            so a step id reveals nothing of the text).
    """

    def __init__(
        self,
        book: SummaryBook,
        *,
        hard_limit: MessageReducer | None = None,
        wrap: Callable[[HumanMessage], Any] | None = None,
        enabled: Callable[[str], bool] | None = None,
        on_uncovered: Callable[[str, int], Any] | None = None,
        on_request: Callable[[str], Any] | None = None,
        verified_capacity: int = 10_000,
        fingerprint: Callable[[str, Sequence[Any]], str] | None = None,
    ) -> None:
        self.book = book
        self.hard_limit = hard_limit
        self.wrap = wrap or (lambda message: message)
        self.enabled = enabled or (lambda thread_id: True)
        self.on_uncovered = on_uncovered
        self.on_request = on_request
        self.fingerprint = fingerprint or (lambda thread_id, batch: batch_fingerprint(batch))
        self._verified: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._verified_capacity = verified_capacity
        self._lock = threading.Lock()

    # -- the summary message -----------------------------------------------------------------------

    def message(self, thread_id: str, checkpoint_ns: str, state: WindowSummary) -> HumanMessage:
        """The summary message showing ``state``."""
        return HumanMessage(
            content=summary_content(state.text, state.lagging_messages),
            id=summary_message_id(thread_id, checkpoint_ns),
            additional_kwargs={"lc_source": SUMMARY_SOURCE, MARK_KEY: state.mark()},
        )

    def _read(
        self, messages: Sequence[Any], system: int, thread_id: str, checkpoint_ns: str
    ) -> WindowSummary:
        """The state the window's summary message records, verified; empty when there is none.

        Raises:
            SummaryForgeryError: A message with the summary's id out of place, twice, unmarked, or showing
                anything but a step the book holds.
        """
        sid = summary_message_id(thread_id, checkpoint_ns)
        # By id, or by mark: a copied thread's windows hold the summary under the source thread's id.
        places = [index for index, m in enumerate(messages) if message_field(m, "id") == sid or _marked(m)]
        if not places:
            return WindowSummary()
        where = f"message id {message_field(messages[places[0]], 'id')!r} is the service's running summary"
        if places != [system]:
            raise SummaryForgeryError(
                f"{where}; it appears only once, right after the leading system messages"
            )
        return self._verify(messages[system], thread_id, checkpoint_ns)

    def check_written(self, messages: Sequence[Any], *, thread_id: str, checkpoint_ns: str) -> None:
        """Refuse a pending write (a node's output, ``update_state``) carrying a summary message the
        service did not write for this thread: it would enter the state without passing :meth:`plan`.
        A ``RemoveMessage`` of the summary is the agent's to write: its state drops the summary, and the
        next cut starts a chain of its own.

        Raises:
            SummaryForgeryError: See :meth:`_read`.
        """
        if checkpoint_ns:  # a subgraph's write: checked when the subgraph's output reaches the root
            return
        sid = summary_message_id(thread_id, checkpoint_ns)
        for message in messages:
            if message_type(message) == "remove":
                continue
            if message_field(message, "id") == sid or _marked(message):
                self._verify(message, thread_id, checkpoint_ns)

    def _verify(self, message: Any, thread_id: str, checkpoint_ns: str) -> WindowSummary:
        """The state a summary message records, checked against the book."""
        where = f"message id {message_field(message, 'id')!r} is the service's running summary"
        kwargs = message_field(message, "additional_kwargs")
        mark = kwargs.get(MARK_KEY) if isinstance(kwargs, Mapping) else None
        if not is_summary_message(message) or not isinstance(mark, Mapping):
            raise SummaryForgeryError(f"{where}; a message of the client's own may not use it")
        state = WindowSummary.from_mark(mark)
        content = message_field(message, "content")
        cache_key = (
            thread_id,
            checkpoint_ns,
            hashlib.sha256(orjson.dumps([mark, content], default=str)).hexdigest(),
        )
        with self._lock:
            if cache_key in self._verified:
                self._verified.move_to_end(cache_key)
                return replace(state, text=self._text_of(content, state))
        wanted = [s for s in (state.step, *state.lagging) if s is not None]
        held = self.book.steps(thread_id, checkpoint_ns, wanted) if wanted else {}
        if not wanted or any(s not in held for s in wanted):
            raise SummaryForgeryError(f"{where}; it names a summary step the service does not hold")
        if state.step is not None:
            step = held[state.step]
            if step.status != "done" or step.version != state.version:
                raise SummaryForgeryError(f"{where}; it names a summary step that is not done")
            state = replace(state, text=step.text)
        lagging_messages = held[state.lagging[-1]].covered - state.covered if state.lagging else 0
        if state.lagging_messages != lagging_messages:
            raise SummaryForgeryError(f"{where}; it miscounts the messages awaiting a summary")
        if content != summary_content(state.text, state.lagging_messages):
            raise SummaryForgeryError(f"{where}; its content is not the summary the service wrote")
        with self._lock:
            self._verified[cache_key] = None
            while len(self._verified) > self._verified_capacity:
                self._verified.popitem(last=False)
        return state

    @staticmethod
    def _text_of(content: Any, state: WindowSummary) -> str | None:
        if state.step is None or not isinstance(content, str):
            return None
        text = content.removeprefix(SUMMARY_PREFIX)
        if state.lagging_messages:
            text = text.removesuffix(_PENDING_NOTE.format(count=state.lagging_messages)).removesuffix("\n\n")
        return text

    # -- a put -------------------------------------------------------------------------------------

    def plan(
        self, reducer: MessageReducer, messages: Sequence[Any], *, thread_id: str, checkpoint_ns: str
    ) -> SummaryPlan | None:
        """What a put of ``messages`` stores, or ``None`` to reduce without summaries (a subgraph's
        namespace, a thread not summarized, or a window holding a summary of LangChain's
        ``SummarizationMiddleware``).

        Raises:
            SummaryForgeryError: See :meth:`_read`.
        """
        if checkpoint_ns:
            return None
        messages = list(messages)
        system = reducer.system_length(messages)
        state = self._read(messages, system, thread_id, checkpoint_ns)
        if state.empty:
            foreign = any(is_summary_message(m) for m in messages)
            if foreign or not self.enabled(thread_id):
                return None
        head_messages = messages[:system]
        rest = messages[system + (0 if state.empty else 1) :]
        plan = SummaryPlan()
        changed = False

        # Steps lagging behind a hard-limit cut: fold in those done, in order. The window names the ends of
        # their chain; the book holds the links.
        lagging = list(state.lagging)
        tip_info: StepInfo | None = None  # the last lagging step: what a new step builds on
        if lagging:
            held = self.book.steps(thread_id, checkpoint_ns, lagging)
            tip_info = held.get(lagging[-1])
            first = held.get(lagging[0])
            if first is not None and first.status == "done" and tip_info is not None:
                chain = self.book.chain(thread_id, checkpoint_ns, tip_info.step_id, state.step)
                if chain and chain[0].base_step == state.step:
                    while chain and chain[0].status == "done":
                        state = state.advance(chain.pop(0))
                        changed = True
                    lagging = _ends([step.step_id for step in chain])
                    if not chain:
                        tip_info = None
        waiting_messages = tip_info.covered - state.covered if tip_info else 0
        state = replace(state, lagging=tuple(lagging), lagging_messages=waiting_messages)

        # The window as it will be stored: the summary (as it reads now) stands in the head.
        placeholder = self.message(thread_id, checkpoint_ns, state)

        def window(rest: list[Any]) -> list[Any]:
            return [*head_messages, placeholder, *rest]

        head = system + 1
        keys = [message_key(m, ()) for m in rest]
        waiting: StepInfo | None = None
        while rest and reducer.select(window(rest), head=head):
            tip = tip_info.step_id if tip_info is not None else state.step
            children = self.book.children(thread_id, checkpoint_ns, tip)
            fitting = [
                c
                for c in children
                if 0 < len(c.keys) < len(rest)
                and tuple(keys[: len(c.keys)]) == c.keys
                and reducer.is_valid_cut(window(rest), head, head + len(c.keys))
                # The same ids saying the same thing: a message edited since its step was asked for
                # makes another step, summarized from what the window holds now.
                and c.step_id == self._step_id(thread_id, c.base_step, c.keys, rest)
            ]
            done = [c for c in fitting if c.status == "done"] if not lagging else []
            if done:
                step = max(done, key=lambda c: len(c.keys))
                plan.removed += rest[: len(step.keys)]
                rest, keys = rest[len(step.keys) :], keys[len(step.keys) :]
                state = state.advance(step)
                changed = True
                continue
            waiting = max(fitting, key=lambda c: len(c.keys)) if fitting else None
            if waiting is None:
                count = reducer.select(window(rest), head=head)
                batch = rest[:count]
                waiting = self._request(thread_id, checkpoint_ns, tip_info, state, batch, keys[:count])
                plan.requested += batch
            break

        if self.hard_limit is not None and rest and self.hard_limit.select(window(rest), head=head):
            cut = self.hard_limit.select(window(rest), head=head)
            if waiting is not None and len(waiting.keys) >= cut:
                cut = len(waiting.keys)
            if waiting is not None:
                lagging = _ends([*lagging, waiting.step_id])
                tip_info = waiting
                covered = len(waiting.keys)
            else:
                covered = 0
            if cut > covered:
                extra = self._request(
                    thread_id, checkpoint_ns, tip_info, state, rest[covered:cut], keys[covered:cut]
                )
                plan.requested += rest[covered:cut]
                lagging = _ends([*lagging, extra.step_id])
                tip_info = extra
            plan.removed += rest[:cut]
            plan.uncovered = cut
            assert tip_info is not None  # cut > 0: the waiting step or the one just requested covers it
            rest = rest[cut:]
            state = replace(state, lagging=tuple(lagging), lagging_messages=tip_info.covered - state.covered)
            changed = True
            if self.on_uncovered is not None:
                self.on_uncovered(thread_id, cut)

        if not changed:
            return plan if plan.requested else SummaryPlan()
        summary = self.wrap(self.message(thread_id, checkpoint_ns, state))
        plan.messages = [*head_messages, summary, *rest]
        return plan

    def _step_id(self, thread_id: str, base: str | None, keys: Sequence[str], messages: Sequence[Any]) -> str:
        """The id of the step summarizing the first ``len(keys)`` of ``messages`` on top of ``base``."""
        return step_id(base, keys, self.fingerprint(thread_id, messages[: len(keys)]))

    def _request(
        self,
        thread_id: str,
        checkpoint_ns: str,
        lagging_tip: StepInfo | None,
        state: WindowSummary,
        batch: list[Any],
        keys: Sequence[str],
    ) -> StepInfo:
        """Ask the book for a step summarizing ``batch`` on top of the last lagging step, or of the summary's
        step when none lags (a lagging step is not done: its coverage counts its batch)."""
        base = lagging_tip if lagging_tip is not None else None
        tip = base.step_id if base is not None else state.step
        base_version = base.version if base is not None else state.version
        base_covered = base.covered if base is not None else state.covered
        request = StepRequest(
            thread_id=thread_id,
            checkpoint_ns=checkpoint_ns,
            step_id=self._step_id(thread_id, tip, keys, batch),
            base_step=tip,
            version=base_version + 1,
            keys=tuple(keys),
            batch=list(batch),
            covered=base_covered + len(batch),
        )
        self.book.request(request)
        if self.on_request is not None:
            self.on_request(thread_id)
        return StepInfo(request.step_id, tip, request.version, request.keys, "pending", request.covered)


def _ends(chain: Sequence[str]) -> list[str]:
    """The first and last of a chain of step ids (one id for a chain of one)."""
    return [] if not chain else [chain[0]] if len(chain) == 1 else [chain[0], chain[-1]]


def _marked(message: Any) -> bool:
    kwargs = message_field(message, "additional_kwargs")
    return isinstance(kwargs, Mapping) and MARK_KEY in kwargs


class MemorySummaryBook:
    """A :class:`SummaryBook` in a dict, for one process (in-process savers, ``memory://``, tests).

    Besides the book, it offers what a summarizer needs: :meth:`next_step`, :meth:`complete` (a
    compare-and-set: a step completes once) and :meth:`text`.
    """

    def __init__(self) -> None:
        self._steps: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._order: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def steps(self, thread_id: str, checkpoint_ns: str, step_ids: Sequence[str]) -> dict[str, StepInfo]:
        with self._lock:
            rows = (self._steps.get((thread_id, checkpoint_ns, s)) for s in step_ids)
            return {row["step_id"]: _info(row) for row in rows if row is not None}

    def children(self, thread_id: str, checkpoint_ns: str, base_step: str | None) -> list[StepInfo]:
        with self._lock:
            return [
                _info(row)
                for key in self._order
                if (row := self._steps[key])["thread_id"] == thread_id
                and row["checkpoint_ns"] == checkpoint_ns
                and row["base_step"] == base_step
            ]

    def request(self, step: StepRequest) -> None:
        key = (step.thread_id, step.checkpoint_ns, step.step_id)
        with self._lock:
            if key in self._steps:
                return
            self._steps[key] = {
                "thread_id": step.thread_id,
                "checkpoint_ns": step.checkpoint_ns,
                "step_id": step.step_id,
                "base_step": step.base_step,
                "version": step.version,
                "keys": step.keys,
                "batch": list(step.batch),
                "covered": step.covered,
                "status": "pending",
                "text": None,
            }
            self._order.append(key)

    def chain(self, thread_id: str, checkpoint_ns: str, tip: str, base: str | None) -> list[StepInfo]:
        with self._lock:
            found: list[StepInfo] = []
            row = self._steps.get((thread_id, checkpoint_ns, tip))
            while row is not None and len(found) <= len(self._order):
                found.append(_info(row))
                if row["base_step"] == base or row["base_step"] is None:
                    break
                row = self._steps.get((thread_id, checkpoint_ns, row["base_step"]))
            return found[::-1]

    def next_step(self) -> tuple[StepRequest, str | None] | None:
        """The oldest pending step whose base is done, with the base's text."""
        with self._lock:
            for key in self._order:
                row = self._steps[key]
                if row["status"] != "pending":
                    continue
                base = None
                if row["base_step"] is not None:
                    base = self._steps.get((row["thread_id"], row["checkpoint_ns"], row["base_step"]))
                    if base is None or base["status"] != "done":
                        continue
                request = StepRequest(
                    row["thread_id"],
                    row["checkpoint_ns"],
                    row["step_id"],
                    row["base_step"],
                    row["version"],
                    row["keys"],
                    list(row["batch"]),
                    row["covered"],
                )
                return request, base["text"] if base is not None else None
        return None

    def complete(self, step: StepRequest, text: str) -> bool:
        """Store a step's summary unless it is done already (compare-and-set); whether this call did."""
        with self._lock:
            row = self._steps.get((step.thread_id, step.checkpoint_ns, step.step_id))
            if row is None or row["status"] != "pending":
                return False
            row["status"], row["text"] = "done", text
            return True

    def delete_thread(self, thread_id: str) -> None:
        """Forget every step of a thread (``ReducingSaver.delete_thread`` calls it)."""
        with self._lock:
            self._drop([key for key in self._order if key[0] == thread_id])

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Give ``target_thread_id`` a copy of every step of ``source_thread_id`` it lacks
        (``ReducingSaver.copy_thread`` calls it, after the inner saver copied the checkpoints)."""
        with self._lock:
            for key in [key for key in self._order if key[0] == source_thread_id]:
                target = (target_thread_id, key[1], key[2])
                if target not in self._steps:
                    self._copy(key, target)

    # Under the lock; a subclass keeping more per step extends these.
    def _drop(self, keys: Sequence[tuple[str, str, str]]) -> None:
        for key in keys:
            self._order.remove(key)
            self._steps.pop(key, None)

    def _copy(self, key: tuple[str, str, str], target: tuple[str, str, str]) -> None:
        self._steps[target] = {**self._steps[key], "thread_id": target[0]}
        self._order.append(target)


def _info(row: Mapping[str, Any]) -> StepInfo:
    return StepInfo(
        row["step_id"],
        row["base_step"],
        row["version"],
        tuple(row["keys"]),
        row["status"],
        row["covered"],
        row["text"],
    )
