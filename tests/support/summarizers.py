"""Summarizers for tests: deterministic, so a test can say what a summary must hold.

``facts`` keeps every line tagged ``FACT:`` of the previous summary and of the batch, in order;
``verbatim`` keeps every line of both (whatever a cut message said is in its summary). ``flaky``
does the same but fails a share RS_TEST_SUMMARY_FAIL_RATE of its calls, and records every call that
returned in the table ``summarizer_calls`` of the database RS_TEST_CALLS_DB (when set), so a test can
count model calls across processes; RS_TEST_SUMMARY_DELAY slows each call down (seconds). ``failing``
fails every call. ``gated`` is ``verbatim`` once :data:`GATE` is set (in-process tests: a summarizer
that takes as long as the test wants).
"""

from __future__ import annotations

import os
import random
import threading
import time

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage


class FlakySummarizerError(RuntimeError):
    pass


def facts(previous: str | None, messages: list[BaseMessage]) -> str:
    lines = [line for line in (previous or "").splitlines() if line]
    for message in messages:
        lines += [line for line in str(message.content).splitlines() if line.startswith("FACT:")]
    return "\n".join(lines)


def verbatim(previous: str | None, messages: list[BaseMessage]) -> str:
    lines = [line for line in (previous or "").splitlines() if line]
    for message in messages:
        lines += [line for line in str(message.content).splitlines() if line]
    return "\n".join(lines)


async def async_facts(previous: str | None, messages: list[BaseMessage]) -> str:
    return facts(previous, messages)


def flaky(previous: str | None, messages: list[BaseMessage]) -> str:
    time.sleep(float(os.environ.get("RS_TEST_SUMMARY_DELAY", "0")))
    if random.random() < float(os.environ.get("RS_TEST_SUMMARY_FAIL_RATE", "0")):
        raise FlakySummarizerError("the summarizer failed on purpose")
    text = facts(previous, messages)
    if url := os.environ.get("RS_TEST_CALLS_DB"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS summarizer_calls (pid integer, first_key text, n integer)"
            )
            conn.execute(
                "INSERT INTO summarizer_calls VALUES (%s, %s, %s)",
                (os.getpid(), messages[0].id, len(messages)),
            )
    return text


#: Opened by a test when ``gated`` may answer.
GATE = threading.Event()


def gated(previous: str | None, messages: list[BaseMessage]) -> str:
    if not GATE.wait(60):
        raise FlakySummarizerError("the gate stayed closed")
    return verbatim(previous, messages)


def failing(previous: str | None, messages: list[BaseMessage]) -> str:
    """A summarizer whose every call fails: its batches become dead letters."""
    raise FlakySummarizerError(f"no model for {messages[0].id if messages else 'an empty batch'}")


#: A chat model answering every prompt with the same summary (`--summarizer` naming a BaseChatModel).
chat_model = GenericFakeChatModel(messages=iter([AIMessage("the user likes tea")] * 1000))

not_callable = 42
