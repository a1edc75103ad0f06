"""langgraph-checkpoint-conformance through RemoteReducingSaver against a real uvicorn process.

The suite awaits only, and silently skips capabilities it does not detect: so each run asserts the
exact detected set, and a second run goes through the client's *sync* methods.
"""

from __future__ import annotations

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import Capability, DetectedCapabilities

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import run_service
from tests.support.sync_adapter import SyncAdapter

# The service gives every backend copy_thread, delete_for_runs and prune, so the suite detects all
# eight capabilities everywhere.
ALL = {cap.value for cap in Capability}
EXPECTED = {"memory": ALL, "sqlite": ALL, "postgres": ALL}
SERVICE_CAPABILITIES = {
    backend: ["copy_thread", "delete_for_runs", "delta_channel_history", "prune"] for backend in EXPECTED
}


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def service(request, tmp_path, fresh_pg):
    database = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp_path}/checkpoints.sqlite",
        "postgres": fresh_pg,
    }[request.param]
    with run_service(tmp_path, "--database", database) as process:
        yield request.param, process


def _report_failures(report) -> str:
    lines = []
    for name, result in report.results.items():
        for failure in result.failures or ():
            lines.append(f"{name}: {failure}")
    return "\n".join(lines)


@pytest.mark.parametrize("api", ["async", "sync"])
async def test_conformance(service, api):
    backend, process = service
    clients: list[RemoteReducingSaver] = []

    @checkpointer_test(name=f"remote-{backend}-{api}")
    async def factory():
        client = RemoteReducingSaver(process.url)
        clients.append(client)
        yield client if api == "async" else SyncAdapter(client)

    report = await validate(factory)
    for client in clients:
        client.close()
        await client.aclose()

    detected = {name for name, result in report.results.items() if result.detected}
    assert detected == EXPECTED[backend]
    assert report.passed_all(), _report_failures(report)
    for name in detected:
        assert report.results[name].tests_passed > 0, name

    with RemoteReducingSaver(process.url) as client:
        assert sorted(client.capabilities) == SERVICE_CAPABILITIES[backend]
        assert {c.value for c in DetectedCapabilities.from_instance(client).detected} == EXPECTED[backend]
