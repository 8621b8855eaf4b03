"""The Grafana dashboard in ``deploy/grafana/adatree.json``: every panel's PromQL (and the
template variables' queries) names only series the server exports, as ``AdaTreeMetrics``
creates them with the suffixes prometheus_client adds; panels are laid out without overlap."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sglang_adatree.telemetry.metrics import AdaTreeMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "adatree.json"

# The names prometheus_client exposes for each family type.
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "inf", "nan"}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    AdaTreeMetrics({"model_name": "m"}, registry)
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


def metric_names(expr: str) -> set[str]:
    """The series an expression selects: identifiers that are not functions, keywords, label
    names (inside ``{}``, ``by (...)``, ``on (...)``...), ranges or Grafana variables."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # grouping labels
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables outside ranges
    names = set()
    for match in IDENT.finditer(text):
        name = match.group()
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or name.lower() in KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if text[: match.start()].rstrip().endswith(tuple("0123456789.")):
            continue  # the exponent or unit of a number (1e3)
        names.add(name)
    return names


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
            assert inner, variable["definition"]
            found.append((f"variable {variable['name']}", inner.group(1)))
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_parser_finds_series_and_only_series():
    expr = (
        'sum by (depth) (rate(adatree_accepted_tokens_total{model_name=~"$model_name"}'
        "[$__rate_interval])) / on (depth) sum by (depth) (rate(offered_total[5m])) * 1e3"
    )
    assert metric_names(expr) == {"adatree_accepted_tokens_total", "offered_total"}
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(x_bucket[1m])))") == {"x_bucket"}


def test_every_query_names_only_exported_series(dashboard):
    exported = exported_names()
    assert "adatree_decode_steps_total" in exported
    assert "adatree_telemetry_queued_records" in exported
    referenced = set()
    for where, expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no series in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} are not exported by AdaTreeMetrics"
        referenced |= names
        assert expr.count("(") == expr.count(")"), f"{where}: unbalanced {expr!r}"
    # The dashboard shows what the issue asks for: goodput, acceptance by depth, steps per
    # shape and source, step time, unfinished steps, the telemetry backlog and drops.
    for name in (
        "adatree_emitted_tokens_total",
        "adatree_step_seconds_total",
        "adatree_accepted_tokens_total",
        "adatree_offered_tokens_total",
        "adatree_steps_total",
        "adatree_step_time_ms",
        "adatree_unfinished_steps_total",
        "adatree_telemetry_queued_records",
        "adatree_telemetry_dropped_records_total",
    ):
        assert name in referenced, f"no panel shows {name}"


def test_panels_have_unique_ids_and_do_not_overlap(dashboard):
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p.get("description")
