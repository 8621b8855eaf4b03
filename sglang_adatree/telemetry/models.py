"""The telemetry schema as typed SQLAlchemy 2.0 models.

The migrations under ``migrations/versions`` create exactly these tables (a test compares them);
the code never calls ``create_all`` on a real database.

Times are unix seconds (``float``, UTC by definition) everywhere, so SQLite and PostgreSQL store
and compare them the same way and the dashboard's time ranges are plain number ranges.

Tables:

* ``runs``: one per server start and rank; holds the persisted counters of steps without a
  row (dropped by the writer, refused by the database, or never finished).
* ``steps``: one per decode step (see ``records.StepRecord``); the dashboard reads it by run and
  time range, or the latest N steps of a run.
* ``step_rollups``: per-minute sums per run and shape, written by retention for long ranges.
* ``policies``: policy versions (cost model + acceptance prior artifact and its metrics).
* ``pins``: operator-pinned shapes; a pin is active until ``cleared_at`` is set.
* ``retrain_jobs``: cost-model refits requested from the dashboard or the command line.
* ``audit_log``: every operator action with its before / after state.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments an INTEGER PRIMARY KEY (the rowid), never a BIGINT one.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# Deterministic constraint names, so batch-mode migrations on SQLite can find and alter them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    """One server start (one rank of it)."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[float] = mapped_column(Double)
    stopped_at: Mapped[float | None] = mapped_column(Double)
    target_model: Mapped[str] = mapped_column(String(512))
    draft_model: Mapped[str | None] = mapped_column(String(512))
    device: Mapped[str] = mapped_column(String(64))
    sglang_version: Mapped[str | None] = mapped_column(String(32))
    package_version: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    node: Mapped[str] = mapped_column(String(255))
    rank: Mapped[int] = mapped_column(Integer)
    # Step records the writer dropped because its queue was full (drop-newest policy), records
    # the database refused (e.g. a constraint), and launched decode steps whose outcome never
    # came back (so they have no record); all persisted by the writer.
    dropped_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    rejected_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    unfinished_steps: Mapped[int] = mapped_column(BigInteger, default=0)

    __table_args__ = (Index(None, "started_at"),)


class Step(Base):
    """One decode step: the chosen shape, why, and what it cost and emitted."""

    __tablename__ = "steps"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step_index: Mapped[int] = mapped_column(BigInteger)
    wall_time: Mapped[float] = mapped_column(Double)
    batch_size: Mapped[int] = mapped_column(Integer)
    padded_batch_size: Mapped[int] = mapped_column(Integer)  # the CUDA-graph size it ran as
    sum_context_len: Mapped[int] = mapped_column(BigInteger)
    max_context_len: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    topk: Mapped[int] = mapped_column(Integer)
    num_draft_tokens: Mapped[int] = mapped_column(Integer)
    decision_source: Mapped[str] = mapped_column(String(16))
    policy_version: Mapped[int | None] = mapped_column(Integer)
    predicted_step_ms: Mapped[float | None] = mapped_column(Double)
    measured_step_ms: Mapped[float] = mapped_column(Double)
    predicted_accept_len: Mapped[float | None] = mapped_column(Double)
    measured_accept_len: Mapped[float] = mapped_column(Double)
    emitted_tokens: Mapped[int] = mapped_column(Integer)
    drafted_tokens: Mapped[int] = mapped_column(Integer)
    accepted_tokens: Mapped[int] = mapped_column(Integer)
    goodput: Mapped[float] = mapped_column(Double)
    runner_up: Mapped[str | None] = mapped_column(String(32))  # "S,K,N" priced next best
    runner_up_step_ms: Mapped[float | None] = mapped_column(Double)
    runner_up_accept_len: Mapped[float | None] = mapped_column(Double)
    # ``cost_model.PriceSplit`` when the step was decided, log units
    price_drift: Mapped[float | None] = mapped_column(Double)
    price_tilt: Mapped[float | None] = mapped_column(Double)
    price_offset: Mapped[float | None] = mapped_column(Double)
    accepted_by_depth: Mapped[str] = mapped_column(String(255))  # "12,7,3": depth 1, 2, 3
    accepted_by_rank: Mapped[str] = mapped_column(String(255))  # "15,5,2": sibling rank 1, 2, 3

    # Time ranges of a run and the latest N steps of a run; retention walks the first.
    __table_args__ = (Index(None, "run_id", "wall_time"), Index(None, "run_id", "step_index"))


class StepRollup(Base):
    """Per-minute sums of ``steps`` for one run and shape; means are sums / ``num_steps``."""

    __tablename__ = "step_rollups"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    minute: Mapped[float] = mapped_column(Double)  # unix seconds of the minute's start
    steps: Mapped[int] = mapped_column(Integer)
    topk: Mapped[int] = mapped_column(Integer)
    num_draft_tokens: Mapped[int] = mapped_column(Integer)
    num_steps: Mapped[int] = mapped_column(Integer)
    sum_batch_size: Mapped[int] = mapped_column(BigInteger)
    max_batch_size: Mapped[int] = mapped_column(Integer)
    sum_context_len: Mapped[int] = mapped_column(BigInteger)
    sum_measured_step_ms: Mapped[float] = mapped_column(Double)
    sum_predicted_step_ms: Mapped[float] = mapped_column(Double)
    num_predicted: Mapped[int] = mapped_column(Integer)  # steps that carried predictions
    sum_measured_accept_len: Mapped[float] = mapped_column(Double)
    sum_predicted_accept_len: Mapped[float] = mapped_column(Double)
    emitted_tokens: Mapped[int] = mapped_column(BigInteger)
    drafted_tokens: Mapped[int] = mapped_column(BigInteger)
    accepted_tokens: Mapped[int] = mapped_column(BigInteger)
    accepted_by_depth: Mapped[str] = mapped_column(String(255))
    accepted_by_rank: Mapped[str] = mapped_column(String(255))
    # {"model": 58, "explore": 2}: steps per decision source.
    decision_sources: Mapped[dict[str, int]] = mapped_column(JSON)

    __table_args__ = (
        Index(None, "run_id", "minute", "steps", "topk", "num_draft_tokens", unique=True),
    )


class Policy(Base):
    """One policy version: a trained cost model + acceptance prior and how well it validated."""

    __tablename__ = "policies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, unique=True)
    created_at: Mapped[float] = mapped_column(Double)
    artifact: Mapped[bytes] = mapped_column(LargeBinary)
    feature_names: Mapped[list[str]] = mapped_column(JSON)
    training_rows: Mapped[int] = mapped_column(Integer)
    validation_metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    active: Mapped[bool] = mapped_column(Boolean, default=False)
    activated_at: Mapped[float | None] = mapped_column(Double)
    activated_by: Mapped[str | None] = mapped_column(String(255))

    __table_args__ = (Index(None, "active"),)


class PinRow(Base):
    """An operator's pinned shape for all batches or a batch-size range; active until cleared."""

    __tablename__ = "pins"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(Integer)
    topk: Mapped[int] = mapped_column(Integer)
    num_draft_tokens: Mapped[int] = mapped_column(Integer)
    min_batch_size: Mapped[int | None] = mapped_column(Integer)  # None: no lower bound
    max_batch_size: Mapped[int | None] = mapped_column(Integer)  # None: no upper bound
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Double)
    created_by: Mapped[str] = mapped_column(String(255))
    cleared_at: Mapped[float | None] = mapped_column(Double)
    cleared_by: Mapped[str | None] = mapped_column(String(255))

    __table_args__ = (Index(None, "cleared_at"),)


class RetrainJob(Base):
    """A cost-model refit: queued, running, then succeeded / failed / refused."""

    __tablename__ = "retrain_jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    requested_at: Mapped[float] = mapped_column(Double)
    requested_by: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[float | None] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double)
    status: Mapped[str] = mapped_column(String(16))
    progress: Mapped[float] = mapped_column(Double, default=0.0)  # 0..1
    error: Mapped[str | None] = mapped_column(Text)
    rows_used: Mapped[int | None] = mapped_column(Integer)
    policy_version: Mapped[int | None] = mapped_column(Integer)  # the version it produced
    force: Mapped[bool] = mapped_column(Boolean, default=False)  # activate even if not better

    __table_args__ = (Index(None, "status"),)


class AuditLog(Base):
    """One operator action: who, when, what, and the state before and after."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    at: Mapped[float] = mapped_column(Double)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    __table_args__ = (Index(None, "at"),)
