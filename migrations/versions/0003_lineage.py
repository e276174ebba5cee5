"""Decision lineage: scripts stored once by sha256, each submission's source, decider and model version

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 16:00:00
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_scripts",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("text", sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb"), nullable=False),
        sa.Column("first_seen", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("sha256"),
    )
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("source", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("decider", sa.String(length=24), nullable=True))
        batch_op.add_column(sa.Column("model_version", sa.String(length=12), nullable=True))
        batch_op.create_index("ix_submissions_model_version", ["model_version"], unique=False)
    # Every submission stored before this came from gsbatch (the daemon recorded nothing).
    op.execute("UPDATE submissions SET source = 'gsbatch'")
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("digest", sa.String(length=12), nullable=True))
        batch_op.create_index("ix_model_versions_digest", ["digest"], unique=False)
    _digest_registered_versions()


def _digest_registered_versions() -> None:
    """Versions registered before this get their digest from their bundle file, where it is still readable
    (the digest is the first 12 hex digits of the sha256 of the file's bytes, as Bundle.digest)."""
    if op.get_context().as_sql:  # offline (--sql): there are no files to read
        return
    conn = op.get_bind()
    versions = sa.table("model_versions", sa.column("id", sa.Integer()), sa.column("path", sa.Text()),
                        sa.column("digest", sa.String(12)))
    for row in conn.execute(sa.select(versions.c.id, versions.c.path)).all():
        try:
            with open(row.path, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()[:12]
        except (OSError, TypeError):
            continue
        conn.execute(versions.update().where(versions.c.id == row.id).values(digest=digest))


def downgrade() -> None:
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_index("ix_model_versions_digest")
        batch_op.drop_column("digest")
    with op.batch_alter_table("submissions", schema=None) as batch_op:
        batch_op.drop_index("ix_submissions_model_version")
        batch_op.drop_column("model_version")
        batch_op.drop_column("decider")
        batch_op.drop_column("source")
    op.drop_table("job_scripts")
