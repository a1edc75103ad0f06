"""An agent worker process: runs chat turns on some threads and writes what it saw as JSON.

    python -m tests.support.agent_worker --url URL[,URL2] --threads a,b --turns 30 --out result.json [--async]
    python -m tests.support.agent_worker --database postgresql://... --max-messages 6 --min-messages 4 ...

With --url it talks to the service through RemoteReducingSaver (with several URLs, turn n of every
thread goes to URL n mod k, so each thread's puts land on every replica); with --database it runs the
same agent in-process on ReducingSaver(PostgresSaver), for congruence. --acks FILE appends every
checkpoint a put acknowledged, as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from contextlib import ExitStack
from typing import Any

from tests.support.agents import build_agent, user_line


def thread_config(thread_id: str) -> dict[str, Any]:
    configurable: dict[str, Any] = {"thread_id": thread_id}
    if thread_id.endswith(("0", "2", "4", "6", "8")):
        configurable["memory_namespace"] = ["team", thread_id]
    return {"configurable": configurable}


def record(result: dict, thread_id: str, output: dict) -> None:
    entry = result.setdefault(thread_id, {"answers": [], "ids": []})
    entry["answers"].append(output["messages"][-1].content)
    for message in output["messages"]:
        if message.id not in entry["ids"]:
            entry["ids"].append(message.id)


def run_sync(graphs: list[Any], threads: list[str], turns: int) -> dict:
    result: dict = {}
    for turn in range(turns):
        for thread_id in threads:
            graph = graphs[turn % len(graphs)]
            output = graph.invoke({"messages": [("user", user_line(turn))]}, thread_config(thread_id))
            record(result, thread_id, output)
    return result


async def run_async(graphs: list[Any], threads: list[str], turns: int) -> dict:
    result: dict = {}
    for turn in range(turns):
        for thread_id in threads:
            graph = graphs[turn % len(graphs)]
            output = await graph.ainvoke({"messages": [("user", user_line(turn))]}, thread_config(thread_id))
            record(result, thread_id, output)
    return result


def log_acks(saver: Any, path: str) -> None:
    """Append every checkpoint ``saver`` acknowledged to ``path``."""
    put, aput = saver.put, saver.aput

    def write(config: dict) -> None:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(config["configurable"]) + "\n")

    def logged_put(*args: Any) -> Any:
        config = put(*args)
        write(config)
        return config

    async def logged_aput(*args: Any) -> Any:
        config = await aput(*args)
        write(config)
        return config

    saver.put, saver.aput = logged_put, logged_aput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--database")
    parser.add_argument("--max-messages", type=int, default=6)
    parser.add_argument("--min-messages", type=int, default=4)
    parser.add_argument("--threads", required=True)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--acks")
    args = parser.parse_args()
    threads = args.threads.split(",")

    with ExitStack() as stack:
        if args.url:
            from reducing_saver.client import RemoteReducingSaver

            savers = [
                stack.enter_context(RemoteReducingSaver(url, max_retries=args.retries, backoff=0.2))
                for url in args.url.split(",")
            ]
        else:
            from langgraph.checkpoint.postgres import PostgresSaver

            from reducing_saver.reducer import MessageReducer, ReducingSaver

            inner = stack.enter_context(PostgresSaver.from_conn_string(args.database))
            inner.setup()
            savers = [
                ReducingSaver(
                    inner, MessageReducer(max_messages=args.max_messages, min_messages=args.min_messages)
                )
            ]
        if args.acks:
            for saver in savers:
                log_acks(saver, args.acks)
        graphs = [build_agent(saver) for saver in savers]
        if args.use_async:
            result = asyncio.run(run_async(graphs, threads, args.turns))
        else:
            result = run_sync(graphs, threads, args.turns)
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
