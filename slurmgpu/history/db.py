"""The accounting history store: a typed SQLAlchemy 2.x schema and its engine.

One schema serves SQLite (the embedded default), PostgreSQL and MariaDB; Alembic migrations in
``migrations/`` create it. Times are stored as naive UTC (SQLite keeps no zone), and every
writer converts to UTC before it gets here.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

DEFAULT_SQLITE = os.path.join("~", ".local", "share", "slurmgpu", "slurmgpu.db")
LOCK_TIMEOUT_S = 5  # how long a writer waits for SQLite's lock, or a server's connection, before it says so


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Job(Base):
    """One Slurm job (array tasks and hetjob components are jobs of their own), steps folded in."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("cluster", "job_id", name="uq_jobs_cluster_job_id"),
        UniqueConstraint("cluster", "retry_of", name="uq_jobs_cluster_retry_of"),  # a job is retried once
        Index("ix_jobs_user_submit", "user", "submit_time"),
        Index("ix_jobs_submit", "submit_time"),
        Index("ix_jobs_end", "end_time"),
        Index("ix_jobs_state", "state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(String(64))  # as sacct prints it: 123, 123_4, 123+0
    job_id_raw: Mapped[int | None] = mapped_column(BigInteger)
    array_job_id: Mapped[int | None] = mapped_column(BigInteger)
    array_task_id: Mapped[int | None] = mapped_column(Integer)
    het_job_id: Mapped[int | None] = mapped_column(BigInteger)
    het_offset: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str | None] = mapped_column(String(256))
    user: Mapped[str | None] = mapped_column(String(64))
    account: Mapped[str | None] = mapped_column(String(64))
    partition: Mapped[str | None] = mapped_column(String(128))
    qos: Mapped[str | None] = mapped_column(String(64))
    submit_time: Mapped[datetime | None] = mapped_column(DateTime)
    eligible_time: Mapped[datetime | None] = mapped_column(DateTime)
    start_time: Mapped[datetime | None] = mapped_column(DateTime)
    end_time: Mapped[datetime | None] = mapped_column(DateTime)
    elapsed_s: Mapped[int | None] = mapped_column(Integer)
    time_limit_s: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(32))  # COMPLETED, CANCELLED, ... (no "by N")
    state_detail: Mapped[str | None] = mapped_column(String(64))  # as printed: "CANCELLED by 1000"
    exit_code: Mapped[int | None] = mapped_column(Integer)
    exit_signal: Mapped[int | None] = mapped_column(Integer)
    req_tres: Mapped[str | None] = mapped_column(Text)
    alloc_tres: Mapped[str | None] = mapped_column(Text)
    gpu_type: Mapped[str | None] = mapped_column(String(64))
    gpu_count: Mapped[int] = mapped_column(Integer, default=0)
    nodes: Mapped[int | None] = mapped_column(Integer)
    cpus: Mapped[int | None] = mapped_column(Integer)
    req_mem_mb: Mapped[int | None] = mapped_column(BigInteger)
    max_rss_mb: Mapped[float | None] = mapped_column(Float)
    node_list: Mapped[str | None] = mapped_column(Text)
    comment: Mapped[str | None] = mapped_column(Text)
    sacct_gpu_mem_mib: Mapped[float | None] = mapped_column(Float)  # steps' TRESUsageInMax gres/gpumem
    sacct_gpu_util: Mapped[float | None] = mapped_column(Float)  # steps' TRESUsageInMax gres/gpuutil
    # the hook's decision, from the "slurmgpu:d=<id>;..." tag in AdminComment (links to submissions.decision_id)
    decision_id: Mapped[str | None] = mapped_column(String(12), index=True)
    # The job this one retries (``slurmgpu retry`` after a GPU OOM; migration 0004): set by retry, never by sacct
    retry_of: Mapped[str | None] = mapped_column(String(64))
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)


class GpuUsage(Base):
    """GPU measurements of one job on one host, from the NVML collector's spool records."""

    __tablename__ = "gpu_usage"
    __table_args__ = (
        UniqueConstraint("cluster", "job_id", "hostname", "source", name="uq_gpu_usage_job_host_source"),
        Index("ix_gpu_usage_job", "cluster", "job_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(String(64))
    hostname: Mapped[str] = mapped_column(String(128))
    source: Mapped[str] = mapped_column(String(16))  # "nvml"
    gpus: Mapped[int] = mapped_column(Integer)
    peak_mem_mib: Mapped[float] = mapped_column(Float)
    peak_proc_mem_mib: Mapped[float | None] = mapped_column(Float)
    mean_util: Mapped[float | None] = mapped_column(Float)
    max_util: Mapped[float | None] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)
    start_time: Mapped[datetime | None] = mapped_column(DateTime)
    end_time: Mapped[datetime | None] = mapped_column(DateTime)
    detail: Mapped[Any] = mapped_column(JSON)  # per-GPU figures as the collector wrote them
    # A GPU out-of-memory message in the job's stderr when it ended: the framework (pytorch, cuda,
    # tensorflow, jax) and the line; NULL when none was found or the record predates the scan.
    gpu_oom: Mapped[str | None] = mapped_column(String(16))
    gpu_oom_line: Mapped[str | None] = mapped_column(Text)


class Submission(Base):
    """What gsbatch was asked, what it decided and submitted; joined with jobs by job id."""

    __tablename__ = "submissions"
    __table_args__ = (Index("ix_submissions_job", "cluster", "job_id"), Index("ix_submissions_user", "user"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    record_id: Mapped[str] = mapped_column(String(64), unique=True)  # uuid from gsbatch: loads are idempotent
    cluster: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(64))  # None when sbatch refused the job
    user: Mapped[str] = mapped_column(String(64))  # from the spool file's owner, never its content
    submitted_at: Mapped[datetime] = mapped_column(DateTime)
    script_sha256: Mapped[str | None] = mapped_column(String(64))
    sbatch_exit: Mapped[int | None] = mapped_column(Integer)
    features: Mapped[Any] = mapped_column(JSON)
    original_request: Mapped[Any] = mapped_column(JSON)
    decision: Mapped[Any] = mapped_column(JSON)
    changed: Mapped[bool] = mapped_column(Boolean, default=False)
    decision_id: Mapped[str | None] = mapped_column(String(12), index=True)  # in the job's AdminComment tag too (hook)
    # Lineage (migration 0003): who decided ("gsbatch", or "lua": the daemon for slurmctld's hook), with
    # which decider ("model", "rules", "keep") and model bundle (Bundle.digest; None for rules and keep).
    # The script's text, when the record carried it, is in job_scripts under script_sha256.
    source: Mapped[str | None] = mapped_column(String(16))
    decider: Mapped[str | None] = mapped_column(String(24))
    model_version: Mapped[str | None] = mapped_column(String(12), index=True)
    model_version_id: Mapped[int | None] = mapped_column(ForeignKey("model_versions.id", ondelete="SET NULL"))
    registered_version: Mapped[ModelVersion | None] = relationship()


SCRIPT_TEXT = Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")  # MariaDB's TEXT stops at 64 KiB


class JobScript(Base):
    """Each batch script once, by the sha256 of its bytes (submissions.script_sha256 names it)."""

    __tablename__ = "job_scripts"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    text: Mapped[str] = mapped_column(SCRIPT_TEXT)
    first_seen: Mapped[datetime] = mapped_column(DateTime)  # the first stored submission's time


class ModelVersion(Base):
    """The model registry: each trained model file with its metrics and training window."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("name", "version", name="uq_model_versions_name_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    train_start: Mapped[datetime | None] = mapped_column(DateTime)
    train_end: Mapped[datetime | None] = mapped_column(DateTime)
    features: Mapped[Any] = mapped_column(JSON)
    metrics: Mapped[Any] = mapped_column(JSON)
    active: Mapped[bool] = mapped_column(Boolean, default=False)
    digest: Mapped[str | None] = mapped_column(String(12), index=True)  # Bundle.digest: what decisions record


class IngestState(Base):
    """Where the last sacct ingest of a cluster stopped (the incremental watermark)."""

    __tablename__ = "ingest_state"

    cluster: Mapped[str] = mapped_column(String(64), primary_key=True)
    watermark: Mapped[datetime] = mapped_column(DateTime)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)


def resolve_url(url: str | None = None) -> str:
    """The database URL: explicit, then $SLURMGPU_DB_URL, then a personal SQLite file."""
    url = url or os.environ.get("SLURMGPU_DB_URL")
    if url:
        return url
    return "sqlite:///" + os.path.expanduser(DEFAULT_SQLITE)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the nightly writer
    cur.execute(f"PRAGMA busy_timeout={LOCK_TIMEOUT_S * 1000}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str | None = None) -> Engine:
    """An engine for the URL; a new SQLite file is created private to its owner (0600)."""
    url = resolve_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = parsed.database
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", mode=0o700, exist_ok=True)
            if not os.path.exists(path):
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        engine = create_engine(url, connect_args={"timeout": LOCK_TIMEOUT_S})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() in ("postgresql", "mysql", "mariadb") and "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = LOCK_TIMEOUT_S  # an unreachable server answers in seconds, not minutes
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


def describe_error(url: str, exc: BaseException) -> str:
    """One line for a database that cannot be used now: which database, what happened, what to do."""
    shown = make_url(url).render_as_string(hide_password=True)
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = detail[0] if detail else type(exc).__name__
    if "locked" in first or "lock wait timeout" in first.lower():
        return (f"database {shown} is locked by another writer (another `slurmgpu ingest`, `train` or `nightly`?): "
                f"gave up after {LOCK_TIMEOUT_S} s; run again when it has finished")
    return (f"database {shown} unreachable: {first}: check that it is running and that --db, "
            "$SLURMGPU_DB_URL or the config's [site] database_url names it")


def migrations_dir() -> str:
    """Migrations ship inside the wheel; a source checkout reads the top-level folder."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the slurmgpu package
    packaged = os.path.join(here, "_migrations")
    return packaged if os.path.isdir(packaged) else os.path.join(os.path.dirname(here), "migrations")


def alembic_config(url: str | None = None) -> Any:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", migrations_dir())
    cfg.set_main_option("sqlalchemy.url", resolve_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str | None = None) -> str | None:
    """The schema revision the database is at (None when never migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
