"""The dashboard in real headless Chromium (Debian's, driven by Playwright; nothing downloads a
browser): log in, see the overview's charts drawn with data and refreshed live, pin a shape and
see it listed, press Retrain and see the new policy version. ``adatree admin`` serves a seeded
database from a subprocess, as an operator would run it. Screenshots go to
``artifacts/browser/``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helper modules

from admin_helpers import TOKEN, seed_run

from sglang_adatree.telemetry import store

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Debian's chromium is not installed (make system-deps)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"adatree admin exited: {proc.stdout.read()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("adatree admin did not start listening")


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[str]:
    """``adatree admin`` on a seeded database; its base URL."""
    url = f"sqlite:///{tmp_path_factory.mktemp('browser') / 'admin.sqlite'}"
    store.upgrade(url)
    # Two minutes of steps ending now, so "last 5 min" has data and refreshes look live.
    seed_run(url, 6000, seed=41, end_time=time.time())
    store.get_engine(url).dispose()
    port = _free_port()
    env = {**os.environ, "ADATREE_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "sglang_adatree.cli", "admin", "--db", url, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, dashboard):
    """A logged-in page; screenshots of each test land in ``artifacts/browser``."""
    context = browser.new_context(base_url=dashboard, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
    page.goto("/")
    assert page.url.endswith("/login?next=/")
    page.fill("input[name=name]", "browser")
    page.fill("input[name=token]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("h1:has-text('Overview')")
    yield page
    assert errors == [], errors  # no script errors, no CSP violations
    context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def refreshes(page) -> int:
    """How many live refreshes the overview's script has drawn."""
    return int(page.evaluate("() => document.getElementById('overview').dataset.refreshes || 0"))


def wait_until(condition, timeout: float = 15.0) -> None:
    """Poll from Python: Playwright's in-page ``wait_for_function`` evaluates a string, which
    the dashboard's Content-Security-Policy (no 'unsafe-eval') rightly blocks."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(0.1)


def traces(page, element_id: str) -> list[dict]:
    """Name and point count of each trace Plotly drew in the element (``_length`` is the
    points Plotly computed for the trace; heatmaps count their rows)."""
    return page.evaluate(
        """id => document.getElementById(id)._fullData.map(
               t => ({name: t.name, points: t._length ?? (t.z ? t.z.length : 0)}))""",
        element_id,
    )


def test_login_and_overview_charts_render_with_data_and_refresh_live(page):
    # Until the script has hooked the range links, a click on one navigates, and the page
    # read during that navigation has no overview yet.
    page.wait_for_selector("#overview[data-live='on']")
    page.click(".ranges a[data-range='5m']")
    wait_until(lambda: refreshes(page) >= 1)
    drawn = traces(page, "overview-figure")
    assert [t["name"] for t in drawn] == [
        "goodput (tok/s)",
        "acceptance length",
        "batch size",
        "step time (ms)",
        "shape",
    ]
    assert all(t["points"] > 100 for t in drawn), drawn
    assert page.locator("#overview-figure .main-svg").count() > 0  # drawn, not just data
    # Live refresh: the page fetches the API again on its own and is never reloaded.
    page.evaluate("() => { window.__not_reloaded = true; }")
    before = refreshes(page)
    wait_until(lambda: refreshes(page) > before)
    assert page.evaluate("() => window.__not_reloaded") is True
    assert "range=5m" in page.url
    shot(page, "overview")


def test_shapes_and_cost_model_pages_draw_their_figures(page):
    page.goto("/shapes?range=run")
    for figure in ("shapes-by-batch", "shapes-by-accept", "acceptance-depth", "acceptance-rank"):
        page.wait_for_selector(f"#{figure} .main-svg")
        assert traces(page, figure), figure
    shot(page, "shapes")
    page.goto("/cost-model?range=run")
    page.wait_for_selector("#cost-step-time .main-svg")
    names = [t["name"] for t in traces(page, "cost-step-time")]
    assert names == ["fallback", "v1", "v2", "predicted = measured"]
    page.wait_for_selector("#cost-split .main-svg")
    drawn = traces(page, "cost-split")
    assert [t["name"] for t in drawn] == [
        "no speculation's time",
        "a shape at 1.25x no speculation's, against it",
        "a shape at 2x no speculation's, against it",
    ]
    assert all(t["points"] > 100 for t in drawn), drawn
    shot(page, "cost-model")


def test_pin_a_shape_and_see_it_listed(page):
    page.goto("/pins")
    page.select_option("select[name=shape]", "3,2,6")
    page.fill("input[name=max_batch_size]", "16")
    page.fill("input[name=reason]", "browser test")
    page.click("form.pin-form button[type=submit]")
    row = page.locator("#active-pins tbody tr").first
    row.wait_for()
    assert "3,2,6" in row.inner_text() and "browser test" in row.inner_text()
    assert "batch size 1..16" in row.inner_text()
    shot(page, "pins")


def test_press_retrain_and_see_the_new_version(page):
    page.goto("/retrain")
    page.click("#retrain-button")
    # The job runs on the server's background thread; the page follows it and reloads
    # when it has finished.
    page.wait_for_selector("#jobs tr[data-finished='yes'] >> text=succeeded", timeout=180_000)
    assert "held-out MAPE" in page.inner_text("#jobs")
    shot(page, "retrain")
    page.goto("/policies")
    row = page.locator("#policies tr[data-version='1']")
    assert "active" in row.inner_text()
    assert "better than the refitted analytic model" in row.inner_text()
    shot(page, "policies")
