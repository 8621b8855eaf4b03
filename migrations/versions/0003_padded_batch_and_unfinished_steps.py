"""Steps record the batch size they ran padded to, not prefill tokens; runs count unfinished steps.

* ``steps.padded_batch_size``: the CUDA-graph batch size the step ran as, which the serving
  engine reports; rows written before it ran without graphs, so they get their batch size.
* ``steps.prefill_tokens`` and ``step_rollups.prefill_tokens`` go: a decode step never prefills
  in the same forward pass, so the column was always 0.
* ``runs.unfinished_steps``: launched decode steps whose outcome never came back.
* Policy versions trained on the old feature vector (it had ``prefill_tokens``) cannot be
  served any more: active ones are deactivated, with an audit entry saying why.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
import time

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

OLD_FEATURE = "prefill_tokens"
ACTOR = "migration 0003"


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("padded_batch_size", sa.Integer(), nullable=True))
    op.execute("UPDATE steps SET padded_batch_size = batch_size")
    with op.batch_alter_table("steps") as batch:
        batch.alter_column("padded_batch_size", existing_type=sa.Integer(), nullable=False)
        batch.drop_column("prefill_tokens")
    with op.batch_alter_table("step_rollups") as batch:
        batch.drop_column("prefill_tokens")
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("unfinished_steps", sa.BigInteger(), nullable=True))
    op.execute("UPDATE runs SET unfinished_steps = 0")
    with op.batch_alter_table("runs") as batch:
        batch.alter_column("unfinished_steps", existing_type=sa.BigInteger(), nullable=False)
    _deactivate_old_feature_versions()


def _deactivate_old_feature_versions() -> None:
    conn = op.get_bind()
    policies = sa.table(
        "policies",
        sa.column("version", sa.Integer()),
        sa.column("feature_names", sa.JSON()),
        sa.column("active", sa.Boolean()),
    )
    audit = sa.table(
        "audit_log",
        sa.column("at", sa.Double()),
        sa.column("actor", sa.String()),
        sa.column("action", sa.String()),
        sa.column("before", sa.JSON()),
        sa.column("after", sa.JSON()),
    )
    rows = conn.execute(
        sa.select(policies.c.version, policies.c.feature_names).where(policies.c.active.is_(True))
    ).all()
    for version, names in rows:
        if isinstance(names, str):
            names = json.loads(names)
        if OLD_FEATURE not in (names or []):
            continue
        conn.execute(sa.update(policies).where(policies.c.version == version).values(active=False))
        conn.execute(
            sa.insert(audit).values(
                at=time.time(),
                actor=ACTOR,
                action="policy.deactivate",
                before={"active_version": version},
                after={
                    "active_version": None,
                    "reason": "trained on a feature vector with prefill_tokens; retrain",
                },
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("unfinished_steps")
    with op.batch_alter_table("step_rollups") as batch:
        batch.add_column(sa.Column("prefill_tokens", sa.BigInteger(), nullable=True))
    op.execute("UPDATE step_rollups SET prefill_tokens = 0")
    with op.batch_alter_table("step_rollups") as batch:
        batch.alter_column("prefill_tokens", existing_type=sa.BigInteger(), nullable=False)
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("prefill_tokens", sa.Integer(), nullable=True))
    op.execute("UPDATE steps SET prefill_tokens = 0")
    with op.batch_alter_table("steps") as batch:
        batch.alter_column("prefill_tokens", existing_type=sa.Integer(), nullable=False)
        batch.drop_column("padded_batch_size")
