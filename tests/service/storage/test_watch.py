"""The storage gauges of /metrics: per tenant, bounded label values, measured in a thread of their own and
answered from memory at scrape time (in-process app, real client, real chat graph, every backend)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from reducing_saver.service.storage import watch as storage_watch
from reducing_saver.service.storage.usage import ThreadStorage
from reducing_saver.service.storage.watch import KINDS, per_tenant
from tests.service.storage.test_usage import KEYS, converse, database, running  # noqa: F401 (fixture)


def gauges(text: str) -> dict[tuple[str, ...], float]:
    """``(metric, tenant[, kind])`` -> value, for the storage gauges of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("reducing_saver_storage_") and "tenant" in sample.labels:
                key = (
                    sample.name,
                    sample.labels["tenant"],
                    *([sample.labels["kind"]] if "kind" in sample.labels else []),
                )
                out[key] = sample.value
    return out


def wait_for_first_pass(service, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while service.storage_watch.refreshed_at == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_gauges_add_up_each_tenants_threads_and_scrapes_never_measure(database: str) -> None:  # noqa: F811
    api_keys = ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())
    with running(database, api_keys=api_keys, metrics_key="scraper-key", storage_refresh_seconds=3600) as run:
        wait_for_first_pass(run.service)
        with run.saver(KEYS["a"]) as a, run.saver(KEYS["b"]) as b:
            converse(a, "one", 8, seed=1)
            converse(a, "two", 3, seed=2)
            converse(b, "one", 2, seed=3)
        run.delivered(8 * 2 - 6)
        headers = {"x-api-key": "scraper-key"}  # the metrics scraper's, no tenant's
        # The pass ran before the traffic; a scrape answers from it, measuring nothing.
        measured = []
        backend = run.service.open_backend()
        original = backend.storage
        backend.storage = lambda *args, **kwargs: (
            measured.append(threading.current_thread().name) or original(*args, **kwargs)
        )
        before = gauges(run.http.get("/metrics", headers=headers).text)
        assert not any(
            key[0] == "reducing_saver_storage_bytes" for key in before
        )  # no thread yet at that pass
        assert measured == []
        run.service.storage_watch.refresh()
        after = gauges(run.http.get("/metrics", headers=headers).text)
        for tenant, key in KEYS.items():
            summary = run.http.get("/v1/storage", headers={"x-api-key": key}).json()
            for kind, field in KINDS.items():
                assert after[("reducing_saver_storage_bytes", tenant, kind)] == summary[field]
            assert after[("reducing_saver_storage_plain_estimate_bytes", tenant)] == summary["plain_estimate"]
            assert after[("reducing_saver_storage_threads", tenant)] == summary["threads"]
            assert after[("reducing_saver_storage_checkpoints", tenant)] == summary["checkpoints"]
        assert {key[1] for key in after} == {"a", "b"}


def test_the_background_pass_runs_off_the_event_loop_and_repeats(database: str) -> None:  # noqa: F811
    with running(database, storage_refresh_seconds=0.2) as run:
        backend = run.service.open_backend()
        threads = []
        original = backend.storage
        backend.storage = lambda *args, **kwargs: (
            threads.append(threading.current_thread().name) or original(*args, **kwargs)
        )
        with run.saver() as saver:
            converse(saver, "t", 2)
        deadline = time.monotonic() + 10
        while (figures := gauges(run.http.get("/metrics").text)).get(
            ("reducing_saver_storage_threads", "default")
        ) != 1:
            assert time.monotonic() < deadline, figures
            time.sleep(0.05)
        assert threads and set(threads) == {"storage-watch"}
        assert {key[1] for key in figures} == {"default"}


def test_tenants_without_a_key_and_past_the_cap_count_as_other(monkeypatch: pytest.MonkeyPatch) -> None:
    def thread(tenant: str, size: int) -> ThreadStorage:
        return ThreadStorage(
            f"{tenant}:t", tenant=tenant, checkpoints=1, checkpoint_bytes=size, plain_estimate=2 * size
        )

    threads = [thread("a", 10), thread("b", 30), thread("c", 20), thread("gone", 5)]
    monkeypatch.setattr(storage_watch, "MAX_TENANT_LABELS", 2)
    figures = per_tenant(threads, frozenset({"a", "b", "c"}))
    assert set(figures) == {"b", "c", "other"}
    assert figures["other"].bytes["checkpoints"] == 15 and figures["other"].threads == 2
    assert figures["other"].plain_estimate == 30
    assert set(per_tenant(threads, None)) == {"default"}


def test_zero_turns_the_gauges_off() -> None:
    with running("memory://", storage_refresh_seconds=0) as run:
        assert run.service.storage_watch is None
        assert "reducing_saver_storage_" not in run.http.get("/metrics").text
