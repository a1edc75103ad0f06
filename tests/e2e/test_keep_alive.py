"""An idle client connection is closed by the client, not under its next call by the service."""

from __future__ import annotations

import asyncio
import logging
import time

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import run_service

CONFIG = {"configurable": {"thread_id": "keep-alive", "checkpoint_ns": ""}}
#: Longer than uvicorn's own default keep-alive (5 s), shorter than the async client's (15 s).
IDLE_SECONDS = 6.5


def test_a_call_after_the_client_sat_idle_needs_no_retry(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="reducing_saver.client")

    async def calls() -> None:
        async with RemoteReducingSaver(service.url) as saver:
            assert await saver.aget_tuple(CONFIG) is None
            # The loop busy (a node computing), so the client cannot notice a close until it sends.
            time.sleep(IDLE_SECONDS)  # noqa: ASYNC251 - blocking the loop is the point
            assert await saver.aget_tuple(CONFIG) is None

    with run_service(tmp_path, "--database", "memory://") as service:
        asyncio.run(calls())
    retries = [
        record.getMessage() for record in caplog.records if record.name.startswith("reducing_saver.client")
    ]
    assert retries == []
