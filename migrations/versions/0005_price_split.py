"""Steps record how the machine priced steps against the step-time model when they were decided.

The cost model's residual correction (``core.cost_model.ResidualCorrection``) estimates, in log
units of measured over predicted step time:

* ``steps.price_drift``: the part common to every shape (the machine's speed against the model);
* ``steps.price_tilt``: the part per unit of a shape's lever (the log of its predicted time over
  no speculation's): how much dearer the larger shapes are here than the model says;
* ``steps.price_offset``: the part common to every speculative shape.

All three are nullable: rows written before this revision, and steps decided under a cost model
without a residual correction, have none.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("price_drift", sa.Double(), nullable=True))
        batch.add_column(sa.Column("price_tilt", sa.Double(), nullable=True))
        batch.add_column(sa.Column("price_offset", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("price_offset")
        batch.drop_column("price_tilt")
        batch.drop_column("price_drift")
