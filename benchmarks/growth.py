"""Growth: what one long chat thread stores, four ways, on one PostgreSQL, turn by turn interleaved.

* ``plain``: a stock ``PostgresSaver``, ``MessagesState`` (``add_messages``): every put stores the whole
  list again. Quadratic, so it runs only to the first sample turn.
* ``delta``: a stock ``PostgresSaver``, the messages channel a ``DeltaChannel`` (LangGraph 1.2, beta):
  each message stored once as a write, a snapshot of the list every 100 updates.
* ``service``: ``reducing-saver serve`` with a 20/10 window (``--max-messages 20 --min-messages 10``).
* ``keep``: the same service with ``--keep-checkpoints 10``.

Bytes are ``pg_column_size`` of every row of the thread in ``checkpoints``, ``checkpoint_blobs`` and
``checkpoint_writes`` (what PostgreSQL stores, after its compression), and for the services also of the
thread's outbox rows and its store items (long-term memory), read once extraction has drained. The
context is what the agent reloads each turn: the messages of the state ``get_state`` returns.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypedDict

import psycopg
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.message import _messages_delta_reducer

from benchmarks._common import ratio, text, thread_config
from benchmarks.storage import wait_extraction_drained
from reducing_saver.client import RemoteReducingSaver

KINDS = ("plain", "delta", "service", "keep")
LABELS = {
    "plain": "plain add_messages (PostgresSaver)",
    "delta": "DeltaChannel (PostgresSaver)",
    "service": "reducing-saver, window 20/10",
    "keep": "reducing-saver, window 20/10, --keep-checkpoints 10",
}
WINDOW_ARGS = ("--max-messages", "20", "--min-messages", "10")
KEEP = 10

CHECKPOINT_BYTES = """
    SELECT
        (SELECT COALESCE(sum(pg_column_size(c.*)), 0) FROM checkpoints c WHERE thread_id = %(t)s)
        + (SELECT COALESCE(sum(pg_column_size(b.*)), 0) FROM checkpoint_blobs b WHERE thread_id = %(t)s)
        + (SELECT COALESCE(sum(pg_column_size(w.*)), 0) FROM checkpoint_writes w WHERE thread_id = %(t)s),
        (SELECT count(*) FROM checkpoints WHERE thread_id = %(t)s)
"""
OUTBOX_BYTES = (
    "SELECT COALESCE(sum(pg_column_size(o.*)), 0) FROM reducing_saver_outbox o WHERE thread_id = %(t)s"
)
STORE_BYTES = "SELECT COALESCE(sum(pg_column_size(s.*)), 0), count(*) FROM store s WHERE prefix = %(p)s"


class DeltaState(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer)]


def _chat_graph(checkpointer: Any, state: type = MessagesState) -> Any:
    """One node answering ~400 characters; messages carry ids (the delta reducer assigns none)."""

    def bot(values: dict[str, Any]) -> dict[str, list[AIMessage]]:
        turn = int(values["messages"][-1].id.rsplit("-", 1)[1])
        return {"messages": [AIMessage(text(f"ai-{turn}"), id=f"ai-{turn}")]}

    builder = StateGraph(state)
    builder.add_node("bot", bot)
    builder.add_edge(START, "bot")
    return builder.compile(checkpointer=checkpointer)


def _user(turn: int) -> dict[str, Any]:
    return {"messages": [HumanMessage(text(f"user-{turn}"), id=f"user-{turn}")]}


def _context(graph: Any, thread_id: str) -> tuple[int, int]:
    """(messages, characters of their content) the agent reloads for the next turn."""
    messages = graph.get_state(thread_config(thread_id)).values["messages"]
    return len(messages), sum(len(str(m.content)) for m in messages)


def _memory(conn: psycopg.Connection, thread_id: str) -> dict[str, int]:
    outbox = conn.execute(OUTBOX_BYTES, {"t": thread_id}).fetchone()[0]
    store, items = conn.execute(STORE_BYTES, {"p": f"memories.{thread_id}"}).fetchone()
    return {"outbox_bytes": int(outbox), "store_bytes": int(store), "store_items": int(items)}


def run(
    database: str,
    start_service: Callable[..., Any],
    *,
    samples: list[int],
    every: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the four threads to ``samples[-1]`` turns (plain to ``samples[0]``), measuring every ``every``
    turns and at each sample turn.

    Args:
        database: The PostgreSQL database (its URL) the savers and the services share.
        start_service: ``start_service(*serve_args)``: a context manager running ``reducing-saver serve``
            on ``database``, yielding an object with ``url``.
    """
    run_id = uuid.uuid4().hex[:8]
    threads = {kind: f"growth-{kind}-{run_id}" for kind in KINDS}
    last = samples[-1]
    limit = {kind: samples[0] if kind == "plain" else last for kind in KINDS}
    measured_at = sorted({*range(every, last + 1, every), *samples})
    series: dict[str, dict[str, list]] = {
        kind: {
            "turn": [],
            "checkpoint_bytes": [],
            "checkpoints": [],
            "context_messages": [],
            "context_chars": [],
        }
        for kind in KINDS
    }
    turn_ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with (
        start_service(*WINDOW_ARGS) as service,
        start_service(*WINDOW_ARGS, "--keep-checkpoints", str(KEEP)) as keep_service,
        psycopg.connect(database, autocommit=True) as conn,
        PostgresSaver.from_conn_string(database) as stock,
        RemoteReducingSaver(service.url) as remote,
        RemoteReducingSaver(keep_service.url) as keep_remote,
    ):
        stock.setup()
        graphs = {
            "plain": _chat_graph(stock),
            "delta": _chat_graph(stock, DeltaState),
            "service": _chat_graph(remote),
            "keep": _chat_graph(keep_remote),
        }
        for turn in range(1, last + 1):
            for kind, graph in graphs.items():
                if turn > limit[kind]:
                    continue
                started = time.perf_counter()
                graph.invoke(_user(turn), thread_config(threads[kind]))
                turn_ms[kind].append((time.perf_counter() - started) * 1000)
                if turn in measured_at:
                    size, count = conn.execute(CHECKPOINT_BYTES, {"t": threads[kind]}).fetchone()
                    messages, chars = _context(graph, threads[kind])
                    for key, value in (
                        ("turn", turn),
                        ("checkpoint_bytes", int(size)),
                        ("checkpoints", int(count)),
                        ("context_messages", messages),
                        ("context_chars", chars),
                    ):
                        series[kind][key].append(value)
            if turn in samples or turn % (every * 5) == 0:
                log(f"growth: turn {turn} of {last}")
        drained = {
            kind: wait_extraction_drained(url, timeout=120.0)
            for kind, url in (("service", service.url), ("keep", keep_service.url))
        }
        memory = {kind: _memory(conn, threads[kind]) for kind in ("service", "keep")}

    at = {
        kind: {
            turn: series[kind]["checkpoint_bytes"][series[kind]["turn"].index(turn)]
            for turn in samples
            if turn in series[kind]["turn"]
        }
        for kind in KINDS
    }
    first = samples[0]
    tail = max(1, last // 10)
    per_turn_ms = {kind: round(statistics.median(values[-tail:]), 2) for kind, values in turn_ms.items()}
    return {
        "samples": samples,
        "labels": LABELS,
        "keep_checkpoints": KEEP,
        "series": series,
        "bytes_at": {
            kind: {str(turn): value for turn, value in values.items()} for kind, values in at.items()
        },
        "memory": memory,
        "extraction": drained,
        "turn_ms_median_last_tenth": per_turn_ms,
        "ratios": {
            # Targets: <= 1.1 (flat) and <= 0.2.
            "keep_last_vs_first_sample": ratio(at["keep"][last], at["keep"][first]),
            "keep_vs_delta_at_last": ratio(at["keep"][last], at["delta"][last]),
            "service_vs_delta_at_last": ratio(at["service"][last], at["delta"][last]),
            "keep_vs_plain_at_first": ratio(at["keep"][first], at["plain"][first]),
            # Target: <= 0.05. Delivered rows keep their keys, not the messages.
            "keep_outbox_vs_store": ratio(memory["keep"]["outbox_bytes"], memory["keep"]["store_bytes"]),
            # What keeping the last K costs a turn (3 puts), service with K against without.
            "keep_vs_service_turn_ms": ratio(per_turn_ms["keep"], per_turn_ms["service"]),
        },
    }


def chart(growth: dict[str, Any], machine: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"plain": "#d62728", "delta": "#ff7f0e", "service": "#1f77b4", "keep": "#2ca02c"}
    figure, (bytes_axis, context_axis) = plt.subplots(1, 2, figsize=(12, 4.6))
    for kind in KINDS:
        s = growth["series"][kind]
        bytes_axis.plot(
            s["turn"],
            [v / 1024 / 1024 for v in s["checkpoint_bytes"]],
            color=colors[kind],
            label=growth["labels"][kind],
        )
        context_axis.plot(s["turn"], s["context_messages"], color=colors[kind], label=growth["labels"][kind])
    bytes_axis.set_yscale("log")
    bytes_axis.set_title("thread's checkpoint rows (pg_column_size), MB, log scale")
    bytes_axis.set_xlabel("turn")
    bytes_axis.legend(loc="lower right", fontsize=8)
    context_axis.set_yscale("log")
    context_axis.set_title("messages the agent reloads each turn, log scale")
    context_axis.set_xlabel("turn")
    keep = growth["memory"]["keep"]
    context_axis.text(
        0.98,
        0.04,
        f"keep's long-term memory: store {keep['store_bytes'] / 1024 / 1024:.2f} MB "
        f"({keep['store_items']} items), outbox {keep['outbox_bytes'] / 1024:.0f} KB",
        transform=context_axis.transAxes,
        ha="right",
        fontsize=8,
    )
    figure.suptitle(
        f"one chat thread, ~400-character messages, {growth['samples'][-1]} turns (plain to "
        f"{growth['samples'][0]})\n{machine}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
