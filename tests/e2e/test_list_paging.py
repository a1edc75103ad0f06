"""``checkpoints/list`` never answers more than ``max_list_limit`` checkpoints; the client pages past it.

``{"limit": null}`` used to return every checkpoint of the database in one answer. Now a missing limit
is one page of ``max_list_limit``, and ``RemoteReducingSaver.list`` (and ``alist``) still yields every
checkpoint by asking for the next page below the last checkpoint it got (``before``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import START, StateGraph
from typing_extensions import TypedDict

from reducing_saver.client import RemoteReducingSaver
from reducing_saver.wire import LIST_PATH
from tests.client.test_client import FakeService, config, make_saver
from tests.support.server import run_service

CAP = 3


class State(TypedDict):
    value: int


def counter(checkpointer: Any) -> Any:
    builder = StateGraph(State)
    builder.add_node("inc", lambda state: {"value": state["value"] + 1})
    builder.add_edge(START, "inc")
    return builder.compile(checkpointer=checkpointer)


class Counting(httpx.HTTPTransport):
    """Records how many checkpoints each list answer held."""

    def __init__(self) -> None:
        super().__init__()
        self.pages: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == LIST_PATH:
            response.read()
            self.pages.append(len(orjson.loads(response.content)["checkpoints"]))
        return response


class AsyncCounting(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.pages: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == LIST_PATH:
            await response.aread()
            self.pages.append(len(orjson.loads(response.content)["checkpoints"]))
        return response


def ids(items: Any) -> list[str]:
    return [item.config["configurable"]["checkpoint_id"] for item in items]


def test_list_answers_at_most_the_cap_and_the_client_pages_through_everything(tmp_path, fresh_pg):
    env = {"REDUCING_SAVER_MAX_LIST_LIMIT": str(CAP)}
    with run_service(tmp_path, "--database", fresh_pg, "--no-sweep", "--no-extract", env=env) as service:
        counting = Counting()
        with RemoteReducingSaver(service.url, transport=counting) as saver:
            assert saver.max_list_limit == CAP
            graph = counter(saver)
            for thread in ("a", "b"):
                for start in range(3):  # 3 runs of 3 checkpoints each: 9 a thread, 18 in all
                    graph.invoke({"value": start}, {"configurable": {"thread_id": thread}})

            # The route itself: a null limit is one page of the cap, a larger limit is refused.
            for body in ({"config": None, "limit": None}, {"config": None}, {"config": None, "limit": CAP}):
                answer = httpx.post(service.url + LIST_PATH, json=body)
                assert answer.status_code == 200
                assert len(answer.json()["checkpoints"]) == CAP
            assert (
                httpx.post(service.url + LIST_PATH, json={"config": None, "limit": CAP + 1}).status_code
                == 422
            )

            with PostgresSaver.from_conn_string(fresh_pg) as stock:
                thread_a = {"configurable": {"thread_id": "a"}}
                cases = [
                    ((None,), {}),
                    ((thread_a,), {}),
                    ((thread_a,), {"filter": {"source": "loop"}}),
                    ((None,), {"filter": {"step": 0}}),
                    ((thread_a,), {"limit": CAP + 2}),
                    ((None,), {"limit": 2 * CAP}),
                    ((None,), {"limit": 1}),
                ]
                expected_all = ids(stock.list(None))
                assert len(expected_all) == 18
                cases.append(((None,), {"before": {"configurable": {"checkpoint_id": expected_all[4]}}}))
                cases.append(
                    (
                        (thread_a,),
                        {"before": {"configurable": {"checkpoint_id": expected_all[1]}}, "limit": 4},
                    )
                )
                cases.append(
                    (
                        (None,),
                        {
                            "filter": {"source": "loop"},
                            "before": {"configurable": {"checkpoint_id": expected_all[2]}},
                        },
                    )
                )
                for args, kwargs in cases:
                    expected = ids(stock.list(*args, **kwargs))
                    assert ids(saver.list(*args, **kwargs)) == expected, (args, kwargs)
                    assert len(set(expected)) == len(expected)

                async def alist_all() -> list[tuple[list[str], list[str]]]:
                    async_counting = AsyncCounting()
                    async with RemoteReducingSaver(
                        service.url, async_transport=async_counting
                    ) as async_saver:
                        results = []
                        for args, kwargs in cases:
                            got = [item async for item in async_saver.alist(*args, **kwargs)]
                            results.append((ids(got), ids(stock.list(*args, **kwargs))))
                    assert async_counting.pages and max(async_counting.pages) <= CAP
                    return results

                for got, expected in asyncio.run(alist_all()):
                    assert got == expected

        assert counting.pages and max(counting.pages) <= CAP
        assert len(counting.pages) > len(cases)  # some lists did take several pages


def test_a_service_that_does_not_say_its_cap_gets_the_request_as_asked():
    service = FakeService()  # its capabilities have no "limits"
    saver = make_saver(service)
    assert saver.max_list_limit is None
    list(saver.list(config()))
    list(saver.list(config(), limit=5000))
    assert [body["limit"] for body in service.bodies("/checkpoints/list")] == [None, 5000]
