"""The benchmark suite runs end to end (`python -m benchmarks --quick`) and writes what it promises.

Only that: the figures are checked for presence and sign, never for speed, since CI machines are shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.postgres import PG_HOST, PG_PORT, PG_USER

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_") or "_TEST_PG" in k}
    env["NO_PROXY"] = "*"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(name, None)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--out",
            str(out),
            "--postgres",
            f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert completed.returncode == 0, f"stdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    results = json.loads((out / "results.json").read_text())
    return out, results, completed.stdout


def test_storage_section(quick_run: tuple[Path, dict, str]) -> None:
    storage = quick_run[1]["storage"]
    for kind in ("service", "plain"):
        series = storage["per_turn"][kind]
        assert len(series["messages_blob_bytes"]) == storage["turns"]
        assert all(positive(value) for value in series["messages_blob_bytes"])
        assert all(positive(value) for value in series["thread_bytes"])
        totals = storage["totals"][kind]
        for key in (
            "thread_bytes",
            "stored_bytes",
            "newest_messages_blob_bytes",
            "after_prune_bytes",
            "messages_blob_bytes_at_window_fill",
        ):
            assert positive(totals[key]), (kind, key, totals[key])
    assert positive(storage["window_checkpoint_bytes"])
    for key in (
        "service_blob_final_vs_window_fill",
        "plain_blob_final_vs_window_fill",
        "plain_vs_service_thread_bytes",
        "service_after_prune_vs_window_checkpoint",
        "plain_vs_service_after_prune",
    ):
        assert positive(storage["ratios"][key]), key


def test_growth_section(quick_run: tuple[Path, dict, str]) -> None:
    growth = quick_run[1]["growth"]
    first, last = growth["samples"]
    for kind in ("plain", "delta", "service", "keep"):
        series = growth["series"][kind]
        assert series["turn"][-1] == (first if kind == "plain" else last), kind
        assert all(positive(value) for value in series["checkpoint_bytes"]), kind
        assert all(positive(value) for value in series["context_messages"]), kind
        assert positive(growth["turn_ms_median_last_tenth"][kind]), kind
    # Reduced threads reload a window; the others everything written.
    assert growth["series"]["keep"]["context_messages"][-1] <= 20
    assert growth["series"]["delta"]["context_messages"][-1] == 2 * last
    # With keep_checkpoints a thread holds at most its K checkpoints (a linear chat has no other branch).
    assert max(growth["series"]["keep"]["checkpoints"]) <= growth["keep_checkpoints"]
    for kind in ("service", "keep"):
        memory = growth["memory"][kind]
        assert positive(memory["store_items"]) and positive(memory["store_bytes"]), kind
    for key in (
        "keep_last_vs_first_sample",
        "keep_vs_delta_at_last",
        "keep_outbox_vs_store",
        "keep_vs_service_turn_ms",
    ):
        assert positive(growth["ratios"][key]), key


def test_real_turn_section(quick_run: tuple[Path, dict, str]) -> None:
    """A tool-calling agent whose model waits, under LangGraph's default durability: every checkpointer at
    every latency, the ratios from the same run, the service and in-process keeping a window."""
    real = quick_run[1]["real_turn"]
    settings = quick_run[1]["meta"]["settings"]["real_turn"]
    assert real["durability"] == "async" and real["window"] == 20
    assert [figures["model_ms"] for figures in real["by_model_latency"]] == [
        round(s * 1000) for s in settings["latencies"]
    ]
    for figures in real["by_model_latency"]:
        for kind in ("service", "inprocess", "plain"):
            assert figures[kind]["n"] == settings["turns"] * settings["rounds"], kind
            # A turn waits for at least one model call, a tool-calling turn for two and the tool.
            assert figures[kind]["median_ms"] >= figures["model_ms"], (kind, figures)
            assert figures[kind]["p95_ms"] >= 2 * figures["model_ms"] + real["tool_ms"], (kind, figures)
            assert figures[kind]["p95_ms"] >= figures[kind]["median_ms"] > 0, (kind, figures)
        for key in (
            "service_vs_inprocess_median",
            "service_vs_inprocess_p95",
            "service_vs_inprocess_mean",
            "service_vs_plain_median",
            "service_vs_plain_p95",
            "service_vs_plain_mean",
        ):
            assert positive(figures["ratios"][key]), key
        kept = figures["messages_in_last_thread"]
        assert kept["service"] <= 20 and kept["inprocess"] <= 20 < kept["plain"], kept
    assert "Real turns:" in quick_run[2]
    targets = quick_run[1]["targets"]
    for figures in real["by_model_latency"]:
        assert positive(targets[f"real_turn_{figures['model_ms']}ms_service_vs_inprocess_median"])


def test_latency_section(quick_run: tuple[Path, dict, str]) -> None:
    latency = quick_run[1]["latency"]
    for mode in ("sync", "async"):
        for kind in ("remote", "inprocess", "plain"):
            figures = latency[mode][kind]
            assert positive(figures["n"]) and positive(figures["median_ms"]) and positive(figures["p95_ms"])
            assert positive(figures["agent_cpu_ms_median"]), (mode, kind)
        for key in (
            "remote_vs_inprocess_median",
            "remote_vs_inprocess_p95",
            "remote_vs_plain_median",
            "remote_vs_plain_p95",
            "inprocess_vs_plain_median",
            "remote_vs_inprocess_agent_cpu",
        ):
            assert positive(latency[mode]["ratios"][key]), (mode, key)
        # The in-process baseline has the service's features: its on_prune hook stored the pruned messages.
        assert positive(latency[mode]["inprocess_store_items"]), mode
        # The stock-saver service is the floor under the service's turn: measured in the same rounds, and
        # doing none of the service's work (no window: it gives back every message, as the plain saver does).
        stock = latency[mode]["stock_service"]
        assert positive(stock["n"]) and stock["n"] == latency[mode]["remote"]["n"], mode
        for key in (
            "stock_service_vs_inprocess_median",
            "stock_service_vs_inprocess_p95",
            "remote_vs_stock_service_median",
        ):
            assert positive(latency[mode]["ratios"][key]), (mode, key)
        kept = latency[mode]["messages_in_last_thread"]
        assert (
            kept["stock_service"] == kept["plain"] == 2 * latency["turns_per_thread"] > latency["window"]
        ), mode
        assert kept["remote"] <= latency["window"] and kept["inprocess"] <= latency["window"], mode
    floor = latency["floor"]
    for key in ("median_us", "p95_us", "client_cpu_us", "server_cpu_us"):
        assert positive(floor["exchange"][key]), key
    # The chat graph's turn, counted: one get_tuple, then puts chained one after another, writes beside them.
    calls = floor["calls_per_turn"]
    assert calls["get_tuple"] == 1 and calls["put"] >= 2 and calls["put_writes"] >= 1
    assert calls["sequential"] == calls["get_tuple"] + calls["put"] < calls["total"]
    assert positive(floor["idle_wake"]["back_to_back_us"]) and positive(floor["idle_wake"]["after_idle_us"])
    assert floor["floor_ratio_async"] > 1


def test_long_thread_section(quick_run: tuple[Path, dict, str]) -> None:
    long_thread = quick_run[1]["long_thread"]
    turns = long_thread["turns"]
    assert positive(turns) and positive(long_thread["rounds"])
    ranges = long_thread["ranges"]
    assert set(ranges) == {"first", "middle", "last"}
    assert all(1 <= first <= last <= turns for first, last in ranges.values())
    for kind in ("service", "plain", "inprocess"):
        figures = long_thread[kind]
        assert len(figures["per_turn_ms"]) == turns, kind
        assert all(positive(value) for value in figures["per_turn_ms"]), kind
        for name in ranges:
            assert positive(figures[f"{name}_median_ms"]), (kind, name)
        assert positive(figures["total_s"]), kind
        assert len(figures["round_totals_s"]) == long_thread["rounds"]
        assert all(positive(value) for value in figures["round_totals_s"]), kind
    for key in (
        "service_vs_plain_total",
        "service_vs_plain_last_median",
        "service_vs_inprocess_total",
        "service_vs_inprocess_last_median",
    ):
        assert positive(long_thread["ratios"][key]), key
    assert positive(long_thread["inprocess_store_items"])


def test_throughput_section(quick_run: tuple[Path, dict, str]) -> None:
    levels = quick_run[1]["throughput"]["levels"]
    # --quick: 1 and 2 agents one per process, and 8 agents as asyncio tasks in 2 processes.
    assert [(level["agents"], level["processes"]) for level in levels] == [(1, 1), (2, 2), (8, 2)]
    assert levels[-1]["agents_per_process"] == 4
    assert quick_run[1]["throughput"]["modes"] == ["service", "inprocess", "plain", "stock_service"]
    for level in levels:
        for mode in ("service", "inprocess", "plain", "stock_service"):
            figures = level[mode]
            for key in (
                "turns",
                "turns_per_s",
                "median_ms",
                "p95_ms",
                "connections_max",
                "agent_cpu_us_per_turn",
                "postgres_cpu_us_per_turn",
                "machine_cpu_us_per_turn",
            ):
                assert positive(figures[key]), (level["agents"], mode, key, figures[key])
            # Every turn writes WAL (checkpoints, blobs, writes) and commits.
            assert positive(figures["wal_per_turn"]["records"]) and positive(figures["wal_per_turn"]["bytes"])
            service_cpu = figures.get("service_cpu_us_per_turn", 0.0)
            expected = figures["agent_cpu_us_per_turn"] + figures["postgres_cpu_us_per_turn"] + service_cpu
            assert abs(figures["cpu_us_per_turn"] - expected) < 1.0, (mode, figures)
            # Agents that failed are counted, by error; none leaves a connection behind.
            assert 0 <= figures["agents_completed"] <= figures["agents_connected"] <= level["agents"]
            assert sum(figures["errors"].values()) >= figures["connect_failures"] + figures["turn_failures"]
            assert figures["leftover_agent_connections"] == 0, (level["agents"], mode)
        service = level["service"]
        assert service["errors"] == {} and service["agents_completed"] == level["agents"], service["errors"]
        assert positive(service["service_cpu_us_per_turn"])
        for mode in ("inprocess", "plain"):
            assert positive(level["ratios"][f"service_vs_{mode}_turns_per_s"]), mode
            assert positive(level["ratios"][f"service_vs_{mode}_connections_max"]), mode
        # The stock-saver service: its own connections (not counted as the service's), its own CPU.
        stock = level["stock_service"]
        assert stock["errors"] == {} and stock["agents_completed"] == level["agents"], stock["errors"]
        assert positive(stock["service_cpu_us_per_turn"])
        for key in (
            "stock_service_vs_inprocess_turns_per_s",
            "stock_service_vs_inprocess_machine_cpu_per_turn",
            "service_vs_stock_service_turns_per_s",
        ):
            assert positive(level["ratios"][key]), key
        # Both services' workers traced every request by stage, and the agents' notes found theirs.
        for mode in ("service", "stock_service"):
            stages = level[mode]["stages"]
            assert stages["requests"] >= 6 * level[mode]["turns"] * 0.9, (mode, stages["requests"])
            assert 0 < stages["joined_with_agents"] <= stages["requests"], mode
            assert sum(worker["requests"] for worker in stages["by_worker"].values()) == stages["requests"]
            for name, figures in stages["stages_ms"].items():
                assert 0 <= figures["median"] <= figures["p95"] <= figures["p99"], (mode, name, figures)
            assert positive(stages["stages_ms"]["database"]["median"]) and positive(
                stages["stages_ms"]["round_trip"]["median"]
            )
            assert level[mode]["turns_by_agent"]["min"] <= level[mode]["turns_by_agent"]["max"]
            # Every agent is counted on the one worker that served most of its requests, once per round.
            assert [sum(split) for split in stages["agents_by_worker_by_round"]] == [level["agents"]], mode
            assert level[mode]["database_per_turn"]["xact_commit"] > 0, mode


def test_service_cost_section(quick_run: tuple[Path, dict, str]) -> None:
    cost = quick_run[1]["service_cost"]
    for route in ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get", "/healthz"):
        figures = cost["routes"][route]
        assert figures["requests_counted_by_service"] == figures["requests"], route
        assert positive(figures["cpu_us_per_request"]), route
        # The bare exchange under the same server, loaded with the route's requests: CPU read from /proc in
        # clock ticks, so a quick run's few requests may read 0.
        assert figures["bare_cpu_us_per_request"] >= 0 and positive(figures["bare_requests_per_s"]), route
        assert figures["own_cpu_us_per_request"] == round(
            figures["cpu_us_per_request"] - figures["bare_cpu_us_per_request"], 1
        ), route
    for route in ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get"):
        assert positive(cost["routes"][route]["request_bytes_mean"]), route
    # The get answers a whole checkpoint; writes/put answers 204, with no body.
    assert (
        cost["routes"]["/v1/checkpoints/get"]["answer_bytes_mean"]
        > cost["routes"]["/v1/checkpoints/get"]["request_bytes_mean"]
    )
    assert positive(cost["cpu_us_per_turn_from_routes"])
    assert cost["bare_cpu_us_per_turn"] >= 0 and positive(cost["own_cpu_us_per_turn"])
    # The stock-saver service measured the same way: every request reached it, each route has a figure.
    stock = cost["stock_service"]
    for route in ("/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get"):
        figures = stock["routes"][route]
        assert figures["requests_counted_by_service"] == figures["requests"], route
        assert positive(figures["cpu_us_per_request"]), route
    assert positive(stock["cpu_us_per_turn_from_routes"])
    profile = cost["profile"]
    assert "error" not in profile, profile.get("error")
    assert positive(profile["samples"])
    assert profile["top_own"] and all(positive(entry["samples"]) for entry in profile["top_own"])
    assert profile["top_inclusive"] and profile["components"]


def test_targets_and_charts(quick_run: tuple[Path, dict, str]) -> None:
    out, results, stdout = quick_run
    targets = results["targets"]
    for key in (
        "remote_vs_inprocess_median_sync",
        "remote_vs_inprocess_median_async",
        "remote_vs_inprocess_p95_sync",
        "remote_vs_inprocess_p95_async",
        "remote_vs_plain_median_sync",
        "remote_vs_plain_median_async",
        "agents_service_vs_inprocess_turns_per_s",
        "agents_service_vs_plain_turns_per_s",
        "agents_connections_service",
        "agents_connections_inprocess",
        "agents_connections_plain",
        "agents_connections_service_vs_inprocess",
        "many_agents_service_connections_max",
        "service_own_cpu_us_per_turn",
        "service_own_cpu_us_put",
        "service_own_cpu_us_writes",
        "service_own_cpu_us_get",
        "floor_stock_service_vs_inprocess_median_sync",
        "floor_stock_service_vs_inprocess_median_async",
        "floor_stock_service_vs_inprocess_turns_per_s",
        "newest_blob_final_vs_window_fill",
        "pruned_thread_vs_window_checkpoint",
        "long_thread_service_vs_plain_total",
        "long_thread_service_vs_plain_last_median",
    ):
        assert positive(targets[key]), key
    assert targets["many_agents_level"] == "8 agents in 2 processes"
    assert targets["many_agents_service_errors"] == 0
    assert targets["many_agents_agents_completed"]["service"] == 8
    for mode in ("service", "inprocess", "plain"):
        assert positive(targets["many_agents_turns_per_s"][mode]) and positive(
            targets["many_agents_p95_ms"][mode]
        )
    for key in (
        "growth_keep_last_vs_first_sample",
        "growth_keep_vs_delta_at_last",
        "growth_keep_outbox_vs_store",
    ):
        assert positive(targets[key]), key
    for name in ("storage.png", "growth.png", "performance.png", "long_thread.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, (name, len(data))
    assert "Targets (ratios from this run)" in stdout


def test_service_instructions_cpu_mode_measures_every_route() -> None:
    """`python -m benchmarks.service_instructions` (in process, memory backend): a figure per route."""
    figures = _instructions("--mode", "cpu", "--conversations", "2", "--rounds", "1")
    assert set(figures) == {"/v1/checkpoints/put", "/v1/writes/put", "/v1/checkpoints/get"}
    for route in figures.values():
        assert route["requests"] > 0
        assert positive(route["cpu_us_best"]) and route["cpu_us_median"] >= route["cpu_us_best"]


def _benchmark(module: str, *args: str) -> dict:
    """What ``python -m module args`` prints, read as JSON (the service's settings left out of its
    environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return json.loads(result.stdout)


def _instructions(*args: str) -> dict:
    return _benchmark("benchmarks.service_instructions", *args)


def test_service_instructions_statements_mode_counts_a_puts_statements(fresh_pg: str) -> None:
    """`--mode statements` (PostgreSQL): a put sends its blobs and its row, in at least one transaction (the
    service's work by the second counts too); a read of the latest checkpoint one statement."""
    figures = _instructions(
        "--mode", "statements", "--conversations", "2", "--rounds", "1", "--database", fresh_pg
    )
    put, get = figures["/v1/checkpoints/put"], figures["/v1/checkpoints/get"]
    # Its row: PostgresSaver's upsert, or (a put with a parent) the upsert that checks the parent first.
    rows = {kind: count for kind, count in put["by_statement"].items() if kind.endswith(" INTO checkpoints")}
    assert set(rows) <= {"INSERT INTO .. INTO checkpoints", "WITH put .. INTO checkpoints"}, rows
    assert sum(rows.values()) == 1.0, rows
    assert put["statements"] >= 2 and put["transactions"] >= 1
    assert get["statements"] >= 1 and positive(get["transactions"])


def test_service_instructions_delivery_mode_writes_a_claim_in_three_statements(fresh_pg: str) -> None:
    """`--mode delivery` (PostgreSQL): a claim over several namespaces is one claim, one store write and
    one completion."""
    figures = _instructions(
        "--mode", "delivery", "--namespaces", "4", "--rounds", "5", "--database", fresh_pg
    )
    assert figures["messages_a_claim"] == 8
    assert figures["statements_a_claim"] == 3
    assert positive(figures["cpu_us_per_message_best"])


def test_group_commit_writes_every_put_in_each_mode_and_shares_the_commits(fresh_pg: str) -> None:
    """`python -m benchmarks.group_commit`: each mode stores every put it timed; the shared modes commit
    once a group of 8, so PostgreSQL syncs its WAL far less often than once a put (its WAL writer may
    also flush a group's records before the commit: a sync or two more)."""
    figures = _benchmark(
        "benchmarks.group_commit", "--puts", "40", "--group", "8", "--rounds", "2", "--database", fresh_pg
    )
    assert figures["checkpoints_stored"] == {"each": 80, "shared_commit": 80, "shared_pipeline": 80}
    for mode, medians in figures["medians"].items():
        assert positive(medians["client_and_postgres_us"]) and positive(medians["wal_records"]), mode
    syncs = {mode: sum(run["wal_syncs"] for run in runs) for mode, runs in figures["runs"].items()}
    assert syncs["shared_commit"] < syncs["each"] / 2 and syncs["shared_pipeline"] < syncs["each"] / 2, syncs
    assert set(figures["saved_us_a_put"]) == {"shared_commit", "shared_pipeline"}


@pytest.mark.parametrize("program", ["stock_service", "service"])
def test_stock_service_does_none_of_the_services_work(program: str, fresh_pg: str, tmp_path: Path) -> None:
    """The stock-saver service (the floor under the service's figures) stores what the client sent through
    the stock saver in every worker process: no window; the real service, run the same way, keeps one."""
    import asyncio

    from benchmarks import stock_service
    from benchmarks._common import chat_graph, thread_config, user_input
    from reducing_saver.client import RemoteReducingSaver
    from tests.support.server import run_service

    args = ("--database", fresh_pg, "--max-messages", "4", "--workers", "2")
    running = (
        stock_service.run(tmp_path, *args) if program == "stock_service" else run_service(tmp_path, *args)
    )

    async def kept(url: str) -> list[int]:
        counts = []
        for number in range(8):  # a client (and connection) each, so both workers answer some
            async with RemoteReducingSaver(url) as saver:
                graph, config = chat_graph(saver), thread_config(f"stock-{number}")
                for turn in range(4):
                    await graph.ainvoke(user_input(turn), config)
                counts.append(len((await graph.aget_state(config)).values["messages"]))
        return counts

    with running as service:
        counts = asyncio.run(kept(service.url))
    assert counts == ([8] * 8 if program == "stock_service" else [4] * 8)


def _listening(port: int) -> dict[int, set[int]]:
    """The sockets listening on ``port`` (IPv4), by inode, and the processes holding each (from /proc)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(int(fields[9]))
    holders: dict[int, set[int]] = {inode: set() for inode in inodes}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = [os.readlink(fd) for fd in fd_dir.iterdir()]
        except OSError:  # gone, or not ours
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in holders:
                holders[int(link[8:-1])].add(int(fd_dir.parent.name))
    return holders


@pytest.mark.parametrize("reuse_port", [True, False])
def test_reuse_port_experiment_gives_each_worker_a_socket(
    reuse_port: bool, fresh_pg: str, tmp_path: Path
) -> None:
    """`--ab-args --reuse-port` (benchmarks.stages): each worker listens on a socket of its own, the
    supervisor on none, and new connections reach both workers; without it the processes share one socket."""
    import asyncio

    from benchmarks import stages
    from reducing_saver.client import RemoteReducingSaver
    from tests.support.server import run_service

    records = tmp_path / "stages"
    records.mkdir()
    env = {stages.ENV: str(records), **({stages.REUSE_PORT_ENV: "1"} if reuse_port else {})}

    async def read_from_new_clients(url: str) -> None:
        for number in range(16):  # a client (and connection) each
            async with RemoteReducingSaver(url) as saver:
                await saver.aget_tuple(
                    {"configurable": {"thread_id": f"reuse-{number}", "checkpoint_ns": ""}}
                )

    program = (sys.executable, "-m", "benchmarks.stages")
    with run_service(tmp_path, "--database", fresh_pg, "--workers", "2", env=env, program=program) as service:
        port = int(service.url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while True:  # /readyz answers once one worker is up; wait for both
            sockets = _listening(port)
            processes = set().union(*sockets.values())
            if len(processes - {service.process.pid}) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        asyncio.run(read_from_new_clients(service.url))
        time.sleep(1.0)  # the workers write their records every half second
        served = {path.stem for path in records.glob("service-*.tsv") if path.read_text()}
    supervisor = service.process.pid
    if reuse_port:
        assert len(sockets) == 2, sockets
        holders = [pids for pids in sockets.values()]
        assert all(len(pids) == 1 for pids in holders) and supervisor not in set().union(*holders), holders
        assert len(served) == 2, served
    else:
        assert len(sockets) == 1, sockets
        assert supervisor in next(iter(sockets.values())), sockets
