"""Retry lineage: a job slurmgpu retry submitted after a GPU OOM names the job it retries

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Unique per cluster: a failed job is retried at most once, whatever runs of retry race (NULLs,
    # every job not a retry, are distinct on SQLite, PostgreSQL and MariaDB alike).
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retry_of", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint("uq_jobs_cluster_retry_of", ["cluster", "retry_of"])


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint("uq_jobs_cluster_retry_of", type_="unique")
        batch_op.drop_column("retry_of")
