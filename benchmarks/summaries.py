"""Running summaries: what the agent's model is sent per turn, with the service's window and summary
against plain ``add_messages`` (the whole history), and what the summarizer itself costs.

    .venv/bin/python -m benchmarks.summaries [--turns 200] [--max-messages 20] [--min-messages 12]
                                             [--agents 32 --agent-turns 50]

Creates a PostgreSQL database of its own (dropped afterwards), starts ``reducing-saver serve`` on it with
``--summarizer benchmarks.summaries:summarize`` (a deterministic extractive summarizer, so the run needs no
model and is repeatable), runs one conversation through ``RemoteReducingSaver`` and the same conversation
on a plain ``InMemorySaver``, and prints one line (``--json`` for the figures). Every message carries one
``FACT:`` line; the summarizer keeps those, so the summary grows until ``--summary-max-tokens`` caps it.
Tokens are langchain_core's ``count_tokens_approximately`` of the list the chat node hands its model;
the summarizer's are the service's own counters (``reducing_saver_summary_*_tokens_total``).

``--agents N`` then runs N agents at once (threads, each its own thread id and client), not waiting for
the summarizer, and samples the summary lag (messages awaiting a summary, the oldest batch's age) from
``/metrics`` every 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import DEFAULT_SERVER, scratch_database, text

ROOT = Path(__file__).resolve().parents[1]


def summarize(previous: str | None, messages: list[Any]) -> str:
    """The previous summary plus each new message's ``FACT:`` line (the service caps the result)."""
    lines = [line for line in (previous or "").splitlines() if line]
    for message in messages:
        lines += [line for line in str(message.content).splitlines() if line.startswith("FACT:")]
    return "\n".join(lines)


def _graph(checkpointer: Any, sent: list[int]) -> Any:
    from langchain_core.messages import AIMessage
    from langchain_core.messages.utils import count_tokens_approximately
    from langgraph.graph import START, MessagesState, StateGraph

    def bot(state: MessagesState) -> dict[str, list[AIMessage]]:
        sent.append(count_tokens_approximately(state["messages"]))  # what a model would be sent
        turn = len(sent)
        return {
            "messages": [AIMessage(f"FACT: answer {turn} is {text(f'a{turn}', 24)}\n{text(f'ai-{turn}')}")]
        }

    builder = StateGraph(MessagesState)
    builder.add_node("bot", bot)
    builder.add_edge(START, "bot")
    return builder.compile(checkpointer=checkpointer)


def _converse(graph: Any, turns: int, thread: str, after_turn: Any = None) -> None:
    from langchain_core.messages import HumanMessage

    config = {"configurable": {"thread_id": thread}}
    for turn in range(turns):
        graph.invoke(
            {
                "messages": [
                    HumanMessage(f"FACT: user fact {turn} is {text(f'u{turn}', 24)}\n{text(f'user-{turn}')}")
                ]
            },
            config,
        )
        if after_turn is not None:
            after_turn()


def _metrics(url: str) -> dict[str, float]:
    import httpx

    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("reducing_saver_summary_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _wait(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _metrics(url).get("reducing_saver_summary_pending_steps", 1) and time.monotonic() < deadline:
        time.sleep(0.02)


def _start(database: str, folder: str, port: int, args: list[str]) -> subprocess.Popen:
    import httpx

    command = [
        str(Path(sys.executable).with_name("reducing-saver")),
        "serve",
        "--database",
        database,
        "--port",
        str(port),
        "--summarizer",
        "benchmarks.summaries:summarize",
        "--log-level",
        "warning",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(Path(folder) / "service.log", "wb") as log:
        service = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        if service.poll() is not None or time.monotonic() > deadline:
            service.kill()
            raise RuntimeError((Path(folder) / "service.log").read_text())
        time.sleep(0.1)


def run_lag(agents: int, turns: int, max_messages: int, min_messages: int, server: str) -> dict[str, Any]:
    """N agents at once; the summary lag sampled while they talk, and how long the summarizer takes to
    catch up once they stop."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from reducing_saver.client import RemoteReducingSaver
    from tests.support.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with scratch_database(server) as database, tempfile.TemporaryDirectory() as folder:
        service = _start(
            database, folder, port, ["--max-messages", str(max_messages), "--min-messages", str(min_messages)]
        )
        try:
            samples: list[tuple[float, float]] = []
            done = threading.Event()

            def sample() -> None:
                while not done.wait(0.1):
                    figures = _metrics(url)
                    samples.append(
                        (
                            figures.get("reducing_saver_summary_lag_messages", 0),
                            figures.get("reducing_saver_summary_oldest_pending_age_seconds", 0),
                        )
                    )

            def agent(index: int) -> None:
                with RemoteReducingSaver(url) as saver:
                    _converse(_graph(saver, []), turns, f"agent-{index}")

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started = time.monotonic()
            with ThreadPoolExecutor(agents) as pool:
                list(pool.map(agent, range(agents)))
            talking = time.monotonic() - started
            done.set()
            sampler.join()
            stopped = time.monotonic()
            _wait(url, timeout=300)
            catch_up = time.monotonic() - stopped
            counters = _metrics(url)
        finally:
            service.terminate()
            service.wait(30)
    lags = [lag for lag, _ in samples] or [0]
    ages = [age for _, age in samples] or [0]
    return {
        "agents": agents,
        "turns_per_agent": turns,
        "turns_per_second": agents * turns / talking,
        "lag_messages": {"mean": sum(lags) / len(lags), "max": max(lags)},
        "oldest_pending_age_seconds": {"mean": sum(ages) / len(ages), "max": max(ages)},
        "catch_up_seconds": catch_up,
        "summarizer_calls": counters.get('reducing_saver_summary_calls_total{tenant=""}', 0),
        "uncovered_cuts": counters.get('reducing_saver_summary_uncovered_cuts_total{tenant=""}', 0),
    }


def lag_line(result: dict[str, Any]) -> str:
    return (
        f"{result['agents']} agents x {result['turns_per_agent']} turns ({result['turns_per_second']:.0f} turns/s): "
        f"messages awaiting a summary mean {result['lag_messages']['mean']:.0f}, max {result['lag_messages']['max']:.0f}; "
        f"oldest batch waiting mean {result['oldest_pending_age_seconds']['mean']:.2f} s, max "
        f"{result['oldest_pending_age_seconds']['max']:.2f} s; caught up {result['catch_up_seconds']:.1f} s after "
        f"the agents stopped; {result['summarizer_calls']:.0f} summarizer calls, {result['uncovered_cuts']:.0f} "
        "messages cut past the hard limit"
    )


def run(
    turns: int, max_messages: int, min_messages: int, summary_max_tokens: int, server: str
) -> dict[str, Any]:
    from langgraph.checkpoint.memory import InMemorySaver

    from reducing_saver.client import RemoteReducingSaver
    from tests.support.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with scratch_database(server) as database, tempfile.TemporaryDirectory() as folder:
        service = _start(
            database,
            folder,
            port,
            [
                "--max-messages",
                str(max_messages),
                "--min-messages",
                str(min_messages),
                "--summary-max-tokens",
                str(summary_max_tokens),
            ],
        )
        try:
            with_service: list[int] = []
            with RemoteReducingSaver(url) as saver:
                # Each turn waits for the summarizer: the figure is the steady state, not the lag.
                _converse(_graph(saver, with_service), turns, "bench", lambda: _wait(url))
            counters = _metrics(url)
        finally:
            service.terminate()
            service.wait(30)
    plain: list[int] = []
    _converse(_graph(InMemorySaver(), plain), turns, "bench")
    calls = counters.get('reducing_saver_summary_calls_total{tenant=""}', 0)
    summarizer_in = counters.get('reducing_saver_summary_input_tokens_total{tenant=""}', 0)
    summarizer_out = counters.get('reducing_saver_summary_output_tokens_total{tenant=""}', 0)
    return {
        "turns": turns,
        "window": [max_messages, min_messages],
        "agent_tokens_per_turn_mean": {"service": sum(with_service) / turns, "plain": sum(plain) / turns},
        "agent_tokens_last_turn": {"service": with_service[-1], "plain": plain[-1]},
        "summarizer": {
            "calls": calls,
            "input_tokens": summarizer_in,
            "output_tokens": summarizer_out,
            "tokens_per_turn": (summarizer_in + summarizer_out) / turns,
            "input_tokens_per_call": summarizer_in / calls if calls else 0,
        },
    }


def line(result: dict[str, Any]) -> str:
    mean, last, cost = (
        result["agent_tokens_per_turn_mean"],
        result["agent_tokens_last_turn"],
        result["summarizer"],
    )
    total_service = mean["service"] + cost["tokens_per_turn"]
    return (
        f"{result['turns']} turns, window {result['window'][0]}/{result['window'][1]}: the agent's model is sent "
        f"{mean['service']:.0f} tokens per turn on average with the service's window and summary, against "
        f"{mean['plain']:.0f} with plain add_messages ({last['service']} vs {last['plain']} at the last turn); "
        f"the summarizer made {cost['calls']:.0f} calls, {cost['input_tokens']:.0f} input + "
        f"{cost['output_tokens']:.0f} output tokens ({cost['input_tokens_per_call']:.0f} input per call), "
        f"{cost['tokens_per_turn']:.0f} per turn: {total_service:.0f} tokens per turn in all, "
        f"{mean['plain'] / total_service:.1f}x fewer"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--max-messages", type=int, default=20)
    parser.add_argument("--min-messages", type=int, default=12)
    parser.add_argument("--summary-max-tokens", type=int, default=800)
    parser.add_argument("--server", default=DEFAULT_SERVER, help="PostgreSQL server URL without a database")
    parser.add_argument("--agents", type=int, default=0, help="then run this many agents at once (lag)")
    parser.add_argument("--agent-turns", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    result = run(args.turns, args.max_messages, args.min_messages, args.summary_max_tokens, args.server)
    print(line(result))
    if args.json:
        print(json.dumps(result))
    if args.agents:
        lag = run_lag(args.agents, args.agent_turns, args.max_messages, args.min_messages, args.server)
        print(lag_line(lag))
        if args.json:
            print(json.dumps(lag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
