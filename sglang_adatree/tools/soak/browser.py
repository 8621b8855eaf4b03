"""A headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright; nothing downloads a
browser) that keeps the dashboard's overview and shapes pages open for the whole soak: the
overview refreshes itself every few seconds, the shapes page is reloaded every
``reload_s``, the overview every fourth time. Every response the pages get is logged, and so is
every script error.
"""

from __future__ import annotations

import threading
from pathlib import Path
from urllib.parse import urlparse

from sglang_adatree.tools.soak.tally import DashboardLog, DashboardResponse, SoakClock

CHROMIUM = Path("/usr/bin/chromium")
# As the browser tests run it: no sandbox (root in a container), no GPU, nothing in the
# background that would reach the network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NAV_TIMEOUT_MS = 60_000
EVENT_POLL_MS = 250


class DashboardBrowser:
    """Runs on a thread of its own (Playwright's sync API stays on the thread that made it)."""

    def __init__(
        self, base: str, token: str, log: DashboardLog, clock: SoakClock, reload_s: float
    ) -> None:
        self.base = base
        self.token = token
        self.log = log
        self.clock = clock
        self.reload_s = reload_s
        self.script_errors: list[tuple[float, str]] = []
        self.reloads = 0
        self.failure: str | None = None  # why the browser stopped early, if it did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-browser", daemon=True)

    @staticmethod
    def available() -> str | None:
        """None when the browser can run here, else why not."""
        if not CHROMIUM.exists():
            return f"{CHROMIUM} is not installed"
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            return "playwright is not installed"
        return None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _response(self, response) -> None:
        path = urlparse(response.url).path
        method = response.request.method
        self.log.add(DashboardResponse(self.clock.now(), "browser", method, path, response.status))

    def _error(self, text: str) -> None:
        self.script_errors.append((self.clock.now(), text[:300]))

    def _run(self) -> None:
        from playwright.sync_api import Error, sync_playwright

        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
                try:
                    self._browse(browser)
                finally:
                    browser.close()
        except Error as exc:
            self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]

    def _browse(self, browser) -> None:
        from playwright.sync_api import Error

        context = browser.new_context(base_url=self.base, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(NAV_TIMEOUT_MS)
        context.on("response", self._response)
        login = context.new_page()
        login.goto("/login")
        login.fill("input[name=name]", "soak-browser")
        login.fill("input[name=token]", self.token)
        login.click("button[type=submit]")
        login.wait_for_selector("h1:has-text('Overview')")
        overview, shapes = login, context.new_page()
        for page in (overview, shapes):
            page.on("pageerror", lambda exc: self._error(str(exc)))
            page.on("console", lambda msg: msg.type == "error" and self._error(msg.text))
        shapes.goto("/shapes")
        while self._wait(shapes):
            self.reloads += 1
            try:
                shapes.reload()
                if self.reloads % 4 == 0:
                    overview.reload()
            except Error as exc:  # a page that did not load in time: logged, the soak goes on
                self._error(f"navigation: {exc}".splitlines()[0])
        context.close()

    def _wait(self, page) -> bool:
        """Wait ``reload_s`` inside Playwright (its sync API delivers a page's events only
        while the thread is in one of its calls, so responses are logged when they arrive);
        False once the soak stops."""
        deadline = self.clock.now() + self.reload_s
        while self.clock.now() < deadline:
            if self._stop.is_set():
                return False
            page.wait_for_timeout(EVENT_POLL_MS)
        return not self._stop.is_set()
