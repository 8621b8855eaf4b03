"""What a soak found, from the server's own records: every finished decode step a telemetry row
or counted, when each pin was obeyed, which dashboard errors fell outside planned outages, and
the must-show checks (``checks``).

Decode steps against rows: ``/server_info``'s ``adatree_steps`` (steps the controller finished)
must equal the rows of the run in the database plus the steps counted without a row (dropped on
a full queue, refused by the database, still queued, lost at close); ``rows_unaccounted`` is
the difference and must be 0. Steps that launched but never finished (an aborted batch) are
``unfinished_steps``, counted apart: they never reach the writer.

A pin is *obeyed* when the server ran it within one control poll plus a step: of the decode
steps that finished after the pin was readable (its creation plus ``control_poll_s`` and a
little scheduling slack) and before the first step decided by the pin, at most
``LATE_STEPS_ALLOWED`` were decided otherwise (the step running when the poller handed the pin
over, and the one launched before it under overlap scheduling; catch-up steps the pinned shape
needs first do not count); and every step after that first one, until the operator's next
change, was the pin's. Counting steps rather than seconds keeps the rule what it says on a
slow or idle server: an idle server obeys at its next step, whenever that comes. Where the
operator's next change comes between the catch-up the pin needs first and the pinned step it
stands in for (the catch-up's runner-up), that catch-up is the pin's first step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select

from sglang_adatree.telemetry.models import PinRow, Run, Step
from sglang_adatree.telemetry.store import get_engine
from sglang_adatree.tools.soak.activities import FaultLog
from sglang_adatree.tools.soak.bad_requests import BadRequestTally
from sglang_adatree.tools.soak.memory import ProcessMemory, RssSampler
from sglang_adatree.tools.soak.operator_client import OperatorLog, PinAction
from sglang_adatree.tools.soak.schedule import Schedule
from sglang_adatree.tools.soak.tally import (
    DashboardResponse,
    GreedyAnswers,
    RequestTally,
    SoakClock,
)

LATE_STEPS_ALLOWED = 2
POLL_SLACK_S = 0.5  # the poller's own read and a starved thread's wake-up
OUTAGE_GRACE_S = 5.0  # a request answered just as the database came back
OBEYING_SOURCES = ("pin", "catch-up")


@dataclass(frozen=True)
class Observations:
    """What the soak's clients saw, handed over once every activity has stopped."""

    clock: SoakClock
    schedule: Schedule
    server_crashes: int
    requests: RequestTally
    greedy: GreedyAnswers
    bad_requests: BadRequestTally
    dashboard: list[DashboardResponse]
    browser: Any  # browser.DashboardBrowser, or None when it did not run
    browser_skipped: str | None
    rss: RssSampler
    operator: OperatorLog
    faults: FaultLog
    faults_skipped: str | None
    errors: list[str]


ACCOUNTING_KEYS = (
    "decode_steps",
    "unfinished_steps",
    "rows_written",
    "rows_dropped",
    "rows_rejected",
    "rows_queued",
    "rows_lost",
    "rows_unaccounted",
)


def assemble(
    seen: Observations,
    state: dict[str, Any] | None = None,
    accounting: dict[str, Any] | None = None,
    pins: dict[str, Any] | None = None,
    adatree_memory: list[ProcessMemory] | None = None,
) -> dict[str, Any]:
    """The report as JSON; the server's records (``state`` onwards) are missing after a crash."""
    accounting = accounting or {}
    pins = pins or {"pins_applied": 0, "pins_obeyed": 0, "pins_refused": 0, "pins": []}
    rss = seen.rss.to_json(seen.schedule.warmup_s, seen.schedule.rss_window_s)
    greedy = seen.greedy.to_json()
    browser = seen.browser
    errors = browser.script_errors if browser else []
    script_errors = [e for t, e in errors if not seen.faults.planned(t, OUTAGE_GRACE_S)]
    return {
        "soak": {"minutes": seen.schedule.minutes, "schedule": seen.schedule.to_json()},
        "server_crashes": seen.server_crashes,
        "requests": seen.requests.to_json(),
        "answers_compared": greedy["answers_compared"],
        "answers_differing": greedy["answers_differing"],
        "greedy": greedy,
        "bad_requests": seen.bad_requests.to_json(),
        **dashboard_summary(seen.dashboard, seen.faults.outages),
        "browser": {
            "skipped": seen.browser_skipped,
            "reloads": browser.reloads if browser else 0,
            "script_errors_outside_outages": len(script_errors),
            "script_error_examples": script_errors[:5],
            "failure": browser.failure if browser else None,
        },
        **{key: accounting.get(key) for key in ACCOUNTING_KEYS},
        "telemetry_writer": accounting.get("writer"),
        "server_state": {
            k: v
            for k, v in (state or {}).items()
            if k.startswith("adatree_") and not k.startswith("adatree_telemetry_")
        },
        "rss_start_mb": rss["start_mb"],
        "rss_end_mb": rss["end_mb"],
        # Judged: the slope of the peaks (memory.py says why not that of every sample).
        "rss_slope_mb_per_min": rss["peak_slope_mb_per_min"],
        "rss_sample_slope_mb_per_min": rss["slope_mb_per_min"],
        "rss": rss,
        "pins_applied": pins["pins_applied"],
        "pins_obeyed": pins["pins_obeyed"],
        "pins_refused": pins["pins_refused"],
        "pins": pins["pins"],
        "pin_clears": [{"at_s": round(t, 1), "status": s} for t, s in seen.operator.clears],
        "retrain_jobs": [asdict(r) for r in seen.operator.retrains],
        "faults": seen.faults.steps,
        "faults_skipped": seen.faults_skipped,
        "planned_outages_s": [[round(a, 1), round(b, 1)] for a, b in seen.faults.outages],
        "soak_errors": seen.errors,
        "adatree_memory": adatree_memory or [],
    }


def telemetry_accounting(db_url: str, run_id: int, state: dict[str, Any]) -> dict[str, Any]:
    """Decode steps against rows and counted drops, from the database and ``/server_info``."""
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(select(func.count()).where(Step.run_id == run_id)).scalar_one()
        run = conn.execute(
            select(Run.dropped_steps, Run.rejected_steps, Run.unfinished_steps).where(
                Run.id == run_id
            )
        ).one()
    decode_steps = int(state["adatree_steps"])
    queued = int(state.get("adatree_telemetry_queued") or 0)
    lost = int(state.get("adatree_telemetry_lost") or 0)
    counted = int(run.dropped_steps) + int(run.rejected_steps) + queued + lost
    return {
        "decode_steps": decode_steps,
        "rows_written": int(rows),
        "rows_dropped": int(run.dropped_steps),
        "rows_rejected": int(run.rejected_steps),
        "rows_queued": queued,
        "rows_lost": lost,
        "rows_unaccounted": decode_steps - int(rows) - counted,
        "unfinished_steps": int(run.unfinished_steps),
        "writer": {
            key.removeprefix("adatree_telemetry_"): value
            for key, value in state.items()
            if key.startswith("adatree_telemetry_")
        },
    }


def pin_outcomes(db_url: str, run_id: int, pins: list[PinAction], poll_s: float) -> dict[str, Any]:
    """Each applied pin's first obeying step and the steps decided otherwise under it.

    A pin's window is read in the database's own times, the clock its steps are stamped with:
    from its creation to the creation of the pin that replaced it or its clearing, whichever
    came first. The soak's clock is monotonic and the system's is not: mapped onto each other
    once, a step of the system clock mid-soak would put a pin's end before its start."""
    applied = [p for p in pins if p.status == 201 and p.created_at is not None]
    out = []
    with get_engine(db_url).connect() as conn:
        ids = [p.pin_id for p in applied if p.pin_id is not None]
        cleared = dict(
            conn.execute(select(PinRow.id, PinRow.cleared_at).where(PinRow.id.in_(ids))).all()
        )
        for i, pin in enumerate(applied):
            ends = [cleared.get(pin.pin_id)]
            if i + 1 < len(applied):
                ends.append(applied[i + 1].created_at)
            ended_wall = min((e for e in ends if e is not None), default=None)
            stmt = (
                select(
                    Step.wall_time,
                    Step.steps,
                    Step.topk,
                    Step.num_draft_tokens,
                    Step.decision_source,
                    Step.runner_up,
                )
                .where(Step.run_id == run_id, Step.wall_time >= pin.created_at)
                .order_by(Step.wall_time)
            )
            if ended_wall is not None:
                stmt = stmt.where(Step.wall_time < ended_wall)
            rows = conn.execute(stmt).all()
            out.append(_pin_outcome(pin, rows, poll_s))
    obeyed = sum(1 for o in out if o["obeyed"])
    return {
        "pins_applied": len(applied),
        "pins_obeyed": obeyed,
        "pins_refused": sum(1 for p in pins if p.status != 201),
        "pins": out,
    }


def _pin_outcome(pin: PinAction, rows: list, poll_s: float) -> dict[str, Any]:
    def own(r: Any) -> bool:
        return f"{r.steps},{r.topk},{r.num_draft_tokens}" == pin.shape

    after = [r for r in rows if r.wall_time >= pin.created_at]
    first = next((r for r in after if r.decision_source == "pin" and own(r)), None)
    if first is None and after:
        # The window closed after the catch-up the pin needs first, before the pinned step the
        # catch-up stood in for (its runner-up) ran: that catch-up is the pin taking effect.
        last = after[-1]
        if last.decision_source == "catch-up" and last.runner_up == pin.shape:
            first = last
    readable = pin.created_at + poll_s + POLL_SLACK_S
    late = violations = 0
    if first is not None:
        for r in after:
            obeying = r.decision_source == "catch-up" or (r.decision_source == "pin" and own(r))
            if r.wall_time < first.wall_time:
                late += r.wall_time > readable and not obeying
            elif not obeying:
                violations += 1
    return {
        "shape": pin.shape,
        "posted_s": round(pin.posted_s, 2),
        "visible_after_s": None if pin.visible_s is None else round(pin.visible_s, 2),
        "first_pinned_step_after_s": None
        if first is None
        else round(first.wall_time - pin.created_at, 3),
        "late_steps": late,
        "steps_under_pin": len(after),
        "steps_not_obeying": violations,
        "obeyed": first is not None and late <= LATE_STEPS_ALLOWED and violations == 0,
    }


def dashboard_summary(
    responses: list[DashboardResponse], outages: list[tuple[float, float]]
) -> dict[str, Any]:
    """Requests and 5xx; a 503 inside a planned outage (or just as it ended) is expected."""

    def planned(r: DashboardResponse) -> bool:
        return r.status == 503 and any(a <= r.at_s <= b + OUTAGE_GRACE_S for a, b in outages)

    errors = [r for r in responses if r.status >= 500 and not planned(r)]
    by_client: dict[str, int] = {}
    for r in responses:
        by_client[r.client] = by_client.get(r.client, 0) + 1
    return {
        "dashboard_requests": len(responses),
        "dashboard_5xx": len(errors),
        "dashboard_503_planned": sum(1 for r in responses if planned(r)),
        "dashboard_requests_by_client": by_client,
        "dashboard_5xx_examples": [asdict(r) for r in errors[:10]],
    }


def checks(report: dict[str, Any], rss_slope_limit: float) -> dict[str, bool]:
    """The issue's must-show properties, each a pass or a fail."""
    slope = report["rss_slope_mb_per_min"]
    bad = report["bad_requests"]
    return {
        "no_server_crash": report["server_crashes"] == 0,
        "greedy_answers_identical": report["answers_compared"] > 0
        and report["answers_differing"] == 0,
        "no_dashboard_5xx_outside_planned_outages": report["dashboard_5xx"] == 0,
        "every_decode_step_written_or_counted": report["rows_unaccounted"] == 0,
        "rss_flat_after_warmup": slope is not None and slope < rss_slope_limit,
        "every_pin_obeyed": report["pins_applied"] > 0
        and report["pins_obeyed"] == report["pins_applied"],
        "bad_requests_refused_clearly": bad["sent"] > 0 and bad["refused_clearly"] == bad["sent"],
        "requests_served": report["requests"]["served"] > 0,
    }
