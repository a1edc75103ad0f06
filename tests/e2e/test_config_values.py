"""A run config's values travel to checkpoint metadata as they do into a stock saver's, big ints included.

LangGraph merges the primitive values of ``config["metadata"]`` and ``config["configurable"]`` into
every checkpoint's metadata (``get_checkpoint_metadata``). An int beyond 64 bits there (a run id, a
score from a JSONB round trip) used to be dropped on the way to the service.
"""

from __future__ import annotations

import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.postgres import PostgresSaver

from reducing_saver.client import RemoteReducingSaver
from tests.support.server import run_service

pytestmark = pytest.mark.e2e

BIG = 2**70


def _config(thread_id: str) -> dict:
    return {
        "configurable": {
            "thread_id": thread_id,
            "checkpoint_ns": "",
            "run_big": BIG,
            "run_neg": -(2**80),
            "small": 5,
            "shadowed": BIG,  # config["metadata"] comes first: its "shadowed" wins
        },
        "metadata": {
            "meta_big": 3**50,
            "shadowed": "from metadata",
            "step": BIG,
        },  # "step": metadata's own wins
    }


def _stored_metadata(saver, thread_id: str) -> dict:
    checkpoint = empty_checkpoint()
    saver.put(_config(thread_id), checkpoint, {"source": "input", "step": -1}, {})
    return saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}).metadata


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgres"])
def test_big_ints_of_a_run_config_reach_checkpoint_metadata_as_in_a_stock_saver(
    backend, tmp_path, make_database
):
    # PostgresSaver keeps them (JSONB holds any int); InMemorySaver's msgpack cannot write them at all.
    with PostgresSaver.from_conn_string(make_database()) as stock:
        stock.setup()
        expected = _stored_metadata(stock, "stock")
    assert expected["run_big"] == BIG and expected["meta_big"] == 3**50  # what the stock saver keeps
    database = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{tmp_path}/config.sqlite",
        "postgres": make_database(),
    }[backend]
    with run_service(tmp_path, "--database", database) as service:
        for body_format in ("msgpack", "json"):
            with RemoteReducingSaver(service.url, body_format=body_format) as saver:
                stored = _stored_metadata(saver, f"remote-{body_format}")
                assert stored == expected, body_format
                listed = next(saver.list({"configurable": {"thread_id": f"remote-{body_format}"}}))
                assert listed.metadata == expected
