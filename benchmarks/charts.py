"""The charts: storage per turn (service vs plain PostgresSaver), latency / throughput, and per-turn time
along a long conversation."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"service": "#1f77b4", "plain": "#d62728", "remote": "#1f77b4", "inprocess": "#2ca02c"}


def _kb(values: list[int]) -> list[float]:
    return [value / 1024 for value in values]


def storage_chart(storage: dict[str, Any], machine: str, path: Path) -> None:
    turns = storage["per_turn"]["turn"]
    figure, (blob_axis, total_axis) = plt.subplots(1, 2, figsize=(12, 4.6))
    labels = {"service": f"through the service (window {storage['window']})", "plain": "plain PostgresSaver"}
    for kind in ("plain", "service"):
        series = storage["per_turn"][kind]
        blob_axis.plot(turns, _kb(series["messages_blob_bytes"]), color=COLORS[kind], label=labels[kind])
        total_axis.plot(
            turns,
            [value / 1024 / 1024 for value in series["thread_bytes"]],
            color=COLORS[kind],
            label=labels[kind],
        )
    fill = storage["window_fill_turn"]
    blob_axis.axvline(fill, color="grey", linestyle=":", linewidth=1)
    blob_axis.annotate(
        "window full", (fill, 0), textcoords="offset points", xytext=(4, 6), fontsize=8, color="grey"
    )
    blob_axis.set_title("newest messages blob, per turn")
    blob_axis.set_xlabel("turn")
    blob_axis.set_ylabel("KB")
    blob_axis.legend(loc="upper left")
    totals = storage["totals"]
    total_axis.set_title("thread total (checkpoints + blobs + writes)")
    total_axis.set_xlabel("turn")
    total_axis.set_ylabel("MB")
    total_axis.legend(loc="upper left")
    note = (
        f"after prune(keep_latest): plain {totals['plain']['after_prune_bytes'] / 1024:.1f} KB, "
        f"service {totals['service']['after_prune_bytes'] / 1024:.1f} KB"
    )
    total_axis.text(0.98, 0.04, note, transform=total_axis.transAxes, ha="right", fontsize=8)
    figure.suptitle(
        f"{storage['turns']}-turn chat, ~400-character messages, logical bytes (before PostgreSQL compression)"
        f"\n{machine}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def performance_chart(latency: dict[str, Any], throughput: dict[str, Any], machine: str, path: Path) -> None:
    figure, (latency_axis, throughput_axis) = plt.subplots(1, 2, figsize=(12, 4.6))
    kinds = ("remote", "inprocess", "plain")
    names = {
        "remote": "RemoteReducingSaver",
        "inprocess": "ReducingSaver + on_prune → PostgresStore",
        "plain": "PostgresSaver",
    }
    width = 0.26
    for offset, kind in enumerate(kinds):
        xs = [index + (offset - 1) * width for index in range(2)]
        medians = [latency[mode][kind]["median_ms"] for mode in ("sync", "async")]
        p95 = [latency[mode][kind]["p95_ms"] for mode in ("sync", "async")]
        latency_axis.bar(xs, medians, width, color=COLORS[kind], label=names[kind])
        latency_axis.errorbar(
            xs,
            medians,
            yerr=[[0, 0], [p - m for p, m in zip(p95, medians, strict=True)]],
            fmt="none",
            ecolor="black",
            capsize=3,
            linewidth=1,
        )
    latency_axis.set_xticks([0, 1], ["sync invoke", "async ainvoke"])
    latency_axis.set_ylabel("ms per turn (bar: median, whisker: p95)")
    latency_axis.set_title("per-turn latency, one agent")
    latency_axis.legend(fontsize=8)
    levels = [level for level in throughput["levels"] if level.get("condition", "quiet") == "quiet"]
    counts = [level["agents"] for level in levels]
    modes = (
        ("service", "through one service"),
        ("inprocess", "ReducingSaver(AsyncPostgresSaver) + store each"),
        ("plain", "AsyncPostgresSaver each"),
    )
    for mode, label in modes:
        rates = [level[mode]["turns_per_s"] for level in levels]
        throughput_axis.plot(counts, rates, marker="o", color=COLORS[mode], label=label)
        for count, level in zip(counts, levels, strict=True):
            note = f"{level[mode]['connections_max']} conn"
            if level[mode]["agents_completed"] < count:  # the others could not connect, or failed
                note += f", {level[mode]['agents_completed']} ran"
            throughput_axis.annotate(
                note,
                (count, level[mode]["turns_per_s"]),
                textcoords="offset points",
                xytext=(4, {"service": 6, "inprocess": -10, "plain": -20}[mode]),
                fontsize=7,
                color=COLORS[mode],
            )
    throughput_axis.set_xscale("log", base=2)
    throughput_axis.set_xticks(counts, [str(count) for count in counts])
    spread = [
        f"{level['agents']} in {level['processes']}"
        for level in levels
        if level["processes"] != level["agents"]
    ]
    throughput_axis.set_xlabel(
        "concurrent agents"
        + (f" (processes: {', '.join(spread)}; else one each)" if spread else ", one process each")
    )
    throughput_axis.set_ylabel("turns/s, all agents")
    throughput_axis.set_title("throughput (labels: PostgreSQL connections, max)")
    throughput_axis.set_ylim(bottom=0)
    throughput_axis.legend(fontsize=8)
    figure.suptitle(machine, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _rolling_median(values: list[float], width: int) -> list[float]:
    """The median of each value and its neighbours, ``width`` values in all (fewer at the ends)."""
    half = width // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def long_thread_chart(long_thread: dict[str, Any], machine: str, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(12, 4.6))
    turns = list(range(1, long_thread["turns"] + 1))
    width = 5 if long_thread["turns"] >= 50 else 1
    for kind in ("plain", "inprocess", "service"):
        fig = long_thread[kind]
        curve = fig["per_turn_ms"]
        if width > 1:
            axis.plot(turns, curve, color=COLORS[kind], alpha=0.25, linewidth=0.8)
        axis.plot(
            turns,
            _rolling_median(curve, width),
            color=COLORS[kind],
            label=f"{long_thread['labels'][kind]}: {fig['total_s']:.2f} s in all",
        )
    for first, last in long_thread["ranges"].values():
        axis.axvspan(first, last, color="grey", alpha=0.08, linewidth=0)
    axis.set_xlim(1, long_thread["turns"])
    axis.set_ylim(bottom=0)
    axis.set_xlabel("turn")
    axis.set_ylabel("ms per turn (ainvoke)")
    axis.set_title(
        f"per-turn time along a {long_thread['turns']}-turn conversation, window "
        f"{long_thread['window']} messages",
        fontsize=10,
    )
    axis.legend(loc="upper left", fontsize=8)
    lines = f"lines: rolling median of {width} turns, faint: " if width > 1 else ""
    figure.suptitle(
        f"~400-character messages, the three interleaved turn by turn; {lines}each turn's median over "
        f"{long_thread['rounds']} rounds; shaded: the reported ranges\n{machine}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
