"""GPU-OOM outcomes from the collector, and decision ids linking jobs to gsbatch's submissions

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("gpu_usage", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_oom", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("gpu_oom_line", sa.Text(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("decision_id", sa.String(length=12), nullable=True))
        batch_op.create_index("ix_jobs_decision_id", ["decision_id"], unique=False)
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("decision_id", sa.String(length=12), nullable=True))
        batch_op.create_index("ix_submissions_decision_id", ["decision_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.drop_index("ix_submissions_decision_id")
        batch_op.drop_column("decision_id")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_decision_id")
        batch_op.drop_column("decision_id")
    with op.batch_alter_table("gpu_usage", schema=None) as batch_op:
        batch_op.drop_column("gpu_oom_line")
        batch_op.drop_column("gpu_oom")
