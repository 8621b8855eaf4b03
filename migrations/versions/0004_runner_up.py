"""Steps record the runner-up: the candidate priced next best, and what was predicted for it.

* ``steps.runner_up``: ``"S,K,N"``, of the other candidates the one with the highest predicted
  goodput when the step was decided;
* ``steps.runner_up_step_ms`` and ``steps.runner_up_accept_len``: its predicted step time and
  acceptance length.

All three are nullable: rows written before this revision, and steps whose rule priced no
other shape (a baseline's), have none.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("runner_up", sa.String(32), nullable=True))
        batch.add_column(sa.Column("runner_up_step_ms", sa.Double(), nullable=True))
        batch.add_column(sa.Column("runner_up_accept_len", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("runner_up_accept_len")
        batch.drop_column("runner_up_step_ms")
        batch.drop_column("runner_up")
