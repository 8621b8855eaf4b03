"""The retrain job: recorded steps -> features -> an XGBoost cost model -> a new policy version.

One job, from the dashboard's Retrain button (on a background thread) or ``adatree retrain``:

1. read the newest ``max_rows`` step rows (of one run, or of all runs) a cost model may learn
   from (``telemetry.learning``: a measured step time, not a catch-up step); fewer than
   ``min_rows`` is refused with a message saying so;
2. build the feature rows (``features.build_feature_matrix``) and hold out the newest
   ``HOLDOUT_FRACTION`` of the steps by time: the model must predict steps it has not seen,
   which is how it will be used;
3. fit ``xgb_cost.fit_xgboost`` on the rest;
4. measure the new model and the model the server uses now on the same held-out steps: the
   active policy version, or, when none is active (or its artifact no longer loads), the
   step-time profile the run priced by (``step_time_profile``, at the level of the training
   steps) or else the analytic model refitted on the training steps as the server refits it
   (``core.refit``); the error of the predictions the server recorded for those steps is
   reported beside them;
5. store the new version in ``policies`` (artifact bytes, metrics of both, the decision) and
   activate it only if its held-out MAPE is lower, or the operator forced it.

Progress and the outcome go to the job's ``retrain_jobs`` row (status ``queued`` -> ``running``
-> ``succeeded`` / ``refused`` / ``failed``) and one ``audit_log`` entry. The comparison can
favour the current version when it was itself trained on the held-out steps, so a new version
is only activated when it is better even then.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from sglang_adatree.config import ConfigError, load_config
from sglang_adatree.core.cost_model import AnalyticStepTime, StepTimeModel, mape
from sglang_adatree.core.features import FEATURE_NAMES, build_feature_matrix
from sglang_adatree.core.step_profile import ProfileStepTime, TableProfile
from sglang_adatree.core.xgb_cost import DEFAULT_ROUNDS, ArtifactError, XGBoostStepTime, fit_xgboost
from sglang_adatree.telemetry import control
from sglang_adatree.telemetry.learning import learnable
from sglang_adatree.telemetry.models import RetrainJob, Run, Step
from sglang_adatree.telemetry.store import SchemaError, check_schema_at_head, get_engine

log = logging.getLogger(__name__)

DEFAULT_MIN_ROWS = 500
MIN_ROWS_FLOOR = 20  # below this a held-out split says nothing
MAX_TRAINING_ROWS = 200_000
HOLDOUT_FRACTION = 0.2
# A queued or running job older than this is taken to be dead (its process was stopped), so it
# no longer blocks a new one.
STALE_JOB_S = 3600.0
FINISHED = ("succeeded", "refused", "failed")


class JobConflict(RuntimeError):
    """Another retrain job is queued or running."""


@dataclass(frozen=True)
class RetrainOptions:
    run_id: int | None = None  # None: steps of every run
    force: bool = False  # activate even when not better
    min_rows: int = DEFAULT_MIN_ROWS
    max_rows: int = MAX_TRAINING_ROWS
    num_rounds: int = DEFAULT_ROUNDS
    seed: int = 0
    # Half the cores: the job shares the host with the dashboard, maybe with a server.
    nthread: int = field(default_factory=lambda: max(1, (os.cpu_count() or 2) // 2))

    def __post_init__(self) -> None:
        if not MIN_ROWS_FLOOR <= self.min_rows <= self.max_rows:
            raise ValueError(
                f"min_rows must be in [{MIN_ROWS_FLOOR}, max_rows={self.max_rows}], "
                f"got {self.min_rows}"
            )


@dataclass(frozen=True)
class TrainingSet:
    """Feature rows of recorded steps, oldest first."""

    x: np.ndarray  # [rows, NUM_FEATURES] float64
    measured_ms: np.ndarray  # [rows]
    wall_time: np.ndarray  # [rows] unix seconds, ascending
    predicted_ms: np.ndarray  # [rows] what the server predicted when it chose the step

    def __len__(self) -> int:
        return int(self.measured_ms.shape[0])

    def split(self, holdout_fraction: float) -> tuple[TrainingSet, TrainingSet]:
        """(older rows, newest ``holdout_fraction`` of rows)."""
        n_hold = max(1, round(holdout_fraction * len(self)))
        cut = len(self) - n_hold
        return self._rows(slice(None, cut)), self._rows(slice(cut, None))

    def _rows(self, rows: slice) -> TrainingSet:
        return TrainingSet(
            self.x[rows], self.measured_ms[rows], self.wall_time[rows], self.predicted_ms[rows]
        )


@dataclass(frozen=True)
class RetrainOutcome:
    job_id: int
    status: str  # succeeded, refused or failed
    message: str
    rows_used: int | None = None
    policy_version: int | None = None
    activated: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)


def load_training_set(conn: Connection, run_id: int | None, max_rows: int) -> TrainingSet:
    """The newest ``max_rows`` steps a cost model may learn from (of ``run_id``, or of all
    runs), oldest first."""
    stmt = select(
        Step.wall_time,
        Step.batch_size,
        Step.padded_batch_size,
        Step.sum_context_len,
        Step.max_context_len,
        Step.steps,
        Step.topk,
        Step.num_draft_tokens,
        Step.measured_step_ms,
        Step.predicted_step_ms,
    ).where(learnable(), Step.batch_size >= 1)
    if run_id is None:
        stmt = stmt.order_by(Step.id.desc())
    else:
        stmt = stmt.where(Step.run_id == run_id).order_by(Step.step_index.desc())
    rows = conn.execute(stmt.limit(max_rows)).all()
    # Tuples, not Rows: numpy's array probing of a Row is slow. None predictions become NaN.
    table = np.array(list(map(tuple, rows)), dtype=np.float64).reshape(len(rows), 10)
    table = table[np.argsort(table[:, 0], kind="stable")]  # [rows, 10]
    x = build_feature_matrix(table[:, 1], table[:, 2], table[:, 3], table[:, 4], table[:, 5:8])
    return TrainingSet(
        x=x, measured_ms=table[:, 8], wall_time=table[:, 0], predicted_ms=table[:, 9]
    )


def evaluate(model: StepTimeModel, data: TrainingSet) -> dict[str, float]:
    """Held-out accuracy: MAPE, 90th-percentile APE (fractions) and mean absolute error (ms)."""
    predicted = model.predict_matrix(data.x)  # [rows]
    ape = np.abs(predicted - data.measured_ms) / data.measured_ms
    return {
        "mape": mape(predicted, data.measured_ms),
        "p90_ape": float(np.quantile(ape, 0.9)),
        "mae_ms": float(np.mean(np.abs(predicted - data.measured_ms))),
    }


class _AtLevel:
    """A step-time model scaled by one factor: a profile at the level of the steps it is
    judged on, as the server's drift correction puts it."""

    def __init__(self, model: StepTimeModel, factor: float) -> None:
        self.model, self.factor = model, factor

    def predict_matrix(self, x: np.ndarray) -> np.ndarray:
        return self.model.predict_matrix(x) * self.factor


def served_model(
    conn: Connection,
    train: TrainingSet,
    run_id: int | None = None,
    judged: TrainingSet | None = None,
) -> tuple[int | None, StepTimeModel, str]:
    """(active version, the step-time model the server uses, a label): the active version's
    model, else (none active, or its artifact does not load) the run's ``step_time_profile``
    when it priced by one (the newest run's when ``run_id`` is None; at the training steps'
    median level; only if it prices every step of ``train`` and ``judged``), else the analytic
    model refitted on ``train`` as the server refits it."""
    active = control.active_policy(conn)
    note = ""
    if active is not None:
        try:
            return active.version, XGBoostStepTime.from_bytes(active.artifact), f"v{active.version}"
        except ArtifactError as exc:
            note = f" (v{active.version} does not load: {exc})"
    version = None if active is None else active.version
    query = select(Run.config).order_by(Run.id.desc()).limit(1)
    if run_id is not None:
        query = select(Run.config).where(Run.id == run_id)
    path = (conn.execute(query).scalar() or {}).get("step_time_profile")
    if path:
        try:
            profile = ProfileStepTime(TableProfile.load(Path(path)))
            level = float(np.median(train.measured_ms / profile.predict_matrix(train.x)))
            if judged is not None:
                profile.predict_matrix(judged.x)  # a shape it lacks is refused here
        except (OSError, ValueError, KeyError, TypeError) as exc:
            note += f" (the step-time profile {path} does not serve here: {exc})"
        else:
            return version, _AtLevel(profile, level), f"the step-time profile {path}{note}"
    return (
        version,
        AnalyticStepTime.fit(train.x, train.measured_ms),
        f"the refitted analytic model{note}",
    )


def served_predictions(data: TrainingSet) -> dict[str, float] | None:
    """The error of what the server itself predicted for these steps (when it predicted)."""
    known = ~np.isnan(data.predicted_ms)
    if not known.any():
        return None
    return {
        "mape": mape(data.predicted_ms[known], data.measured_ms[known]),
        "rows": int(known.sum()),
    }


def pending_job(conn: Connection, now: float | None = None) -> int | None:
    """The id of a queued or running job that is not stale, if any."""
    now = time.time() if now is None else now
    stmt = select(RetrainJob.id).where(
        RetrainJob.status.in_(("queued", "running")),
        RetrainJob.requested_at > now - STALE_JOB_S,
    )
    return conn.execute(stmt.order_by(RetrainJob.id).limit(1)).scalar()


def create_job(db: str | Engine, requested_by: str, options: RetrainOptions) -> int:
    """Queue a job (and audit the request); raises ``JobConflict`` if one is pending."""
    engine = _engine(db)
    with engine.begin() as conn:
        other = pending_job(conn)
        if other is not None:
            raise JobConflict(f"retrain job {other} is still queued or running")
        now = time.time()
        job_id = conn.execute(
            insert(RetrainJob)
            .values(
                requested_at=now,
                requested_by=requested_by,
                status="queued",
                progress=0.0,
                force=options.force,
            )
            .returning(RetrainJob.id)
        ).scalar_one()
        request = {"job_id": job_id, "run_id": options.run_id, "force": options.force}
        control.audit(
            conn, requested_by, "retrain.request", None, {**request, "min_rows": options.min_rows}
        )
    return int(job_id)


def run_job(
    db: str | Engine,
    job_id: int,
    options: RetrainOptions,
    actor: str,
    on_progress: Callable[[float, str], None] | None = None,
) -> RetrainOutcome:
    """Run a queued job to its end (see the module docstring); never raises for a refused or
    failed job: the outcome is returned and written to the job's row."""
    engine = _engine(db)

    def progress(fraction: float, what: str, **values: Any) -> None:
        with engine.begin() as conn:
            conn.execute(
                update(RetrainJob)
                .where(RetrainJob.id == job_id)
                .values(progress=fraction, **values)
            )
        if on_progress is not None:
            on_progress(fraction, what)

    try:
        progress(0.05, "reading steps", status="running", started_at=time.time())
        outcome = _train(engine, job_id, options, actor, progress)
    except Exception as exc:  # the job's row must say why it ended, whatever happened
        log.exception("retrain job %s failed", job_id)
        outcome = RetrainOutcome(job_id, "failed", f"{type(exc).__name__}: {exc}")
    finished = {
        "status": outcome.status,
        "finished_at": time.time(),
        "error": None if outcome.status == "succeeded" else outcome.message,
        "rows_used": outcome.rows_used,
        "policy_version": outcome.policy_version,
    }
    with engine.begin() as conn:
        conn.execute(
            update(RetrainJob).where(RetrainJob.id == job_id).values(progress=1.0, **finished)
        )
        if outcome.status != "succeeded":
            control.audit(conn, actor, "retrain.finish", None, {"job_id": job_id, **finished})
    return outcome


def start_job_thread(
    db: str | Engine, job_id: int, options: RetrainOptions, actor: str
) -> threading.Thread:
    """Run the job on a daemon thread (the dashboard's way: never inside a request)."""
    thread = threading.Thread(
        target=run_job, args=(db, job_id, options, actor), name=f"retrain-{job_id}", daemon=True
    )
    thread.start()
    return thread


def _train(
    engine: Engine,
    job_id: int,
    options: RetrainOptions,
    actor: str,
    progress: Callable[..., None],
) -> RetrainOutcome:
    with engine.connect() as conn:
        data = load_training_set(conn, options.run_id, options.max_rows)
    scope = "all runs" if options.run_id is None else f"run {options.run_id}"
    if len(data) < options.min_rows:
        return RetrainOutcome(
            job_id,
            "refused",
            f"too few recorded steps to retrain: {len(data)} with a measured step time in "
            f"{scope}, at least {options.min_rows} needed; record more steps or lower min_rows",
            rows_used=len(data),
        )
    progress(0.2, f"fitting on {len(data)} steps")
    train, holdout = data.split(HOLDOUT_FRACTION)
    model = fit_xgboost(
        train.x,
        train.measured_ms,
        num_rounds=options.num_rounds,
        seed=options.seed,
        nthread=options.nthread,
    )
    progress(0.8, "validating against the current version")
    with engine.connect() as conn:
        base_version, base_model, base_label = served_model(conn, train, options.run_id, holdout)
    new = evaluate(model, holdout)
    base = evaluate(base_model, holdout)
    better = new["mape"] < base["mape"]
    activate = better or options.force
    verdict = "better" if better else "not better"
    decision = f"{'activated' if activate else 'not activated'}: {verdict} than {base_label}"
    if activate and not better:
        decision += " (forced)"
    metrics = {
        **new,
        "holdout": f"newest {HOLDOUT_FRACTION:.0%} of the steps by time",
        "holdout_rows": len(holdout),
        "baseline": {"version": base_version, "model": base_label, **base},
        "as_served": served_predictions(holdout),
        "improvement": (base["mape"] - new["mape"]) / base["mape"] if base["mape"] else None,
        "fit": vars(model.info.metrics),
        "run_id": options.run_id,
        "rows_used": len(data),
        "job_id": job_id,
        "forced": options.force,
        "decision": decision,
    }
    progress(0.9, "storing the new version")
    version = _store(engine, model, metrics, activate, actor, job_id, base_version)
    return RetrainOutcome(
        job_id,
        "succeeded",
        f"policy version {version}: held-out MAPE {new['mape']:.1%} against "
        f"{base['mape']:.1%} for {base_label}; {decision}",
        rows_used=len(data),
        policy_version=version,
        activated=activate,
        metrics=metrics,
    )


def _store(
    engine: Engine,
    model: XGBoostStepTime,
    metrics: dict[str, Any],
    activate: bool,
    actor: str,
    job_id: int,
    base_version: int | None,
) -> int:
    """Insert the new version (activating it if asked) and audit it, in one transaction."""
    artifact = model.to_bytes()
    for attempt in range(3):
        try:
            with engine.begin() as conn:
                version = control.add_policy_version(
                    conn,
                    artifact=artifact,
                    feature_names=FEATURE_NAMES,
                    training_rows=model.info.training_rows,
                    validation_metrics=metrics,
                    activate=activate,
                    actor=actor,
                )
                after = {
                    "job_id": job_id,
                    "status": "succeeded",
                    "policy_version": version,
                    "active_version": version if activate else base_version,
                    "mape": metrics["mape"],
                    "decision": metrics["decision"],
                }
                control.audit(
                    conn, actor, "retrain.finish", {"active_version": base_version}, after
                )
            return version
        except IntegrityError:
            # Another process took the same version number first; take the next one.
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _engine(db: str | Engine) -> Engine:
    return db if isinstance(db, Engine) else get_engine(db)


# ---- adatree retrain -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=None,
        help="database URL (default: $ADATREE_DB_URL, else db_url of the config file, "
        "else SQLite adatree.sqlite under $ADATREE_HOME)",
    )
    parser.add_argument(
        "--run", type=int, default=None, metavar="RUN_ID", help="train on this run's steps only"
    )
    parser.add_argument(
        "--force", action="store_true", help="activate the new version even if it is not better"
    )
    parser.add_argument(
        "--min-rows",
        type=int,
        default=DEFAULT_MIN_ROWS,
        metavar="N",
        help=f"refuse with fewer recorded steps than this (default {DEFAULT_MIN_ROWS})",
    )


def run(args: argparse.Namespace) -> int:
    """Queue a job and run it in the foreground, printing progress; 0 when a version was
    stored, 1 when refused or failed, 2 on bad arguments or database."""
    try:
        options = RetrainOptions(run_id=args.run, force=args.force, min_rows=args.min_rows)
        url = load_config(db_url=args.db).resolved_db_url
        engine = get_engine(url)
        check_schema_at_head(engine)
        with engine.connect() as conn:
            known = conn.execute(select(Run.id).where(Run.id == args.run)).first()
            if args.run is not None and known is None:
                print(f"adatree retrain: no run {args.run} in the database", flush=True)
                return 2
        actor = f"cli:{getpass.getuser()}@{socket.gethostname()}"
        job_id = create_job(engine, actor, options)
    except (ValueError, ConfigError, SchemaError, JobConflict, SQLAlchemyError) as exc:
        print(f"adatree retrain: {exc}", flush=True)
        return 2

    def show(fraction: float, what: str) -> None:
        print(f"retrain job {job_id}: {fraction:4.0%} {what}", flush=True)

    outcome = run_job(engine, job_id, options, actor, on_progress=show)
    print(f"adatree retrain: {outcome.status}: {outcome.message}", flush=True)
    return 0 if outcome.status == "succeeded" else 1
