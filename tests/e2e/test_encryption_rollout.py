"""The rollout off -> migrate: two real service processes, one ``--encryption off`` and one ``--encryption
migrate``, serve one PostgreSQL database at once, both delivering to long-term memory and summarizing.

Agents of some threads talk to the ``off`` replica until it refuses them (a thread whose summary the
sealing process wrote), then to the other; agents of other threads talk to ``migrate`` only. Whatever the mix, every
pruned message reaches memory with its content, every fact reaches the summary, nothing becomes a dead
letter, and the ``off`` replica never hands a sealed value on as data: it refuses it, naming
``--encryption off``.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from langchain_core.messages import HumanMessage

from reducing_saver.client import RemoteReducingSaver, RemoteStore, ServerUnavailableError
from reducing_saver.reducer import SUMMARY_PREFIX, summary_message_id
from tests.support.chat import build_chat_graph
from tests.support.encryption import new_key, ring_json
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

ARGS = (
    "--max-messages",
    "6",
    "--min-messages",
    "4",
    "--summarizer",
    "tests.support.summarizers:flaky",
    "--extraction-linger-seconds",
    "0",
    "--no-sweep",
)
OFF_FIRST, KEYED_ONLY = ["off-1", "off-2", "off-3"], ["keyed-1", "keyed-2"]
TURNS = 8


def _count(database: str, sql: str) -> int:
    with psycopg.connect(database) as conn:
        return conn.execute(sql).fetchone()[0]


def _settled(database: str) -> bool:
    return (
        _count(database, "SELECT count(*) FROM reducing_saver_outbox WHERE status <> 'done'") == 0
        and _count(database, "SELECT count(*) FROM reducing_saver_summaries WHERE status <> 'done'") == 0
    )


def _wait(what: str, condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_an_off_and_a_migrate_replica_on_one_database_lose_and_leak_nothing(
    fresh_pg, tmp_path, record_property
):
    ring = ring_json("k1", k1=new_key())
    env = {"REDUCING_SAVER_EXTRACTION_IDLE_SECONDS": "0.1"}
    with (
        run_service(
            tmp_path,
            "--database",
            fresh_pg,
            *ARGS,
            "--encryption",
            "migrate",
            env={**env, "REDUCING_SAVER_ENCRYPTION_KEYS": ring},
        ) as keyed,
        # The off replica's model is slower: the keyed one summarizes some of the off replica's threads
        # (sealing their summaries) and the off one meets those summaries.
        run_service(
            tmp_path, "--database", fresh_pg, *ARGS, env={**env, "RS_TEST_SUMMARY_DELAY": "0.3"}
        ) as off,
        RemoteReducingSaver(keyed.url, max_retries=0) as keyed_saver,
        RemoteReducingSaver(off.url, max_retries=0) as off_saver,
    ):
        graphs = {
            thread: build_chat_graph(keyed_saver, prefix=thread, length=40)
            for thread in OFF_FIRST + KEYED_ONLY
        }
        on_off = set(OFF_FIRST)  # threads the off replica still serves
        refusals: list[str] = []
        for turn in range(TURNS):
            for thread, graph in graphs.items():
                message = HumanMessage(f"FACT: {thread} said {turn}", id=f"{thread}-h-{turn}")
                config = {"configurable": {"thread_id": thread}}
                if thread in on_off:
                    graph.checkpointer = off_saver
                    try:
                        graph.invoke({"messages": [message]}, config)
                        continue
                    except ServerUnavailableError as exc:  # a load balancer would send it elsewhere
                        refusals.append(str(exc))
                        on_off.discard(thread)
                graph.checkpointer = keyed_saver
                graph.invoke({"messages": [message]}, config)

        _wait("both replicas to deliver and summarize", lambda: _settled(fresh_pg))
        for thread, graph in graphs.items():  # one more turn each folds the summaries done meanwhile
            graph.checkpointer = keyed_saver
            graph.invoke(
                {"messages": [HumanMessage(f"FACT: {thread} last", id=f"{thread}-h-last")]},
                {"configurable": {"thread_id": thread}},
            )
        _wait("the last turns' batches", lambda: _settled(fresh_pg))

        # The off replica refused, clearly, what it could not read; it served some threads to the end.
        record_property(
            "rollout figures",
            f"{len(refusals)} refusal(s) by the off replica; it served {len(on_off)} of {len(OFF_FIRST)} threads to the end",
        )
        assert all(
            "--encryption off" in refusal and "reducing-saver/aesgcm" not in refusal for refusal in refusals
        ), refusals
        assert _count(fresh_pg, "SELECT count(*) FROM reducing_saver_outbox WHERE status = 'dead'") == 0
        assert _count(fresh_pg, "SELECT count(*) FROM reducing_saver_summaries WHERE status = 'dead'") == 0
        for thread in OFF_FIRST + KEYED_ONLY:
            window = keyed_saver.get_tuple({"configurable": {"thread_id": thread}}).checkpoint[
                "channel_values"
            ]["messages"]
            (summary,) = [m for m in window if m.id == summary_message_id(thread, "")]
            seen = summary.content.removeprefix(SUMMARY_PREFIX).splitlines()
            seen += [m.content for m in window if isinstance(m, HumanMessage) and m is not summary]
            expected = {f"FACT: {thread} said {turn}" for turn in range(TURNS)} | {f"FACT: {thread} last"}
            assert expected <= set(seen), (thread, sorted(expected - set(seen)))

        # Long-term memory: every pruned message with its content, read through the keyed replica; the
        # off replica returns the plain ones and refuses the sealed ones, never an envelope as a value.
        rows = _count(fresh_pg, "SELECT count(*) FROM reducing_saver_outbox")
        with (
            RemoteStore(keyed.url, max_retries=0) as keyed_store,
            RemoteStore(off.url, max_retries=0) as off_store,
        ):
            items = [
                item for thread in graphs for item in keyed_store.search(("memories", thread), limit=100)
            ]
            assert len(items) == rows > 0
            assert all(
                isinstance(item.value["data"].get("content"), str) and item.value["data"]["content"]
                for item in items
            ), [item.value for item in items if "data" not in item.value][:3]
            refused = 0
            for item in items:
                try:
                    plain = off_store.get(tuple(item.namespace), item.key)
                except ServerUnavailableError as exc:
                    assert "--encryption off" in str(exc)
                    refused += 1
                else:
                    assert plain.value == item.value
            assert refused > 0  # the keyed replica's deliveries are sealed
