"""deploy/grafana-dashboard.json: every PromQL query names metrics (and labels) the running service exposes.

A real service (uvicorn, PostgreSQL, two tenants) takes traffic from a real LangGraph graph until its
storage gauges have measured it; then /metrics is scraped and every query of the dashboard is checked
against the scrape. The checker is also shown a dashboard with a misspelt metric, which it must refuse.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reducing_saver.client import RemoteReducingSaver
from tests.service.storage.test_usage import KEYS, converse
from tests.support.server import ROOT, run_service

pytestmark = pytest.mark.e2e

DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
_IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}


def queries(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' nested panels too) and template
    variables (``label_values(metric, label)`` given as ``metric{label=""}``)."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[str]:
        for panel in panels:
            for target in panel.get("targets", []):
                yield target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        found = re.fullmatch(rf"label_values\(\s*({_IDENT})\s*,\s*({_IDENT})\s*\)", query)
        assert found is not None, f"template variable {variable['name']}: unsupported query {query!r}"
        yield f'{found[1]}{{{found[2]}=""}}'


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """``(metric name, label names matched)`` of every series selector in a PromQL expression."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, $variables)
    found = [
        (name, set(re.findall(rf"({_IDENT})\s*(?:=~|!~|!=|=)", labels)))
        for name, labels in re.findall(rf"({_IDENT})\s*\{{([^}}]*)\}}", text)
    ]
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    bare = re.findall(
        rf"(?<![\w.:])({_IDENT})(?![\w:]|\s*\()", text
    )  # identifiers that are not function calls
    named = {name for name, _ in found}
    found += [(name, set()) for name in bare if name not in _KEYWORDS and name not in named]
    return found


def problems(dashboard: dict[str, Any], exposed: dict[str, set[str]]) -> list[str]:
    """What the dashboard asks that the scrape does not have: unknown metrics, labels a metric lacks."""
    out = []
    for expr in queries(dashboard):
        chosen = selectors(expr)
        if not chosen:
            out.append(f"{expr!r}: names no metric")
        for name, labels in chosen:
            if name not in exposed:
                out.append(f"{expr!r}: metric {name} is not exposed")
            elif missing := labels - exposed[name] - {"__name__"}:
                out.append(f"{expr!r}: metric {name} has no label {sorted(missing)}")
    return out


def scrape(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry."""
    exposed: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exposed.setdefault(sample.name, set()).update(sample.labels)
    return exposed


def storage_figures(text: str) -> dict[tuple[str, str], float]:
    return {
        (sample.labels["tenant"], sample.labels["kind"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "reducing_saver_storage_bytes"
    }


def test_every_dashboard_query_names_exposed_metrics(fresh_pg: str, tmp_path: Path) -> None:
    api_keys = ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())
    args = [
        "--database",
        fresh_pg,
        "--max-messages",
        "6",
        "--min-messages",
        "4",
        "--storage-refresh-seconds",
        "0.5",
    ]
    env = {"REDUCING_SAVER_API_KEYS": api_keys, "REDUCING_SAVER_METRICS_KEY": "scraper-key"}
    with run_service(tmp_path, *args, env=env) as service:
        for tenant, turns in (("a", 8), ("b", 2)):
            with RemoteReducingSaver(service.url, api_key=KEYS[tenant]) as saver:
                converse(saver, f"thread-{tenant}", turns, seed=turns)
        # The scraper's key, as Prometheus sends it (a tenant's key gets 403: /metrics shows every tenant).
        headers = {"Authorization": "Bearer scraper-key"}
        assert httpx.get(f"{service.url}/metrics", headers={"x-api-key": KEYS["a"]}).status_code == 403
        deadline = time.monotonic() + 30
        while True:  # until a measuring pass started after both threads has seen the extracted messages
            text = httpx.get(f"{service.url}/metrics", headers=headers).text
            figures = storage_figures(text)
            if figures.get(("a", "store"), 0) > 0 and figures.get(("b", "checkpoints"), 0) > 0:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
    exposed = scrape(text)
    dashboard = json.loads(DASHBOARD.read_text())
    assert problems(dashboard, exposed) == []
    # The dashboard charts the storage gauges, and their tenant label holds only the configured tenants.
    named = {name for expr in queries(dashboard) for name, _ in selectors(expr)}
    assert {"reducing_saver_storage_bytes", "reducing_saver_storage_plain_estimate_bytes"} <= named
    assert {tenant for tenant, _ in figures} == {"a", "b"}
    assert {kind for _, kind in figures} == {"checkpoints", "blobs", "writes", "outbox", "store"}
    # A misspelt metric and a label the metric lacks are both caught.
    broken = copy.deepcopy(dashboard)
    target = next(p for p in broken["panels"] if p.get("targets"))["targets"][0]
    target["expr"] = (
        'sum(reducing_saver_storage_byte{tenant=~"$tenant"}) + sum(reducing_saver_storage_threads{kind="x"})'
    )
    assert problems(broken, exposed) == [
        f"{target['expr']!r}: metric reducing_saver_storage_byte is not exposed",
        f"{target['expr']!r}: metric reducing_saver_storage_threads has no label ['kind']",
    ]


def test_selectors_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{route="/v1/x", status=~"5.."}[5m]))) '
        "/ on (tenant) group_left b + time() - c offset 5m"
    )
    assert selectors(expr) == [("a_bucket", {"route", "status"}), ("b", set()), ("c", set())]
