"""Fuzz the running service against its own OpenAPI document with schemathesis.

A real uvicorn process (`reducing-saver serve`, memory backend, one API key) and the schemathesis CLI
(`st run`), bounded by examples per operation so the run takes well under two minutes: at least 1,000
generated cases across every route, and no failing check. The checks are all of schemathesis's except
``positive_data_acceptance``: the document cannot express the service's cross-field rules (a thread id
is required inside the free-form ``configurable`` map of a put; a copy's source and target differ), so
schema-valid requests that break them are rightly answered 422. ``not_a_server_error`` (no 5xx),
``response_schema_conformance``, ``status_code_conformance`` (every status documented),
``negative_data_rejection`` (schema-invalid requests get 4xx) and ``ignored_auth`` (the key is enforced)
are among those kept.

``RS_TEST_FUZZ_SEED`` picks the seed (fixed by default, so CI is reproducible; the report names it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.server import run_service

KEY = "schemathesis-fuzzing-key-0123456789"
#: Examples per operation and phase; with 16 operations this generates well over 1,000 cases.
MAX_EXAMPLES = int(os.environ.get("RS_TEST_FUZZ_EXAMPLES", "60"))
SEED = int(os.environ.get("RS_TEST_FUZZ_SEED", "20261130"))
BUDGET_SECONDS = 120


def test_schemathesis_finds_nothing(tmp_path: Path):
    st = Path(sys.executable).with_name("schemathesis")
    assert st.exists(), "schemathesis is not installed: pip install -e '.[test]'"
    report = tmp_path / "schemathesis.json"
    env = {"REDUCING_SAVER_API_KEYS": f"fuzz={KEY}"}
    with run_service(tmp_path, "--database", "memory://", env=env) as service:
        started = time.monotonic()
        result = subprocess.run(
            [
                str(st),
                "run",
                f"{service.url}/openapi.json",
                "--header",
                f"Authorization: Bearer {KEY}",
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                str(SEED),
                "--workers",
                "2",
                "--request-timeout",
                "30",
                "--report",
                "json",
                "--report-json-path",
                str(report),
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=BUDGET_SECONDS + 60,
            cwd=tmp_path,
            env={**os.environ, "NO_PROXY": "*"},
        )
        elapsed = time.monotonic() - started
        assert service.process.poll() is None, "the service died under fuzzing"
        service_log = service.output()
    (tmp_path / "schemathesis.txt").write_text(result.stdout)
    details, _, summary = result.stdout.partition(" SUMMARY ")
    summary = details[-8000:] + summary[-3000:]
    assert report.exists(), f"no report; exit {result.returncode}\n{summary}\n{result.stderr[-3000:]}"
    data = json.loads(report.read_text())
    cases = data["test_cases"]
    assert data["operations"]["tested"] == data["operations"]["total"] >= 16, data["operations"]
    assert data["failures"] == [] and data["errors"] == [] and cases["with_failures"] == 0, summary
    assert cases["generated"] >= 1000, cases
    assert result.returncode == 0, summary
    assert elapsed < BUDGET_SECONDS, f"the fuzzing run took {elapsed:.0f}s"
    assert '"status": 500' not in service_log and "Traceback" not in service_log, service_log[-3000:]
    print(f"schemathesis: {cases['generated']} cases, seed {data['seed']}, {elapsed:.0f}s, no failures")
