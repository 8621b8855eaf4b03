"""Every page and every read of the JSON API on a temporary database: status, content, JSON,
and 4xx (never 5xx) for bad input."""

from __future__ import annotations

import json
import re

import pytest
from admin_helpers import END_TIME, seed_run
from sglang_adatree.admin import PLOTLY_JS
from synthetic_runs import insert_run

from sglang_adatree.telemetry import store

pytest_plugins = ["admin_fixtures"]

PAGES = ("/", "/shapes", "/cost-model", "/policies", "/pins", "/retrain", "/runs", "/audit")
APIS = (
    "/api/overview",
    "/api/shapes",
    "/api/cost-model",
    "/api/policies",
    "/api/pins",
    "/api/retrain",
    "/api/runs",
    "/api/audit",
)


@pytest.fixture
def seeded(db_url) -> int:
    return seed_run(db_url, 3000, seed=1)


def figure_data(html: str, figure_id: str) -> dict:
    """The Plotly figure a page embeds for the element ``figure_id``."""
    match = re.search(
        rf'<script type="application/json" id="{figure_id}-data">(.*?)</script>', html, re.S
    )
    assert match, f"no figure {figure_id}"
    return json.loads(match.group(1))


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders_with_data(operator, seeded, path):
    response = operator.get(path)
    assert response.status_code == 200
    assert response.mimetype == "text/html"
    assert "adatree" in response.text


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders_without_runs(operator, path):
    response = operator.get(path)
    assert response.status_code == 200


@pytest.mark.parametrize("path", APIS)
def test_every_api_answers_json(operator, seeded, path):
    response = operator.get(path)
    assert response.status_code == 200
    assert response.is_json


def test_overview_page_embeds_the_series_of_the_latest_run(operator, seeded):
    html = operator.get("/?range=run").text
    fig = figure_data(html, "overview-figure")
    names = [t["name"] for t in fig["data"]]
    assert names == [
        "goodput (tok/s)",
        "acceptance length",
        "batch size",
        "step time (ms)",
        "shape",
    ]
    assert all(len(t["x"]) > 0 for t in fig["data"])
    assert f"run #{seeded}" in html


def test_overview_api_json(operator, seeded):
    data = operator.get(f"/api/overview?run={seeded}&range=run").get_json()
    assert data["run_id"] == seeded
    assert data["summary"]["num_steps"] == 3000
    assert data["range"]["end"] == pytest.approx(END_TIME, abs=1.0)
    series = data["series"]
    n = data["resolution"]["points"]
    assert 0 < n <= 2000
    assert {len(v) for v in series.values()} == {n}
    assert "figure" not in data
    assert data["latest"]["step_index"] == 2999
    assert data["active_pins"] == 0 and data["active_policy_version"] is None


def test_overview_api_figure_flag_adds_the_page_figure(operator, seeded):
    data = operator.get("/api/overview?range=5m&figure=true").get_json()
    assert len(data["figure"]["data"]) == 5
    assert data["figure"]["data"][0]["x"]


def test_ranges_narrow_the_overview(operator, seeded):
    # 3000 steps at 50 per second: one minute, so "5m" and "run" cover the same steps.
    whole = operator.get("/api/overview?range=run").get_json()
    five = operator.get("/api/overview?range=5m").get_json()
    assert whole["summary"]["num_steps"] == five["summary"]["num_steps"] == 3000


def test_shapes_api(operator, seeded):
    data = operator.get("/api/shapes?range=run").get_json()
    assert data["num_steps"] == 3000
    assert data["shapes"]
    for shape in data["shapes"]:
        assert sum(data["by_batch_size"][shape].values()) == sum(
            data["by_accept_len"][shape].values()
        )
    assert sum(data["acceptance_by_rank"]) == pytest.approx(1.0)
    pairs = data["runner_ups"]
    assert pairs and sum(p["steps"] for p in pairs) == 3000
    assert {p["shape"] for p in pairs} == set(data["shapes"])
    assert all(p["runner_up"] != p["shape"] for p in pairs)


def test_shapes_page_lists_the_runner_ups(operator, seeded):
    html = operator.get("/shapes?range=run").text
    table = re.search(r'<table id="runner-ups">(.*?)</table>', html, re.S)
    assert table, "no runner-up table"
    pairs = operator.get("/api/shapes?range=run").get_json()["runner_ups"]
    body_rows = re.findall(r"<tr><td>([\d,]+)</td><td>([\d,]+)</td><td>(\d+)</td>", table.group(1))
    assert [(a, b, int(n)) for a, b, n in body_rows] == [
        (p["shape"], p["runner_up"], p["steps"]) for p in pairs
    ]


def test_cost_model_api(operator, seeded):
    data = operator.get("/api/cost-model?range=run").get_json()
    versions = {v["version"] for v in data["versions"]}
    assert versions == {"fallback", "v1", "v2"}
    assert 0 < len(data["sample"]["time"]) <= 2000
    split = data["sample"]["price_drift"], data["sample"]["price_offset"]
    assert all(len(v) == len(data["sample"]["time"]) for v in split)


def test_runs_api(operator, seeded):
    runs = operator.get("/api/runs").get_json()["runs"]
    assert [r["id"] for r in runs] == [seeded]
    assert runs[0]["last_step_index"] == 2999
    one = operator.get(f"/api/runs/{seeded}").get_json()
    assert one["candidate_shapes"] == runs[0]["candidate_shapes"]


def test_run_parameter_selects_the_run_on_every_page(operator, db_url):
    first = seed_run(db_url, 500, seed=2, end_time=END_TIME - 3600)
    second = seed_run(db_url, 800, seed=3)
    assert operator.get("/api/overview").get_json()["run_id"] == second
    data = operator.get(f"/api/overview?run={first}&range=run").get_json()
    assert data["run_id"] == first and data["summary"]["num_steps"] == 500
    for path in PAGES:
        html = operator.get(f"{path}?run={first}").text
        assert f'<option value="{first}" selected' in html


def test_plotly_is_served_from_the_installed_package(operator):
    response = operator.get("/assets/plotly.min.js")
    assert response.status_code == 200
    assert response.data == PLOTLY_JS.read_bytes()
    page = operator.get("/").text
    # Every script, style and link stays on this server: no absolute or protocol-relative URL.
    # (Not a search for "cdn" in the page: the random CSRF token contained it once.)
    sources = re.findall(r'\b(?:src|href)="([^"]*)"', page)
    assert sources and not [s for s in sources if "//" in s], sources


def test_security_headers(operator):
    response = operator.get("/")
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/api/overview?range=week", 400),
        ("/api/overview?run=abc", 400),
        ("/api/overview?run=-1", 400),
        ("/api/overview?run=99999999999999999999999", 400),
        ("/api/overview?run=777", 404),
        ("/api/overview?figure=maybe", 400),
        ("/api/shapes?run=0", 400),
        ("/api/cost-model?range=", 400),
        ("/api/runs/777", 404),
        ("/api/runs/99999999999", 404),
        ("/api/retrain/5", 404),
        ("/api/nothing-here", 404),
    ],
)
def test_bad_api_input_is_a_json_4xx(operator, seeded, path, status):
    response = operator.get(path)
    assert response.status_code == status
    assert response.is_json and response.get_json()["error"]


@pytest.mark.parametrize(
    ("path", "status"),
    [("/?range=week", 400), ("/shapes?run=777", 404), ("/cost-model?run=x", 400), ("/no", 404)],
)
def test_bad_page_input_is_an_html_4xx(operator, seeded, path, status):
    response = operator.get(path)
    assert response.status_code == status
    assert response.mimetype == "text/html"
    assert 'role="alert"' in response.text


def test_api_without_runs_is_404_not_500(operator):
    for path in ("/api/overview", "/api/shapes", "/api/cost-model"):
        response = operator.get(path)
        assert response.status_code == 404
        assert response.get_json()["error"] == "no runs recorded yet"


def test_wrong_method_is_405_with_allow(operator):
    response = operator.client.delete("/api/pins", headers={"X-CSRF-Token": operator.csrf})
    assert response.status_code == 405
    assert "POST" in response.headers["Allow"]
    assert response.is_json


def test_a_run_without_steps_renders_empty(operator, db_url):
    run_id = insert_run(store.get_engine(db_url), started_at=END_TIME)
    for path in PAGES:
        assert operator.get(path).status_code == 200, path
    data = operator.get("/api/overview?figure=1").get_json()
    assert data["run_id"] == run_id and data["resolution"]["points"] == 0
    assert data["summary"] == {
        "num_steps": 0,
        "goodput": None,
        "accept_len": None,
        "shape_shares": {},
    }
    assert data["latest"] is None
    assert operator.get("/api/shapes").get_json()["num_steps"] == 0
    assert operator.get("/api/cost-model").get_json()["versions"] == []
