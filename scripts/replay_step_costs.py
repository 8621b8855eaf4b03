"""Replay a served run's step-time side: what the cost model believed of every shape, step by step.

Telemetry keeps only the chosen shape's predicted step time. This script rebuilds the cost side
of the run's step controller from the run's own steps: the default analytic model (or the
run's ``step_time_profile``, which is never refitted), its residual correction
(``cost_model.ResidualCorrection``) fed every step that teaches a cost model
(``policy.teaches_cost_model``), and the analytic refits on the refit schedule of
``refit.MeasuredSteps``. At each step it prints the corrected prediction of the watched shapes
at that step's features, beside the prediction the server logged for the shape it ran, so a
streak on one shape can be read against what the others were priced at.

What it cannot rebuild: the acceptance side (telemetry keeps per-depth and per-rank totals, not
each request's path), a trained policy version (the replay stops at the first step priced by
one) and the refits' exact timing (the server's later refits come from the control poller
within a poll interval of falling due; the replay runs each on the step it falls due, so
predictions after a refit may differ by the steps of one poll). The ``replay / logged`` summary
says how close the rebuild came.

Usage::

    .venv/bin/python scripts/replay_step_costs.py --db sqlite:///telemetry.sqlite \\
        --shapes "4,2,8;2,2,4" [--run ID] [--from STEP] [--to STEP]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from sglang_adatree.config import AdaTreeConfig, ConfigError
from sglang_adatree.core.cost_model import starting_cost_model
from sglang_adatree.core.features import NO_GRAPHS, StepFeatures
from sglang_adatree.core.policy import DecisionSource, teaches_cost_model
from sglang_adatree.core.refit import MeasuredSteps
from sglang_adatree.core.shapes import ShapeError, TreeShape
from sglang_adatree.core.step_profile import load_profile_step_time
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.store import display_url, session_scope


@dataclass(frozen=True)
class ReplayedStep:
    """One served step and what the rebuilt cost model predicted before it ran."""

    step_index: int
    shape: TreeShape
    source: str
    sum_context_len: int
    logged_ms: float | None  # what the server predicted for the shape it ran
    replayed_ms: float  # the rebuild's prediction for that shape, when the server made it
    measured_ms: float
    watched_ms: tuple[float, ...]  # the rebuild's predictions for the watched shapes
    refit_after: bool  # a refit came due on this step


def replay(
    rows: Sequence[Step], config: AdaTreeConfig, watched: Sequence[TreeShape]
) -> Iterator[ReplayedStep]:
    """The run's ``rows`` (oldest first) through a rebuilt cost side; stops at the first step
    a trained policy version priced."""
    candidates = tuple(config.candidate_shapes)
    ran = (TreeShape(r.steps, r.topk, r.num_draft_tokens) for r in rows)
    shapes = tuple(dict.fromkeys((*candidates, *watched, *ran)))
    measured = MeasuredSteps(candidates, config.residual_decay, NO_GRAPHS)
    profile = None
    if config.step_time_profile:
        # The server priced by the deployment's profile and never refitted it.
        profile = load_profile_step_time(config.step_time_profile, shapes)
    model = starting_cost_model(config.residual_decay, profile)
    held: np.ndarray | None = None  # [shapes] ms, as of a catch-up step
    for row in rows:
        if row.policy_version is not None:
            print(
                f"step {row.step_index} was priced by trained version {row.policy_version}: "
                "the replay rebuilds the analytic fallback only, and stops here",
                file=sys.stderr,
            )
            return
        features = StepFeatures(
            row.batch_size, row.padded_batch_size, row.sum_context_len, row.max_context_len
        )
        shape = TreeShape(row.steps, row.topk, row.num_draft_tokens)
        predicted = model.predict_ms_many(features, shapes)  # [shapes] ms
        # The step after a catch-up runs the decision the catch-up held back, priced on the
        # catch-up's features, unless its batch changed (``controller.StepController.begin``;
        # telemetry does not say which, so such a step reads off in the summary).
        decided = held if held is not None else predicted
        held = predicted.copy() if row.decision_source == DecisionSource.CATCH_UP else None
        refit = False
        if teaches_cost_model(row.decision_source, row.measured_step_ms):
            model.observe(features, shape, row.measured_step_ms)
            measured.add(features, shape, row.measured_step_ms)
            fitted = measured.refit() if profile is None else None
            if fitted is not None:
                model, refit = fitted, True
        yield ReplayedStep(
            step_index=row.step_index,
            shape=shape,
            source=row.decision_source,
            sum_context_len=row.sum_context_len,
            logged_ms=row.predicted_step_ms,
            replayed_ms=float(decided[shapes.index(shape)]),
            measured_ms=row.measured_step_ms,
            watched_ms=tuple(float(predicted[shapes.index(w)]) for w in watched),
            refit_after=refit,
        )


def run_config(run: Run) -> AdaTreeConfig:
    """The settings the cost side depends on, as the run recorded them."""
    stored = run.config or {}
    return AdaTreeConfig().replace(
        candidate_shapes=stored.get("candidate_shapes", AdaTreeConfig().candidate_shapes),
        residual_decay=stored.get("residual_decay", AdaTreeConfig().residual_decay),
        step_time_profile=stored.get("step_time_profile"),
    )


def _parse_shapes(text: str) -> tuple[TreeShape, ...]:
    return tuple(TreeShape.parse(part.strip()) for part in text.split(";") if part.strip())


def _read_and_replay(
    p: argparse.ArgumentParser, db: str, run_id: int | None, watched: Sequence[TreeShape]
) -> tuple[int, list[ReplayedStep]]:
    """The run's id (the newest run when ``run_id`` is None) and its replayed steps."""
    with session_scope(db) as session:
        query = select(Run).order_by(Run.id.desc()).limit(1)
        if run_id is not None:
            query = select(Run).where(Run.id == run_id)
        run = session.scalars(query).first()
        if run is None:
            which = "no run" if run_id is None else f"no run {run_id}"
            p.error(f"{which} in {display_url(db)}")
        try:
            config = run_config(run)
        except ConfigError as exc:
            p.error(f"run {run.id}'s settings: {exc}")
        rows = session.scalars(
            select(Step).where(Step.run_id == run.id).order_by(Step.step_index)
        ).all()
        try:
            return run.id, list(replay(rows, config, watched))
        except ValueError as exc:  # the run's step-time profile, unreadable here
            p.error(f"run {run.id}: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", required=True, help="the telemetry database URL")
    p.add_argument("--run", type=int, help="run id (default: the newest run)")
    p.add_argument("--shapes", required=True, help='watched shapes, e.g. "4,2,8;2,2,4"')
    p.add_argument("--from", dest="first", type=int, default=0, help="first step printed")
    p.add_argument("--to", dest="last", type=int, help="last step printed")
    args = p.parse_args(argv)
    try:
        watched = _parse_shapes(args.shapes)
    except ShapeError as exc:
        p.error(f"--shapes: {exc}")
    if not watched:
        p.error("--shapes names no shape")
    try:
        run_id, replayed = _read_and_replay(p, args.db, args.run, watched)
    except SQLAlchemyError as exc:
        p.error(f"{display_url(args.db)}: {getattr(exc, 'orig', None) or exc}")
    if not replayed:
        print(f"run {run_id}: no steps to replay")
        return 1
    names = " ".join(f"{w!s:>9}" for w in watched)
    ratio = f"  {watched[0]} / {watched[1]}" if len(watched) > 1 else ""
    print(f"run {run_id}, {len(replayed)} steps; predicted ms before each step")
    print(
        f"{'step':>6} {'source':>9} {'ran':>7} {'context':>7} {'logged':>7} {'replay':>7} "
        f"{'measured':>8} {names}{ratio}"
    )
    for r in replayed:
        if r.step_index < args.first or (args.last is not None and r.step_index > args.last):
            continue
        logged = f"{r.logged_ms:7.1f}" if r.logged_ms is not None else f"{'-':>7}"
        watched_ms = " ".join(f"{ms:9.1f}" for ms in r.watched_ms)
        tail = f"  {r.watched_ms[0] / r.watched_ms[1]:.3f}" if len(r.watched_ms) > 1 else ""
        refit = "  refit" if r.refit_after else ""
        print(
            f"{r.step_index:>6} {r.source:>9} {r.shape!s:>7} {r.sum_context_len:>7} {logged} "
            f"{r.replayed_ms:7.1f} {r.measured_ms:8.1f} {watched_ms}{tail}{refit}"
        )
    errors = [
        abs(r.replayed_ms - r.logged_ms) / r.logged_ms
        for r in replayed
        if r.logged_ms and r.source != DecisionSource.CATCH_UP
    ]
    if errors:
        print(
            f"replay / logged prediction of the shape run: median error "
            f"{100 * statistics.median(errors):.2f}%, 90th percentile "
            f"{100 * statistics.quantiles(errors, n=10)[-1] if len(errors) > 1 else 0:.2f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
