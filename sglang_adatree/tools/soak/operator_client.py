"""The soak's operator: a logged-in client of the dashboard's JSON API that pins a shape,
changes it, clears it, and asks for retrain jobs, and checks when the server obeys a pin.

A pin is *visible* when the server's ``/server_info`` lists it in ``adatree_pins`` (the
controller applies pins at a step boundary, so a probe request keeps steps coming while the
load is idle). Whether and when the server *obeyed* is read from its telemetry at the end of
the soak (``report.pin_outcomes``): the first step decided by the pin, and every step after it
until the next change.

During a planned database outage the dashboard answers 503; those responses are expected and
counted apart (``report``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from dataclasses import dataclass, field

import requests

from sglang_adatree.tools.soak.tally import DashboardLog, DashboardResponse, SoakClock

TIMEOUT_S = (10.0, 60.0)
VISIBLE_WITHIN_S = 30.0  # how long the operator watches /server_info for a pin


class DashboardClient:
    """``/api/`` calls as a logged-in operator; every response goes to ``log``."""

    def __init__(self, base: str, token: str, log: DashboardLog, clock: SoakClock) -> None:
        self.base = base
        self.log = log
        self.clock = clock
        self.session = requests.Session()
        page = self._call("GET", "/login")
        match = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert match, "the login page has no CSRF token"
        form = {"token": token, "name": "soak", "csrf_token": match.group(1)}
        self._call("POST", "/login", data=form, allow_redirects=False)
        # A login starts a new session with its own CSRF token, which every page's forms carry.
        page = self._call("GET", "/pins")
        match = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert match, f"not logged in: /pins answered {page.status_code}"
        self.csrf = match.group(1)

    def _call(self, method: str, path: str, **kw) -> requests.Response:
        response = self.session.request(method, f"{self.base}{path}", timeout=TIMEOUT_S, **kw)
        self.log.add(
            DashboardResponse(self.clock.now(), "operator", method, path, response.status_code)
        )
        return response

    def get(self, path: str) -> requests.Response:
        return self._call("GET", path)

    def post(self, path: str, body: dict | None = None) -> requests.Response:
        return self._call("POST", path, json=body or {}, headers={"X-CSRF-Token": self.csrf})


@dataclass
class PinAction:
    """One pin the operator made (or tried to), and what the server showed."""

    shape: str
    posted_s: float  # soak time of the POST
    status: int
    pin_id: int | None = None
    created_at: float | None = None  # the pin row's unix time (the dashboard's clock)
    visible_s: float | None = None  # seconds from the POST until /server_info listed it


@dataclass
class RetrainAction:
    requested_s: float
    status: int
    job_id: int | None = None
    outcome: str | None = None  # the job's final status: succeeded, refused, failed
    message: str | None = None
    policy_version: int | None = None
    rows_used: int | None = None
    seconds: float | None = None
    active_version: int | None = None  # the active policy version once the job ended
    forced: bool = False  # activate the new version even if it is not better than the served one


@dataclass
class OperatorLog:
    pins: list[PinAction] = field(default_factory=list)
    clears: list[tuple[float, int]] = field(default_factory=list)  # (soak time, status)
    retrains: list[RetrainAction] = field(default_factory=list)


class Operator:
    """Pin cycles and retrain jobs through ``client``, watching the server at ``server_url``."""

    def __init__(
        self, client: DashboardClient, server_url: str, candidates: list[str], probe_text: str
    ) -> None:
        self.client = client
        self.server_url = server_url
        # Cycle through the candidates, no speculation included, so every kind of step is
        # pinned at some point.
        self.shapes = candidates
        self.probe_text = probe_text
        self.log = OperatorLog()
        self._next = 0
        self._active: PinAction | None = None

    def pin_next(self) -> PinAction:
        """Pin the next shape (the newest pin wins, so this also changes a pinned shape)."""
        shape = self.shapes[self._next % len(self.shapes)]
        self._next += 1
        now = self.client.clock.now()
        r = self.client.post("/api/pins", {"shape": shape, "reason": "soak: operator cycle"})
        action = PinAction(shape, now, r.status_code)
        self.log.pins.append(action)
        if r.status_code == 201:
            body = r.json()
            action.pin_id, action.created_at = body["id"], body["created_at"]
            previous, self._active = self._active, action
            if previous is not None:
                self._clear(previous)
            self._watch(action)
        return action

    def clear(self) -> None:
        """Clear the active pin (and any left from refused clears)."""
        if self._active is not None:
            self._clear(self._active)
            self._active = None
        self.clear_all()

    def clear_all(self) -> None:
        r = self.client.get("/api/pins")
        if r.status_code != 200:
            return
        for pin in r.json()["active"]:
            self._clear_id(pin["id"])

    def _clear(self, action: PinAction) -> None:
        if action.pin_id is not None:
            self._clear_id(action.pin_id)

    def _clear_id(self, pin_id: int) -> None:
        r = self.client.post(f"/api/pins/{pin_id}/clear")
        self.log.clears.append((self.client.clock.now(), r.status_code))

    def _watch(self, action: PinAction) -> None:
        """Poll ``/server_info`` until it lists the pin, with a probe request in flight."""
        probe = threading.Thread(target=self._probe, name="soak-pin-probe", daemon=True)
        probe.start()
        start = time.monotonic()
        while time.monotonic() - start < VISIBLE_WITHIN_S:
            try:
                state = requests.get(f"{self.server_url}/server_info", timeout=TIMEOUT_S).json()
                pins = state["internal_states"][0].get("adatree_pins") or []
            except (requests.RequestException, ValueError, KeyError, IndexError):
                pins = []
            if pins[:1] == [action.shape]:
                action.visible_s = time.monotonic() - start
                break
            time.sleep(0.1)
        probe.join(timeout=TIMEOUT_S[1])

    def _probe(self) -> None:
        body = {"text": self.probe_text, "sampling_params": {"max_new_tokens": 8}}
        # A failed probe shows as a pin that never became visible.
        with contextlib.suppress(requests.RequestException):
            requests.post(f"{self.server_url}/generate", json=body, timeout=TIMEOUT_S)

    def retrain(self, min_rows: int, force: bool = False) -> RetrainAction:
        """Ask for a retrain job (``force``: its version activated even if not better) and
        follow it to its end."""
        now = self.client.clock.now()
        r = self.client.post("/api/retrain", {"min_rows": min_rows, "force": force})
        action = RetrainAction(now, r.status_code, forced=force)
        self.log.retrains.append(action)
        if r.status_code != 202:
            action.message = r.text[:200]
            return action
        action.job_id = r.json()["id"]
        start = time.monotonic()
        while time.monotonic() - start < 600:
            job = self.client.get(f"/api/retrain/{action.job_id}")
            if job.status_code == 200 and job.json()["finished"]:
                body = job.json()
                action.outcome = body["status"]
                action.message = body["error"]
                action.policy_version = body["policy_version"]
                action.rows_used = body["rows_used"]
                policies = self.client.get("/api/policies")
                if policies.status_code == 200:
                    action.active_version = policies.json()["active_version"]
                break
            time.sleep(1.0)
        action.seconds = time.monotonic() - start
        return action
