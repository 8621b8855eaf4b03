"""Operator control: policy versions, pins, retrain jobs and the audit log.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# SQLite only auto-increments an INTEGER PRIMARY KEY (the rowid), never a BIGINT one.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("artifact", sa.LargeBinary(), nullable=False),
        sa.Column("feature_names", sa.JSON(), nullable=False),
        sa.Column("training_rows", sa.Integer(), nullable=False),
        sa.Column("validation_metrics", sa.JSON(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("activated_at", sa.Double(), nullable=True),
        sa.Column("activated_by", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_policies")),
        sa.UniqueConstraint("version", name=op.f("uq_policies_version")),
    )
    op.create_index(op.f("ix_policies_active"), "policies", ["active"])

    op.create_table(
        "pins",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("topk", sa.Integer(), nullable=False),
        sa.Column("num_draft_tokens", sa.Integer(), nullable=False),
        sa.Column("min_batch_size", sa.Integer(), nullable=True),
        sa.Column("max_batch_size", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("created_by", sa.String(length=255), nullable=False),
        sa.Column("cleared_at", sa.Double(), nullable=True),
        sa.Column("cleared_by", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pins")),
    )
    # The serving worker polls the active (uncleared) pins every second.
    op.create_index(op.f("ix_pins_cleared_at"), "pins", ["cleared_at"])

    op.create_table(
        "retrain_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("requested_by", sa.String(length=255), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("progress", sa.Double(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("rows_used", sa.Integer(), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("force", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retrain_jobs")),
    )
    op.create_index(op.f("ix_retrain_jobs_status"), "retrain_jobs", ["status"])

    op.create_table(
        "audit_log",
        sa.Column("id", BigId, nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"])


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("retrain_jobs")
    op.drop_table("pins")
    op.drop_table("policies")
