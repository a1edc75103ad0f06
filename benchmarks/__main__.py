"""The benchmark suite: storage, growth, real turns, latency, a long thread, throughput and service cost, in
one run.

    .venv/bin/python -m benchmarks [--quick] [--out benchmarks/results]

Creates a PostgreSQL database of its own (dropped afterwards), starts ``reducing-saver serve`` on it
(the real CLI, default settings but ``--max-messages``), and beside it for the latency, service-cost and
throughput sections the stock-saver service (``benchmarks/stock_service.py``: the floor those figures
stand on), runs the sections against that service and that database, writes ``results.json``,
``storage.png``, ``growth.png``, ``performance.png`` and ``long_thread.png`` into ``--out``, and
prints a summary with the ratios. Every comparison is measured in the same run, interleaved, so that a busy
machine shifts both sides alike. ``--quick`` is a smoke version (seconds, not minutes) for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

from benchmarks._common import DEFAULT_SERVER, scratch_database
from benchmarks.agent import VARIANTS

#: In ``--ab-args``: the connection-churn experiment (``benchmarks/stages.py``), not a ``serve`` flag.
CLOSE_EVERY = "--close-every"
#: In ``--ab-args``: run that service from another checkout's packages (an A/B of a code change), not a
#: ``serve`` flag.
SOURCE = "--source"
#: In ``--ab-args``: ``--env NAME=VALUE`` sets an environment variable of that service (e.g. ``PGOPTIONS``
#: for a server setting its connections take, such as ``-c commit_delay=200``), not a ``serve`` flag.
ENV = "--env"
PACKAGES = ("reducer", "wire", "client", "service")


def source_path(checkout: str, out: Path, variant: str) -> str:
    """A folder holding ``reducing_saver`` made of ``checkout``'s package folders (links), for the front of a
    variant's ``PYTHONPATH``: that service runs the checkout's code, the benchmark's own modules stay."""
    folder = out / f"source-{variant}" / "reducing_saver"
    folder.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        link = folder / package
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(checkout).resolve() / package, target_is_directory=True)
    return str(folder.parent)


#: In ``--ab-args``: a listening socket per worker in one ``SO_REUSEPORT`` group (``benchmarks/stages.py``).
REUSE_PORT = "--reuse-port"

# The sections import LangGraph and the service lazily, in main(): agent processes are spawned and
# re-import this module, and need none of it.

# Service cost runs before throughput: 32 agent processes leave PostgreSQL (autovacuum) and the load
# average busy for a while after them.
SECTIONS = ("storage", "growth", "real_turn", "latency", "long_thread", "service_cost", "throughput")
# The sections that share one service process.
SINGLE_SERVICE_SECTIONS = ("storage", "real_turn", "latency", "long_thread", "service_cost")

FULL = {
    "storage_turns": 100,
    # Growth: thread bytes at these turns (plain add_messages only to the first), measured every N turns.
    "growth_samples": [300, 3000],
    "growth_every": 100,
    "window": 20,
    "latency_turns": 20,
    "latency_rounds": 10,
    "long_thread_turns": 200,
    "long_thread_rounds": 5,
    # N: N agent processes of one agent each; N/P: N agents in P processes (asyncio tasks in each).
    "agents": "1,8,32,128/4",
    # 3 modes x 2 rounds x 4 levels: 8 s phases keep the whole run well under 10 minutes.
    "duration": 8.0,
    "throughput_rounds": 2,
    "turns_per_thread": 20,
    "cost_requests": 2000,
    "cost_concurrency": 8,
    "profile_seconds": 10.0,
    "idle_seconds": 3.0,
    "floor_requests": 3000,
    "floor_samples": 300,
}
QUICK = {
    "storage_turns": 12,
    "growth_samples": [10, 30],
    "growth_every": 5,
    "window": 20,
    "latency_turns": 12,
    "latency_rounds": 1,
    "long_thread_turns": 24,
    "long_thread_rounds": 1,
    "agents": "1,2,8/2",
    "duration": 1.5,
    "throughput_rounds": 1,
    "turns_per_thread": 20,
    "cost_requests": 100,
    "cost_concurrency": 2,
    "profile_seconds": 2.0,
    "idle_seconds": 0.5,
    "floor_requests": 200,
    "floor_samples": 20,
}


#: What the issue asks of some targets, printed beside them.
TARGET_NOTES = {
    "remote_vs_inprocess_median_async": "target <= 1.3",
    "remote_vs_inprocess_p95_async": "target <= 1.3",
    "remote_vs_inprocess_median_sync": "target <= 1.5",
    "remote_vs_inprocess_p95_sync": "target <= 1.5",
    "floor_stock_service_vs_inprocess_median_async": "floor: a service doing nothing but the stock saver call",
    "floor_stock_service_vs_inprocess_median_sync": "floor: a service doing nothing but the stock saver call",
    "long_thread_service_vs_plain_total": "target <= 1.0",
    "long_thread_service_vs_plain_last_median": "target <= 0.8",
    "agents_service_vs_inprocess_turns_per_s": "target >= 1.0",
    "agents_connections_service_vs_inprocess": "target <= 0.25",
    "many_agents_service_errors": "target 0",
    "many_agents_agents_completed": "target: every agent through the service",
    "many_agents_service_connections_max": "target <= 16",
    "service_own_cpu_us_per_turn": "can only go down",
    "floor_stock_service_own_cpu_us_per_turn": "floor: a service doing nothing but the stock saver call",
    "floor_stock_service_vs_inprocess_turns_per_s": "floor: a service doing nothing but the stock saver call",
    "service_own_cpu_us_put": "target <= 150",
    "service_own_cpu_us_writes": "target <= 110",
    "service_own_cpu_us_get": "target <= 100",
    "growth_keep_last_vs_first_sample": "target <= 1.1",
    "growth_keep_vs_delta_at_last": "target <= 0.2",
    "growth_keep_outbox_vs_store": "target <= 0.05",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: few turns, 1, 2 and 8 (in 2 processes) agents, tiny loads",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the results")
    parser.add_argument(
        "--postgres",
        default=DEFAULT_SERVER,
        help="PostgreSQL server URL without a database (default: %(default)s)",
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS)
    )
    parser.add_argument(
        "--agents",
        help="comma-separated agent levels for the throughput section: N (N "
        "processes of one agent each) or N/P (N agents in P processes), e.g. 1,8,32,128/4",
    )
    parser.add_argument("--duration", type=float, help="seconds per throughput phase")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="the service's worker processes in the throughput section (default: the machine's "
        "cores, %(default)s); the other sections use one",
    )
    parser.add_argument(
        "--pool-size",
        type=int,
        default=2,
        help="the service's PostgreSQL connections per worker (default: %(default)s)",
    )
    parser.add_argument(
        "--conditions",
        default="quiet",
        help="throughput: comma-separated, quiet and/or contended (each level again with a "
        "CPU-hungry process beside it); default: %(default)s",
    )
    parser.add_argument(
        "--throughput-modes",
        default=",".join(("service", "inprocess", "plain", "stock_service")),
        help="throughput: the modes to run (default: %(default)s)",
    )
    parser.add_argument(
        "--ab-args",
        action="append",
        default=[],
        help="throughput: run the service again with these `serve` flags added, as one more mode "
        "(service_b; given again, service_c and service_d), interleaved with the others: an A/B of a setting. "
        f"`{CLOSE_EVERY} N` among them is an experiment, not a `serve` flag: that service's workers "
        "answer a random one in N per-step requests with `Connection: close` (the client reconnects, "
        f"and may land on another worker); `{REUSE_PORT}` is one too: each of that service's workers "
        "listens on a socket of its own, all in one SO_REUSEPORT group (the kernel spreads new "
        "connections over them). "
        f"`{SOURCE} PATH` runs that service from the packages of the checkout at PATH (e.g. a git worktree "
        "of the commit before a change): an A/B of code, interleaved; "
        f"`{ENV} NAME=VALUE` sets an environment variable of that service (e.g. PGOPTIONS)",
    )
    parser.add_argument(
        "--keep-stage-records",
        action="store_true",
        help="throughput: keep every phase's raw stage records and the agents' notes in "
        "OUT/stages/raw-PHASE.json",
    )
    parser.add_argument(
        "--direct-max-agents",
        type=int,
        default=0,
        help="throughput, levels of the same processes: skip the direct modes (inprocess, plain) at "
        "levels of more agents than this (their agents would be refused connections anyway)",
    )
    parser.add_argument(
        "--no-stages",
        action="store_true",
        help="throughput: run the services without the per-stage trace (benchmarks/stages.py)",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `reducing-saver serve` flags for the throughput section's service, "
        'e.g. "--no-extract --pool-size 4"',
    )
    return parser.parse_args(argv)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in (
        "reducing-saver",
        "langgraph",
        "langgraph-checkpoint",
        "langgraph-checkpoint-postgres",
        "psycopg",
        "uvicorn",
        "fastapi",
        "httpx",
        "aiohttp",
    ):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


def _machine(server: str) -> dict[str, Any]:
    with psycopg.connect(f"{server}/postgres") as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "postgres": version,
        "postgres_server": server.rsplit("@", 1)[-1],
        "load_average_at_start": [round(value, 2) for value in os.getloadavg()],
    }


def _machine_line(machine: dict[str, Any]) -> str:
    return (
        f"{machine['cpus']} cores, PostgreSQL {machine['postgres'].split()[0]} on loopback, "
        f"load average {machine['load_average_at_start'][0]} at start (a shared machine)"
    )


# The targets the issue sets for some of the ratios (at most this much).
def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, as ratios from this run."""
    out: dict[str, Any] = {}
    if "real_turn" in results:
        for figures in results["real_turn"]["by_model_latency"]:
            for key in (
                "service_vs_inprocess_median",
                "service_vs_inprocess_p95",
                "service_vs_inprocess_mean",
                "service_vs_plain_median",
            ):
                out[f"real_turn_{figures['model_ms']}ms_{key}"] = figures["ratios"][key]
    if "latency" in results:
        for mode in ("sync", "async"):
            ratios = results["latency"][mode]["ratios"]
            out[f"remote_vs_inprocess_median_{mode}"] = ratios["remote_vs_inprocess_median"]
            out[f"remote_vs_inprocess_p95_{mode}"] = ratios["remote_vs_inprocess_p95"]
            out[f"remote_vs_plain_median_{mode}"] = ratios["remote_vs_plain_median"]
            for key in ("stock_service_vs_inprocess_median", "stock_service_vs_inprocess_p95"):
                out[f"floor_{key}_{mode}"] = ratios[key]
        out["floor_remote_vs_inprocess_median_async"] = results["latency"]["floor"]["floor_ratio_async"]
    if "long_thread" in results:
        for key, value in results["long_thread"]["ratios"].items():
            out[f"long_thread_{key}"] = value
    if "throughput" in results:
        levels = results["throughput"]["levels"]
        single = [level for level in levels if level["agents_per_process"] == 1]
        if single and "inprocess" in single[-1] and "plain" in single[-1]:
            level = single[-1]
            out["agents_level"] = level["agents"]
            for mode in ("inprocess", "plain"):
                out[f"agents_service_vs_{mode}_turns_per_s"] = level["ratios"][
                    f"service_vs_{mode}_turns_per_s"
                ]
            for mode in ("service", "inprocess", "plain"):
                out[f"agents_connections_{mode}"] = level[mode]["connections_max"]
            out["agents_connections_service_vs_inprocess"] = level["ratios"][
                "service_vs_inprocess_connections_max"
            ]
            if "stock_service_vs_inprocess_turns_per_s" in level["ratios"]:
                out["floor_stock_service_vs_inprocess_turns_per_s"] = level["ratios"][
                    "stock_service_vs_inprocess_turns_per_s"
                ]
        many = [
            level
            for level in levels
            if level["agents_per_process"] > 1 and level.get("condition") != "contended"
        ]
        if many:
            level = many[-1]
            out["many_agents_level"] = f"{level['agents']} agents in {level['processes']} processes"
            out["many_agents_service_errors"] = sum(level["service"]["errors"].values())
            out["many_agents_service_connections_max"] = level["service"]["connections_max"]
            for key in ("agents_completed", "connect_failures", "turns_per_s", "p95_ms", "connections_max"):
                out[f"many_agents_{key}"] = {
                    mode: level[mode][key] for mode in results["throughput"]["modes"] if mode in level
                }
        for grown in results["throughput"].get("growth", []):
            for mode in ("service", "stock_service", *VARIANTS):
                if mode in grown:
                    name = (
                        f"growth_{grown['from_agents']}_to_{grown['to_agents']}_{grown['condition']}_{mode}"
                    )
                    out[f"{name}_turns_per_s"] = grown[mode]["turns_per_s"]
                    out[f"{name}_p95"] = grown[mode]["p95"]
    if "service_cost" in results:
        out["service_own_cpu_us_per_turn"] = results["service_cost"]["own_cpu_us_per_turn"]
        if "stock_service" in results["service_cost"]:
            from benchmarks.service_cost import TURN_ROUTES

            floor = results["service_cost"]["stock_service"]
            out["floor_stock_service_own_cpu_us_per_turn"] = floor["own_cpu_us_per_turn"]
            for name, route in TURN_ROUTES.items():
                own = results["service_cost"]["routes"][route]["own_cpu_us_per_request"]
                out[f"service_own_cpu_us_{name}"] = own
                out[f"floor_stock_service_own_cpu_us_{name}"] = floor["routes"][route][
                    "own_cpu_us_per_request"
                ]
    if "growth" in results:
        for key, value in results["growth"]["ratios"].items():
            out[f"growth_{key}"] = value
    if "storage" in results:
        ratios = results["storage"]["ratios"]
        out["newest_blob_final_vs_window_fill"] = ratios["service_blob_final_vs_window_fill"]
        out["pruned_thread_vs_window_checkpoint"] = ratios["service_after_prune_vs_window_checkpoint"]
    return out


def _kb(value: float) -> str:
    return f"{value / 1024:,.1f} KB"


def _mb(value: float) -> str:
    return f"{value / 1024 / 1024:,.2f} MB"


def growth_table(growth: dict[str, Any]) -> list[str]:
    """The growth section as a Markdown table: bytes at each sample turn, context reloaded, turn time."""
    samples = growth["samples"]
    head = "| | " + " | ".join(f"turn {t:,}" for t in samples) + " | context at the last turn | turn, ms |"
    lines = [head, "|---" * (len(samples) + 3) + "|"]
    for kind, label in growth["labels"].items():
        s = growth["series"][kind]
        cells = [
            _mb(growth["bytes_at"][kind][str(t)]) if str(t) in growth["bytes_at"][kind] else "not run"
            for t in samples
        ]
        context = f"{s['context_messages'][-1]} messages at turn {s['turn'][-1]:,}"
        lines.append(
            f"| {label} | " + " | ".join(cells) + f" | {context} | "
            f"{growth['turn_ms_median_last_tenth'][kind]} |"
        )
    for kind in ("service", "keep"):
        m = growth["memory"][kind]
        lines.append(
            f"| {growth['labels'][kind]}: long-term memory after delivery | store "
            f"{_mb(m['store_bytes'])} ({m['store_items']} items), outbox {_mb(m['outbox_bytes'])} |"
            + " |"
            * (len(samples) + 1)
        )
    return lines


def print_growth(growth: dict[str, Any]) -> None:
    samples = growth["samples"]
    print(
        f"\nGrowth: one chat thread to {samples[-1]:,} turns (plain add_messages to {samples[0]:,}), "
        "pg_column_size of the thread's rows; turn time: median of the last tenth"
    )
    for line in growth_table(growth):
        print(f"  {line}")
    r = growth["ratios"]
    print(
        f"  keep {growth['keep_checkpoints']}: turn {samples[-1]:,} / turn {samples[0]:,} = "
        f"{r['keep_last_vs_first_sample']:.2f}x (target <= 1.1); / DeltaChannel at turn {samples[-1]:,} = "
        f"{r['keep_vs_delta_at_last']:.3f}x (target <= 0.2); outbox / store = {r['keep_outbox_vs_store']:.3f}x "
        f"(target <= 0.05); turn time with / without keep = {r['keep_vs_service_turn_ms']:.2f}x"
    )


def print_summary(results: dict[str, Any]) -> None:
    print()
    print(
        f"== reducing-saver benchmarks ({'quick' if results['meta']['quick'] else 'full'}) — "
        f"{results['meta']['machine_line']}"
    )
    if "storage" in results:
        s = results["storage"]
        t = s["totals"]
        print(f"\nStorage: {s['turns']} turns, window {s['window']} (full at turn {s['window_fill_turn']})")
        print(f"  {'':28}{'service':>14}{'plain':>14}{'plain/service':>15}")
        rows = [
            ("newest messages blob", "newest_messages_blob_bytes"),
            ("head checkpoint", "head_checkpoint_bytes"),
            ("thread total", "thread_bytes"),
            ("thread total, stored", "stored_bytes"),
            ("after prune(keep_latest)", "after_prune_bytes"),
        ]
        for label, key in rows:
            a, b = t["service"][key], t["plain"][key]
            print(f"  {label:28}{_kb(a):>14}{_kb(b):>14}{b / a:>14.1f}x")
        r = s["ratios"]
        print(
            f"  service blob at turn {s['turns']} / at window fill: {r['service_blob_final_vs_window_fill']:.2f}x "
            f"(plain: {r['plain_blob_final_vs_window_fill']:.2f}x)"
        )
        print(
            f"  service thread after prune / one window's checkpoint ({_kb(s['window_checkpoint_bytes'])}): "
            f"{r['service_after_prune_vs_window_checkpoint']:.2f}x"
        )
        m = s["long_term_memory"]
        print(
            f"  long-term memory for the service thread: outbox {_kb(m['outbox_bytes'])}, "
            f"store {_kb(m['store_bytes'])} ({m['store_items']} items)"
        )
    if "growth" in results:
        print_growth(results["growth"])
    if "real_turn" in results:
        rt = results["real_turn"]
        print(
            f"\nReal turns: a tool-calling agent, the model waiting each call, a {rt['tool_ms']} ms tool every "
            f"third turn, durability={rt['durability']} (LangGraph's default); {rt['rounds']} rounds x "
            f"{rt['turns_per_thread']}-turn threads per checkpointer, interleaved"
        )
        from benchmarks.real_turn import table as real_turn_table

        for line in real_turn_table(rt):
            print(f"  {line}")
    if "latency" in results:
        lat = results["latency"]
        print(
            f"\nLatency per turn: {lat['rounds']} rounds x {lat['turns_per_thread']}-turn threads per "
            f"checkpointer, interleaved"
        )
        print(
            "  remote: RemoteReducingSaver to the service; in-process: ReducingSaver + on_prune → "
            "AsyncPostgresStore (sync: PostgresStore),"
        )
        print("  the same features in the agent; plain: AsyncPostgresSaver (sync: PostgresSaver), no reducer")
        print(f"  {'':7}{'remote':>18}{'in-process':>18}{'plain':>18}   remote/in-process    remote/plain")
        for mode in ("sync", "async"):
            cells = "".join(
                f"{lat[mode][k]['median_ms']:>8.2f} / {lat[mode][k]['p95_ms']:>6.2f}"
                for k in ("remote", "inprocess", "plain")
            )
            ratios = lat[mode]["ratios"]
            print(
                f"  {mode:7}{cells}   {ratios['remote_vs_inprocess_median']:.2f}x, "
                f"{ratios['remote_vs_inprocess_p95']:.2f}x         {ratios['remote_vs_plain_median']:.2f}x, "
                f"{ratios['remote_vs_plain_p95']:.2f}x"
            )
        print(
            "  (ms, median / p95; ratios median, p95); store items the in-process hook wrote: "
            f"sync {lat['sync']['inprocess_store_items']}, async {lat['async']['inprocess_store_items']}"
        )
        for mode in ("sync", "async"):
            cpu = {k: lat[mode][k]["agent_cpu_ms_median"] for k in ("remote", "inprocess", "plain")}
            print(
                f"  agent CPU per turn, {mode}: remote {cpu['remote']:.2f} ms, in-process "
                f"{cpu['inprocess']:.2f} ms, plain {cpu['plain']:.2f} ms "
                f"({lat[mode]['ratios']['remote_vs_inprocess_agent_cpu']:.2f}x)"
            )
        floor = lat["floor"]
        ex, calls, wake = floor["exchange"], floor["calls_per_turn"], floor["idle_wake"]
        print(
            f"  floor: a bare HTTP exchange (4 KB, aiohttp to a no-op app under uvicorn) takes {ex['median_us']:.0f} us "
            f"(p95 {ex['p95_us']:.0f}), {ex['client_cpu_us']:.0f} us of client and {ex['server_cpu_us']:.0f} us of "
            f"server CPU;"
        )
        print(
            f"    a turn makes {calls['total']:g} calls, {calls['sequential']:g} of them one after another "
            f"(get_tuple, then the chain of puts), so no per-call service gets under "
            f"{floor['floor_ratio_async']:.2f}x async here"
        )
        print(
            f"    PostgreSQL get_tuple: {wake['back_to_back_us']:.0f} us back to back, {wake['after_idle_us']:.0f} us "
            f"after {wake['idle_gap_ms']:g} ms idle"
        )
        if "stock_service" in lat["sync"]:
            print(
                "  stock-saver service (the service answering get_tuple, put and put_writes with the stock "
                "PostgresSaver call alone):"
            )
            for mode in ("sync", "async"):
                stock, ratios = lat[mode]["stock_service"], lat[mode]["ratios"]
                print(
                    f"    {mode}: {stock['median_ms']:.2f} / {stock['p95_ms']:.2f} ms, "
                    f"{ratios['stock_service_vs_inprocess_median']:.2f}x / "
                    f"{ratios['stock_service_vs_inprocess_p95']:.2f}x in-process: the floor under the "
                    f"service's {ratios['remote_vs_inprocess_median']:.2f}x "
                    f"(the service's own work: {ratios['remote_vs_stock_service_median']:.2f}x)"
                )
    if "long_thread" in results:
        lt = results["long_thread"]
        ranges = lt["ranges"]
        print(
            f"\nLong thread: {lt['turns']}-turn conversation (ainvoke), {lt['rounds']} rounds, interleaved turn by "
            f"turn; per-turn medians over the rounds"
        )
        heads = [f"turns {first}-{last}" for first, last in ranges.values()]
        print(f"  {'':62}" + "".join(f"{head:>15}" for head in heads) + f"{'total':>10}")
        for kind in ("service", "plain", "inprocess"):
            fig = lt[kind]
            cells = "".join(f"{fig[f'{name}_median_ms']:>12.2f} ms" for name in ranges)
            print(f"  {lt['labels'][kind]:62}{cells}{fig['total_s']:>8.2f} s")
        r = lt["ratios"]
        last = heads[-1]
        print(
            f"  service/plain: total {r['service_vs_plain_total']:.2f}x, {last} {r['service_vs_plain_last_median']:.2f}x;"
            f" service/in-process: total {r['service_vs_inprocess_total']:.2f}x, "
            f"{last} {r['service_vs_inprocess_last_median']:.2f}x"
        )
    if "throughput" in results:
        tp = results["throughput"]
        print(
            f"\nThroughput: {tp['rounds']} x {tp['duration_s_per_phase']:.0f} s per mode, alternating. Every agent has "
            "its own checkpointer:\n  service = RemoteReducingSaver, inprocess = ReducingSaver(AsyncPostgresSaver) + "
            "AsyncPostgresStore (the same features), plain = AsyncPostgresSaver, stock_service = "
            "RemoteReducingSaver to\n  the service with its per-step work reduced to the stock PostgresSaver call "
            "(the floor under the service)"
        )
        print(
            "  ran: the agents that ran the whole phase (the fewest of the rounds); CPU per turn in us: agents + "
            "service + PostgreSQL = total, and the whole machine's; WAL per turn: records, syncs, bytes"
        )
        from benchmarks import stages as stages_module

        print(
            f"  {'':27}{'':14}{'turns/s':>8}{'p95 ms':>8}{'conns':>6}{'ran':>5}   {'CPU per turn':<40}  WAL"
        )
        for level in tp["levels"]:
            label = f"{level['agents']} agents" + (
                f" in {level['processes']} processes" if level["processes"] != level["agents"] else ""
            )
            label += f", {level.get('condition', 'quiet')}"
            for index, mode in enumerate(mode for mode in tp["modes"] if mode in level):
                f = level[mode]
                cpu = (
                    f"{f['agent_cpu_us_per_turn']:.0f} + {f.get('service_cpu_us_per_turn', 0.0):.0f} + "
                    f"{f['postgres_cpu_us_per_turn']:.0f} = {f['cpu_us_per_turn']:.0f}, "
                    f"{f['machine_cpu_us_per_turn']:.0f}"
                )
                wal = f["wal_per_turn"]
                print(
                    f"  {label if index == 0 else '':27}{mode:14}{f['turns_per_s']:>8.1f}{f['p95_ms']:>8.1f}"
                    f"{f['connections_max']:>6}{f['agents_completed']:>5}   {cpu:<40}  {wal['records']:.1f}, "
                    f"{wal['syncs']:.2f}, {wal['bytes']}"
                )
            r = level["ratios"]
            if "service_vs_inprocess_turns_per_s" in r:
                print(
                    f"  {'':27}service / inprocess: turns/s {r['service_vs_inprocess_turns_per_s']:.2f}x, p95 "
                    f"{r['service_vs_inprocess_p95']:.2f}x, connections "
                    f"{r['service_vs_inprocess_connections_max']:.2f}x, machine CPU per turn "
                    f"{r['service_vs_inprocess_machine_cpu_per_turn']:.2f}x"
                )
            if "stock_service_vs_inprocess_turns_per_s" in r:
                print(
                    f"  {'':27}floor, stock_service / inprocess: turns/s "
                    f"{r['stock_service_vs_inprocess_turns_per_s']:.2f}x, machine CPU per turn "
                    f"{r['stock_service_vs_inprocess_machine_cpu_per_turn']:.2f}x"
                )
            for variant in VARIANTS:
                if f"{variant}_vs_service_turns_per_s" in r:
                    print(
                        f"  {'':27}{variant} / service: turns/s {r[f'{variant}_vs_service_turns_per_s']:.2f}x, p95 "
                        f"{r[f'{variant}_vs_service_p95']:.2f}x, service CPU per turn "
                        f"{r[f'{variant}_vs_service_service_cpu_per_turn']:.2f}x, machine CPU per turn "
                        f"{r[f'{variant}_vs_service_machine_cpu_per_turn']:.2f}x"
                    )
            if "service_vs_stock_service_turns_per_s" in r:
                print(
                    f"  {'':27}service / stock_service: turns/s {r['service_vs_stock_service_turns_per_s']:.2f}x"
                )
            for mode in (mode for mode in tp["modes"] if mode in level):
                f = level[mode]
                spread = f["turns_by_agent"]
                print(
                    f"  {'':27}{mode}: p99 {f['p99_ms']:.0f} ms, max {f['max_ms']:.0f} ms; turns per agent "
                    f"{spread['min']} / {spread['median']} / {spread['max']} (fewest / median / most)"
                )
                db = f.get("database_per_turn")
                if db:
                    print(
                        f"  {'':29}PostgreSQL, this mode's own backends: {f['postgres_backends_cpu_us_per_turn']:.0f} us "
                        f"a turn; this database a turn: {db['xact_commit']:.1f} transactions, rows inserted / "
                        f"updated / deleted {db['tup_inserted']:.1f} / {db['tup_updated']:.1f} / "
                        f"{db['tup_deleted']:.1f}"
                    )
                if "stages" in f:
                    st = f["stages"]
                    cells = ", ".join(
                        f"{name} {st['stages_ms'][name]['median']:.2f}/{st['stages_ms'][name]['p95']:.2f}"
                        for name in stages_module.STAGES
                    )
                    print(f"  {'':29}stages ms median/p95: {cells}")
                    workers = "; ".join(
                        f"{w['share'] * 100:.0f}% of requests, {w['agents']} agents"
                        for w in st["by_worker"].values()
                    )
                    print(
                        f"  {'':29}round trip {st['stages_ms']['round_trip']['median']:.2f}/"
                        f"{st['stages_ms']['round_trip']['p95']:.2f}, op CPU "
                        f"{st['stages_ms']['op_cpu']['median']:.2f}; by worker: {workers}"
                    )
                if f["errors"]:
                    errors = "; ".join(f"{count} x {error}" for error, count in f["errors"].items())
                    print(
                        f"  {'':27}{mode}: {level['agents'] - f['agents_completed']} of {level['agents']} agents "
                        f"missed a phase ({f['connect_failures']} could not connect); over the rounds: {errors}"
                    )
        for grown in tp.get("growth", []):
            cells = "; ".join(
                f"{mode} turns/s {g['turns_per_s']:.2f}x, p95 {g['p95']:.2f}x"
                for mode, g in grown.items()
                if isinstance(g, dict)
            )
            print(f"  {grown['from_agents']} -> {grown['to_agents']} agents, {grown['condition']}: {cells}")
    if "service_cost" in results:
        cost = results["service_cost"]
        print(
            f"\nService CPU per request ({cost['requests_per_route']} requests per route, concurrency "
            f"{cost['concurrency']}; idle {cost['idle_cpu_cores'] * 100:.1f}% of a core), against a bare "
            "exchange: a no-op app under the same server, the same requests"
        )
        print(
            f"  {'us per request':24}{'service':>8}{'bare':>8}{'own':>8}{'bytes in / out':>17}"
            f"{'req/s, bare':>15}"
        )
        for route, fig in cost["routes"].items():
            extra = ""
            if "cpu_us_per_request_with_extraction" in fig:
                extra = f", {fig['cpu_us_per_request_with_extraction']:.0f} with extraction"
            sizes = f"{fig['request_bytes_mean']} / {fig['answer_bytes_mean']}"
            rates = f"{fig['requests_per_s']:.0f}, {fig['bare_requests_per_s']:.0f}"
            print(
                f"  {route:24}{fig['cpu_us_per_request']:>8.0f}{fig['bare_cpu_us_per_request']:>8.0f}"
                f"{fig['own_cpu_us_per_request']:>8.0f}{sizes:>17}{rates:>15}   "
                f"({fig['cpu_us_per_request_net_of_idle']:.0f} net of idle{extra})"
            )
        calls = ", ".join(f"{count:g} {kind}" for kind, count in cost["calls_per_turn"].items())
        print(
            f"  per turn ({calls}): service {cost['cpu_us_per_turn_from_routes']:.0f} us, bare exchange "
            f"{cost['bare_cpu_us_per_turn']:.0f} us, the service's own work {cost['own_cpu_us_per_turn']:.0f} us"
        )
        if "stock_service" in cost:
            stock = cost["stock_service"]
            print(
                "  the stock-saver service (the same service answering with the stock PostgresSaver call alone), "
                "measured the same way right after:"
            )
            for route in ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get"):
                fig = stock["routes"][route]
                print(
                    f"  {route:24}{fig['cpu_us_per_request']:>8.0f}{fig['bare_cpu_us_per_request']:>8.0f}"
                    f"{fig['own_cpu_us_per_request']:>8.0f}"
                )
            print(
                f"  per turn: {stock['cpu_us_per_turn_from_routes']:.0f} us, its own work over the bare exchange "
                f"{stock['own_cpu_us_per_turn']:.0f} us: the floor under the service's "
                f"{cost['own_cpu_us_per_turn']:.0f} us"
            )
        prof = cost["profile"]
        if "error" in prof:
            print(f"  profile failed: {prof['error']}")
        else:
            print(
                f"  profile ({prof['samples']} samples): "
                + ", ".join(f"{name} {pct}%" for name, pct in list(prof["components"].items())[:6])
            )
            print(
                "  inclusive: "
                + ", ".join(f"{name} {pct}%" for name, pct in prof["key_frames_inclusive_pct"].items())
            )
            print("  top frames by own samples:")
            for entry in prof["top_own"][:8]:
                print(f"    {entry['pct']:5.1f}%  {entry['frame']}")
    if results.get("targets"):
        print("\nTargets (ratios from this run):")
        for key, value in results["targets"].items():
            note = f" ({TARGET_NOTES[key]})" if key in TARGET_NOTES else ""
            print(f"  {key}: {value}{note}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    if args.agents:
        settings["agents"] = args.agents
    if args.duration:
        settings["duration"] = args.duration
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {sorted(unknown)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks import (
        floors,
        growth,
        latency,
        long_thread,
        real_turn,
        service_cost,
        stages,
        stock_service,
        storage,
        throughput,
    )
    from tests.support.server import run_service  # the real `reducing-saver serve` process

    try:
        levels = [throughput.parse_level(value) for value in str(settings["agents"]).split(",")]
    except ValueError as exc:
        raise SystemExit(f"--agents: {exc}") from None

    started = time.monotonic()
    machine = _machine(args.postgres)
    results: dict[str, Any] = {
        "meta": {
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "quick": args.quick,
            "settings": {**settings, "real_turn": real_turn.QUICK if args.quick else real_turn.FULL},
            "machine": machine,
            "machine_line": _machine_line(machine),
            "versions": _versions(),
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks", *(argv or sys.argv[1:])]),
        }
    }

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {line}", flush=True)

    def section(name: str) -> None:
        load = round(os.getloadavg()[0], 2)
        results["meta"].setdefault("load_average_by_section", {})[name] = load
        log(f"{name} (load average {load})")

    # One service process for the single-client sections (its /metrics and py-spy see every request);
    # the throughput section gets --workers of them.
    single_args = ["--max-messages", str(settings["window"]), "--pool-size", str(args.pool_size)]
    scaled_args = [*single_args, "--workers", str(args.workers), *shlex.split(args.serve_args)]
    results["meta"]["service_args"] = {
        ", ".join(SINGLE_SERVICE_SECTIONS): single_args,
        "throughput": scaled_args,
    }
    with scratch_database(args.postgres) as database:
        url = throughput.with_application_name(database, throughput.SERVICE_APP)
        if "growth" in sections:
            section("growth")
            results["growth"] = growth.run(
                database,
                lambda *serve_args: run_service(
                    out, "--database", url, "--pool-size", str(args.pool_size), *serve_args
                ),
                samples=list(settings["growth_samples"]),
                every=settings["growth_every"],
                log=log,
            )
        if set(SINGLE_SERVICE_SECTIONS) & set(sections):
            with run_service(out, "--database", url, *single_args) as service, ExitStack() as floor_stack:
                log(
                    f"service pid {service.process.pid} at {service.url}, database {database.rsplit('/', 1)[1]}"
                )
                stock = None
                if "latency" in sections or "service_cost" in sections:  # the floor those two measure
                    stock = floor_stack.enter_context(stock_service.run(out, "--database", url, *single_args))
                    log(f"stock-saver service pid {stock.process.pid} at {stock.url}")
                if "storage" in sections:
                    section("storage")
                    results["storage"] = storage.run(
                        service.url, database, turns=settings["storage_turns"], window=settings["window"]
                    )
                if "real_turn" in sections:
                    section("real_turn")
                    results["real_turn"] = real_turn.run(
                        service.url, database, **(real_turn.QUICK if args.quick else real_turn.FULL), log=log
                    )
                if "latency" in sections:
                    section("latency")
                    results["latency"] = latency.run(
                        service.url,
                        database,
                        turns=settings["latency_turns"],
                        rounds=settings["latency_rounds"],
                        window=settings["window"],
                        stock_service_url=stock.url,
                        log=log,
                    )
                    results["latency"]["floor"] = floors.run(
                        database,
                        results["latency"]["async"]["inprocess"]["median_ms"],
                        requests=settings["floor_requests"],
                        samples=settings["floor_samples"],
                    )
                if "long_thread" in sections:
                    section("long_thread")
                    results["long_thread"] = long_thread.run(
                        service.url,
                        database,
                        turns=settings["long_thread_turns"],
                        rounds=settings["long_thread_rounds"],
                        window=settings["window"],
                        log=log,
                    )
                if "service_cost" in sections:
                    section("service_cost")
                    results["service_cost"] = service_cost.run(
                        service.url,
                        service.process.pid,
                        requests=settings["cost_requests"],
                        concurrency=settings["cost_concurrency"],
                        profile_seconds=settings["profile_seconds"],
                        out_dir=out,
                        idle_seconds=settings["idle_seconds"],
                        stock=(stock.url, stock.process.pid),
                        log=log,
                    )
        if "throughput" in sections:
            stock_url = throughput.with_application_name(database, throughput.STOCK_APP)
            stages_dir = None if args.no_stages else out / "stages"
            traced: dict[str, Any] = {}
            if stages_dir is not None:
                stages_dir.mkdir(exist_ok=True)
                for old in stages_dir.glob("*.tsv"):
                    old.unlink()
                traced = {
                    "program": (sys.executable, "-m", "benchmarks.stages"),
                    "env": {stages.ENV: str(stages_dir)},
                }
            with (
                run_service(out, "--database", url, *scaled_args, **traced) as service,
                stock_service.run(out, "--database", stock_url, *scaled_args, env=traced.get("env")) as stock,
                ExitStack() as b_stack,
            ):
                variants = {}
                for variant, ab_args in zip(VARIANTS, args.ab_args, strict=False):
                    flags = shlex.split(ab_args)
                    b_env = {stages.ROLE_ENV: variant}
                    if CLOSE_EVERY in flags:
                        at = flags.index(CLOSE_EVERY)
                        b_env[stages.CLOSE_EVERY_ENV] = flags[at + 1]
                        del flags[at : at + 2]
                    while ENV in flags:
                        at = flags.index(ENV)
                        key, _, value = flags[at + 1].partition("=")
                        b_env[key] = value
                        del flags[at : at + 2]
                    if SOURCE in flags:
                        at = flags.index(SOURCE)
                        root = str(Path(stages.__file__).resolve().parents[1])
                        b_env["PYTHONPATH"] = f"{source_path(flags[at + 1], out, variant)}:{root}"
                        del flags[at : at + 2]
                    if REUSE_PORT in flags:
                        b_env[stages.REUSE_PORT_ENV] = "1"
                        flags.remove(REUSE_PORT)
                    b_url = throughput.with_application_name(database, throughput.SERVICE_MODES[variant])
                    b_traced = {**traced, "env": {**traced["env"], **b_env}} if traced else {"env": b_env}
                    b = b_stack.enter_context(
                        run_service(out, "--database", b_url, *scaled_args, *flags, **b_traced)
                    )
                    variants[variant] = (b.url, b.process.pid)
                    results["meta"]["service_args"][f"throughput, {variant}"] = [
                        *scaled_args,
                        *shlex.split(ab_args),
                    ]
                log(
                    f"service pid {service.process.pid} ({args.workers} worker processes) at {service.url}; "
                    f"stock-saver service pid {stock.process.pid} at {stock.url}"
                )
                section("throughput")
                results["throughput"] = throughput.run(
                    service.url,
                    service.process.pid,
                    args.postgres,
                    database,
                    levels=levels,
                    duration=settings["duration"],
                    rounds=settings["throughput_rounds"],
                    turns_per_thread=settings["turns_per_thread"],
                    window=settings["window"],
                    stock=(stock.url, stock.process.pid),
                    variants=variants,
                    stages_dir=stages_dir,
                    keep_stage_records=args.keep_stage_records,
                    direct_max_agents=args.direct_max_agents,
                    conditions=tuple(c.strip() for c in args.conditions.split(",") if c.strip()),
                    modes=(*(m.strip() for m in args.throughput_modes.split(",") if m.strip()), *variants),
                    log=log,
                )
    results["targets"] = targets(results)
    results["meta"]["load_average_at_end"] = [round(value, 2) for value in os.getloadavg()]
    results["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    from benchmarks import charts  # matplotlib loads only when there is something to draw

    if "storage" in results:
        charts.storage_chart(results["storage"], results["meta"]["machine_line"], out / "storage.png")
    if "growth" in results:
        growth.chart(results["growth"], results["meta"]["machine_line"], out / "growth.png")
    if "latency" in results and "throughput" in results:
        charts.performance_chart(
            results["latency"],
            results["throughput"],
            results["meta"]["machine_line"],
            out / "performance.png",
        )
    if "long_thread" in results:
        charts.long_thread_chart(
            results["long_thread"], results["meta"]["machine_line"], out / "long_thread.png"
        )
    print_summary(results)
    log(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
