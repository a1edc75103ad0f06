"""Extractors for service processes under test.

``counting`` records every call it completes in the table ``extractor_calls`` of the database named by
RS_TEST_CALLS_DB (so a test can count deliveries across processes), fails a share RS_TEST_FAIL_RATE of
its calls before doing anything, and writes the messages into the store as the default extractor would.
"""

from __future__ import annotations

import os
import random

import psycopg
from langchain_core.messages import BaseMessage, message_to_dict

_CREATE = (
    "CREATE TABLE IF NOT EXISTS extractor_calls "
    "(namespace text[] NOT NULL, key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now())"
)


class FlakyExtractorError(RuntimeError):
    pass


def counting(messages: list, namespace: tuple[str, ...], store) -> None:
    if random.random() < float(os.environ.get("RS_TEST_FAIL_RATE", "0")):
        raise FlakyExtractorError("the extractor failed on purpose")
    for message in messages:
        value = message_to_dict(message) if isinstance(message, BaseMessage) else {"data": message}
        store.put(namespace, message.id if isinstance(message, BaseMessage) else message["id"], value)
    with psycopg.connect(os.environ["RS_TEST_CALLS_DB"], autocommit=True) as conn:
        conn.execute(_CREATE)
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO extractor_calls (namespace, key, pid) VALUES (%s, %s, %s)",
                [
                    (list(namespace), m.id if isinstance(m, BaseMessage) else m["id"], os.getpid())
                    for m in messages
                ],
            )


def slow(messages: list, namespace: tuple[str, ...], store) -> None:
    """Takes RS_TEST_EXTRACT_SECONDS before writing the messages as ``counting`` does (without counting):
    a deliverer holds its claim meanwhile."""
    import time

    time.sleep(float(os.environ.get("RS_TEST_EXTRACT_SECONDS", "5")))
    for message in messages:
        value = message_to_dict(message) if isinstance(message, BaseMessage) else {"data": message}
        store.put(namespace, message.id if isinstance(message, BaseMessage) else message["id"], value)


# -- an LLM-shaped extractor, as a user would write one (docs/memory.md, "A custom extractor") --------

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402

EXTRACT_PROMPT = "List the durable facts about the user in these messages, one per line."


def facts(messages: list, namespace: tuple[str, ...], store) -> None:
    """Ask a chat model for facts in the pruned messages and store each one under the namespace."""
    humans = [m for m in messages if isinstance(m, HumanMessage)]
    if not humans:
        return
    # A fake chat model stands in for a real one (no network in tests): one "fact" per human message.
    model = GenericFakeChatModel(
        messages=iter([AIMessage("\n".join(f"user said: {m.content[:40]}" for m in humans))])
    )
    answer = model.invoke([SystemMessage(EXTRACT_PROMPT), *messages])
    for index, line in enumerate(answer.content.splitlines()):
        store.put(namespace, f"{humans[0].id}-fact-{index}", {"fact": line})
