"""Runs, one row per decode step, and per-minute roll-ups of old steps.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# SQLite only auto-increments an INTEGER PRIMARY KEY (the rowid), never a BIGINT one.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("stopped_at", sa.Double(), nullable=True),
        sa.Column("target_model", sa.String(length=512), nullable=False),
        sa.Column("draft_model", sa.String(length=512), nullable=True),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("sglang_version", sa.String(length=32), nullable=True),
        sa.Column("package_version", sa.String(length=32), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("dropped_steps", sa.BigInteger(), nullable=False),
        sa.Column("rejected_steps", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_index(op.f("ix_runs_started_at"), "runs", ["started_at"])

    op.create_table(
        "steps",
        sa.Column("id", BigId, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step_index", sa.BigInteger(), nullable=False),
        sa.Column("wall_time", sa.Double(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("sum_context_len", sa.BigInteger(), nullable=False),
        sa.Column("max_context_len", sa.Integer(), nullable=False),
        sa.Column("prefill_tokens", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("topk", sa.Integer(), nullable=False),
        sa.Column("num_draft_tokens", sa.Integer(), nullable=False),
        sa.Column("decision_source", sa.String(length=16), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("predicted_step_ms", sa.Double(), nullable=True),
        sa.Column("measured_step_ms", sa.Double(), nullable=False),
        sa.Column("predicted_accept_len", sa.Double(), nullable=True),
        sa.Column("measured_accept_len", sa.Double(), nullable=False),
        sa.Column("emitted_tokens", sa.Integer(), nullable=False),
        sa.Column("drafted_tokens", sa.Integer(), nullable=False),
        sa.Column("accepted_tokens", sa.Integer(), nullable=False),
        sa.Column("goodput", sa.Double(), nullable=False),
        sa.Column("accepted_by_depth", sa.String(length=255), nullable=False),
        sa.Column("accepted_by_rank", sa.String(length=255), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_steps_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_steps")),
    )
    # The dashboard reads a run's time range or its latest N steps.
    op.create_index(op.f("ix_steps_run_id_wall_time"), "steps", ["run_id", "wall_time"])
    op.create_index(op.f("ix_steps_run_id_step_index"), "steps", ["run_id", "step_index"])

    op.create_table(
        "step_rollups",
        sa.Column("id", BigId, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("minute", sa.Double(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("topk", sa.Integer(), nullable=False),
        sa.Column("num_draft_tokens", sa.Integer(), nullable=False),
        sa.Column("num_steps", sa.Integer(), nullable=False),
        sa.Column("sum_batch_size", sa.BigInteger(), nullable=False),
        sa.Column("max_batch_size", sa.Integer(), nullable=False),
        sa.Column("sum_context_len", sa.BigInteger(), nullable=False),
        sa.Column("prefill_tokens", sa.BigInteger(), nullable=False),
        sa.Column("sum_measured_step_ms", sa.Double(), nullable=False),
        sa.Column("sum_predicted_step_ms", sa.Double(), nullable=False),
        sa.Column("num_predicted", sa.Integer(), nullable=False),
        sa.Column("sum_measured_accept_len", sa.Double(), nullable=False),
        sa.Column("sum_predicted_accept_len", sa.Double(), nullable=False),
        sa.Column("emitted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("drafted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_by_depth", sa.String(length=255), nullable=False),
        sa.Column("accepted_by_rank", sa.String(length=255), nullable=False),
        sa.Column("decision_sources", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_step_rollups_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_rollups")),
    )
    op.create_index(
        op.f("ix_step_rollups_run_id_minute_steps_topk_num_draft_tokens"),
        "step_rollups",
        ["run_id", "minute", "steps", "topk", "num_draft_tokens"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_table("step_rollups")
    op.drop_table("steps")
    op.drop_table("runs")
