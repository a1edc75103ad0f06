"""The latest-checkpoint cache across replicas: two ``reducing-saver serve`` processes on one PostgreSQL.

Each replica answers a thread's latest checkpoint from its own memory once proven. Puts and put_writes
of one thread alternate between the replicas, then race from two writers at once; a reader asks both
replicas after every write and must never get an older checkpoint, or fewer pending writes, than the
newest committed before it asked.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph.checkpoint.base.id import uuid6
from prometheus_client.parser import text_string_to_metric_families

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import run_service

pytestmark = pytest.mark.e2e


def _put(saver: RemoteReducingSaver, thread: str, parent: dict | None, step: int) -> dict:
    """A put as LangGraph makes it (every channel's value, new versions for the changed ones): "step"
    changes every time, "notes" (a blob) every third step, "topic" once."""
    versions = dict(parent["channel_versions"]) if parent else {}
    values = dict(parent["channel_values"]) if parent else {}
    changed: dict[str, Any] = {"step": step}
    if step % 3 == 0:
        changed["notes"] = [f"note {step}", {"n": step}]
    if parent is None:
        changed["topic"] = "weather"
    new_versions = {channel: f"{step + 1:032}.{hash((thread, channel)) & 0xFFFF:016}" for channel in changed}
    versions.update(new_versions)
    checkpoint = {
        "v": 4,
        "id": str(uuid6()),
        "ts": "2026-01-01T00:00:00+00:00",
        "channel_values": {**values, **changed},
        "channel_versions": versions,
        "versions_seen": {},
        "updated_channels": sorted(changed),
    }
    configurable: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ""}
    if parent is not None:
        configurable["checkpoint_id"] = parent["id"]
    saver.put({"configurable": configurable}, checkpoint, {"source": "loop", "step": step}, new_versions)
    return checkpoint


def _head(thread: str, checkpoint_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}


def _latest(saver: RemoteReducingSaver, thread: str) -> Any:
    return saver.get_tuple({"configurable": {"thread_id": thread}})


def _counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "reducing_saver_latest_cache_total"
    }


def test_replicas_taking_turns_and_racing_on_one_thread_never_answer_an_older_checkpoint(
    tmp_path: Path, fresh_pg: str
) -> None:
    args = ("--database", fresh_pg, "--max-messages", "6", "--min-messages", "4")
    with run_service(tmp_path, *args) as first, run_service(tmp_path, *args) as second:
        savers = [RemoteReducingSaver(first.url), RemoteReducingSaver(second.url)]
        try:
            # Taking turns: every put and every write through the other replica than the one before.
            parent = None
            values: dict[str, Any] = {}
            for step in range(12):
                writer, other = savers[step % 2], savers[(step + 1) % 2]
                parent = _put(writer, "turns", parent, step)
                values.update(parent["channel_values"])
                for reader in savers:
                    got = _latest(reader, "turns")
                    assert got.checkpoint["id"] == parent["id"]
                    assert got.checkpoint["channel_values"] == values
                    assert got.pending_writes == []
                config = _head("turns", parent["id"])
                other.put_writes(config, [("step", step * 10)], f"task-{step}")
                writer.put_writes(config, [("notes", [f"write {step}"])], f"later-{step}")
                for reader in savers:
                    got = _latest(reader, "turns")
                    assert got.checkpoint["id"] == parent["id"]
                    assert sorted(got.pending_writes) == sorted(
                        [(f"task-{step}", "step", step * 10), (f"later-{step}", "notes", [f"write {step}"])]
                    )

            # Racing: two writers (one per replica) put and write at once; a reader checks both replicas.
            lock = threading.Lock()
            committed: dict[str, set[str]] = {}  # checkpoint id -> tasks whose writes committed
            newest = [""]
            stop = threading.Event()
            errors: list[BaseException] = []

            def write(index: int) -> None:
                saver = RemoteReducingSaver((first.url, second.url)[index])
                try:
                    parent = None
                    for step in range(15):
                        parent = _put(saver, "race", parent, step)
                        with lock:
                            committed[parent["id"]] = set()
                            newest[0] = max(newest[0], parent["id"])
                        config = _head("race", parent["id"])
                        saver.put_writes(config, [("step", step)], f"w{index}-{step}")
                        with lock:
                            committed[parent["id"]].add(f"w{index}-{step}")
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    saver.close()

            def read() -> None:
                try:
                    while not stop.is_set():
                        for reader in savers:
                            with lock:
                                floor = newest[0]
                                tasks = set(committed.get(floor, ()))
                            if not floor:
                                continue
                            got = _latest(reader, "race")
                            assert got.checkpoint["id"] >= floor, "older than the newest committed checkpoint"
                            if got.checkpoint["id"] == floor:
                                assert tasks <= {task for task, _, _ in got.pending_writes}, "writes missing"
                except BaseException as exc:
                    errors.append(exc)

            writers = [threading.Thread(target=write, args=(index,)) for index in (0, 1)]
            reader = threading.Thread(target=read)
            reader.start()
            for thread in writers:
                thread.start()
            for thread in writers:
                thread.join(timeout=120)
            stop.set()
            reader.join(timeout=30)
            assert not errors, errors
            for reader_saver in savers:
                assert _latest(reader_saver, "race").checkpoint["id"] == newest[0]

            for url in (first.url, second.url):
                counts = _counts(url)
                assert counts.get("hit", 0) > 0 and counts.get("stale", 0) > 0, counts
        finally:
            for saver in savers:
                saver.close()
