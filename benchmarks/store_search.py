"""What reading memory through the service costs: RemoteStore.search vs PostgresStore.search, same database.

    .venv/bin/python -m benchmarks.store_search [--calls 300] [--items 200]

Creates a PostgreSQL database of its own (dropped afterwards), starts ``reducing-saver serve`` on it with
an API key, puts ``--items`` items under one namespace, then times ``search`` (limit 10, with and without
a filter) through ``RemoteStore`` (HTTP, the tenant's subtree) and through a local ``PostgresStore`` on
the same database and the same rows (``("tenants", tenant, ...)``), interleaved call by call so a busy
machine shifts both alike. Prints the median and p95 per call of each, and their difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from langgraph.store.base import PutOp
from langgraph.store.postgres import PostgresStore

from benchmarks._common import percentile, scratch_database
from reducing_saver.client import RemoteStore

KEY = "bench-store-key-0123456789abcdef"
TENANT = "bench"


def _serve(database: str, log: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cli = Path(sys.executable).with_name("reducing-saver")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDUCING_SAVER_")}
    env["REDUCING_SAVER_API_KEYS"] = f"{TENANT}={KEY}"
    process = subprocess.Popen(
        [str(cli), "serve", "--database", database, "--port", str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the service did not start:\n{log.read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--items", type=int, default=200)
    args = parser.parse_args()
    with scratch_database() as database, tempfile.TemporaryDirectory() as tmp:
        process, url = _serve(database, Path(tmp) / "service.log")
        try:
            with RemoteStore(url, api_key=KEY) as remote, PostgresStore.from_conn_string(database) as local:
                ns = ("memories", "user-42")
                remote.batch([])
                for i in range(0, args.items, 50):
                    remote.batch(
                        [
                            PutOp(ns, f"m{j}", {"text": f"message {j}", "kind": "note" if j % 2 else "fact"})
                            for j in range(i, min(i + 50, args.items))
                        ]
                    )
                stored = ("tenants", TENANT, *ns)
                for label, kwargs in [
                    ("search limit 10", {}),
                    ("search filter + limit 10", {"filter": {"kind": "fact"}}),
                ]:
                    times: dict[str, list[float]] = {"RemoteStore": [], "PostgresStore": []}
                    for _ in range(20):  # warm both
                        remote.search(ns, limit=10, **kwargs)
                        local.search(stored, limit=10, **kwargs)
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        got = remote.search(ns, limit=10, **kwargs)
                        times["RemoteStore"].append((time.perf_counter() - start) * 1e3)
                        start = time.perf_counter()
                        mine = local.search(stored, limit=10, **kwargs)
                        times["PostgresStore"].append((time.perf_counter() - start) * 1e3)
                        assert [i.key for i in got] == [i.key for i in mine]
                    medians = {name: statistics.median(values) for name, values in times.items()}
                    print(f"{label} ({args.calls} calls each, {args.items} items):")
                    for name, values in times.items():
                        print(
                            f"  {name:14} median {medians[name]:6.3f} ms   "
                            f"p95 {percentile(values, 0.95):6.3f} ms"
                        )
                    print(
                        f"  HTTP adds {medians['RemoteStore'] - medians['PostgresStore']:.3f} ms per call "
                        f"({medians['RemoteStore'] / medians['PostgresStore']:.1f}x)"
                    )
        finally:
            process.terminate()
            process.wait(timeout=15)


if __name__ == "__main__":
    main()
