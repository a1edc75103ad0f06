"""langgraph-checkpoint-conformance through RemoteReducingSaver against a service in ``--encryption
required`` mode, on the three backends: every value stored is an envelope, and the saver contract holds.
"""

from __future__ import annotations

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import Capability

from reducing_saver.client import RemoteReducingSaver
from tests.e2e.test_conformance import _report_failures
from tests.support.encryption import new_key, ring_json
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

# Every capability the suite knows, the DeltaChannel history included (the service opens it itself).
EXPECTED = {cap.value for cap in Capability}


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def service(request, tmp_path, fresh_pg):
    database = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp_path}/checkpoints.sqlite",
        "postgres": fresh_pg,
    }[request.param]
    env = {"REDUCING_SAVER_ENCRYPTION_KEYS": ring_json("k1", k1=new_key())}
    with run_service(tmp_path, "--database", database, "--encryption", "required", env=env) as process:
        yield request.param, process


async def test_conformance_required(service):
    backend, process = service
    clients: list[RemoteReducingSaver] = []

    @checkpointer_test(name=f"encrypted-{backend}")
    async def factory():
        client = RemoteReducingSaver(process.url)
        clients.append(client)
        yield client

    report = await validate(factory)
    for client in clients:
        await client.aclose()
        client.close()
    detected = {name for name, result in report.results.items() if result.detected}
    assert detected == EXPECTED
    assert report.passed_all(), _report_failures(report)
    with RemoteReducingSaver(process.url) as client:
        assert sorted(client.capabilities) == [
            "copy_thread",
            "delete_for_runs",
            "delta_channel_history",
            "prune",
        ]
