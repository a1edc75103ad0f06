"""Connections cut while idle, as a load balancer, a NAT gateway or a proxy with an idle timeout cuts them
(AWS NLB after 350 s, HAProxy's ``timeout client``...; 2 s here): the service reaches PostgreSQL through a
TCP proxy of the test's own that closes every connection that carried nothing for 2 s, and agents pause
longer than that between turns, so each turn finds its connections cut.
"""

from __future__ import annotations

import re
import threading

import httpx

from tests.support.fleet import Agent, lost_turns, running, wait_delivered
from tests.support.postgres import PG_HOST, PG_PORT
from tests.support.proxy import tcp_proxy
from tests.support.server import run_service

CUT_SECONDS = 2.0
PAUSE = 2.5


def test_connections_cut_while_idle_are_replaced_before_any_call_sees_them(
    fresh_pg, tmp_path, record_property
):
    with tcp_proxy((PG_HOST, int(PG_PORT)), idle_cut=CUT_SECONDS) as proxy:
        args = (
            "--database", proxy.url(fresh_pg),
            "--pool-size", "3",
            "--max-messages", "6",
            "--min-messages", "4",
            "--extraction-linger-seconds", "0",
            "--log-format", "text",
        )  # fmt: skip
        # A deliverer that polls the outbox seldom (puts that record pruned messages wake it): its polls would
        # keep the pool's connections busy.
        with run_service(tmp_path, *args, env={"REDUCING_SAVER_EXTRACTION_IDLE_SECONDS": "30"}) as service:
            answers: list[int] = []
            stop = threading.Event()
            probe = threading.Thread(target=_get_probe, args=(service.url, stop, answers), daemon=True)
            probe.start()
            # No retries: a cut connection a call met would fail the turn.
            agents = [Agent(f"idle-{n}", [service.url]) for n in range(2)]
            with running(agents, pause=PAUSE, client={"max_retries": 0}) as fleet:
                fleet.wait_for(16, timeout=120)
            stop.set()
            probe.join(30)
            wait_delivered(service.url)
            lost = lost_turns(agents, service.url, fresh_pg)
            metrics = httpx.get(f"{service.url}/metrics", timeout=10).text
            output = service.output()
            cuts = proxy.idle_cuts

    replaced = float(
        re.search(r"^reducing_saver_db_idle_connections_replaced_total (\S+)$", metrics, re.M).group(1)
    )
    record_property(
        "idle cut figures",
        f"connections cut after {CUT_SECONDS:g} s idle: {cuts}; replaced before use: {replaced:g}; {fleet.figures()} "
        f"(no client retries), probe calls {len(answers)}, {sum(status != 200 for status in answers)} not 200, "
        f"{sum(map(len, lost.values()))} messages lost",
    )
    assert cuts >= 8, "the proxy cut too little for the test to prove anything"
    assert fleet.failed() == 0, [error for agent in agents for _, error in agent.failures][:3]
    assert answers and set(answers) == {200}, answers
    assert not lost, lost
    assert replaced >= 5
    assert "Traceback" not in output and " ERROR " not in output, output[-3000:]


def _get_probe(url: str, stop: threading.Event, answers: list[int]) -> None:
    """A read every 2.5 s, on a connection idle long enough to have been cut, without retries."""
    body = {"config": {"configurable": {"thread_id": "idle-probe", "checkpoint_ns": ""}}}
    while not stop.wait(PAUSE):
        answers.append(httpx.post(f"{url}/v1/checkpoints/get", json=body, timeout=30).status_code)
