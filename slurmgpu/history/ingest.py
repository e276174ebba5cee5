"""Fill the history store: sacct output, collector records and gsbatch submission records.

Loads are idempotent (upserts keyed on cluster + job id, records keyed on their id), run in
transactions of one chunk each, and report every unreadable row by line number while the good
rows still land. Live sacct ingest is incremental from a stored watermark with an overlap, so
jobs that were still running last time are updated.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Insert, Table, select
from sqlalchemy.engine import Connection, Engine

from slurmgpu.history.db import GpuUsage, IngestState, Job, Submission, utcnow
from slurmgpu.pipeline.spool import RECORD_VERSION
from slurmgpu.slurm import sacct

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql.dml import Insert as PgInsert
    from sqlalchemy.dialects.sqlite.dml import Insert as SqliteInsert

JOBS: Table = Job.__table__  # type: ignore[assignment]
JOB_COLUMNS = tuple(c.name for c in JOBS.columns if c.name not in ("id", "updated_at"))
OVERLAP = timedelta(minutes=30)


class Report:
    """What one ingest did; printed for the admin and the nightly log."""

    def __init__(self) -> None:
        self.inserted = self.updated = self.unchanged = 0
        self.errors: list[sacct.RowError] = []
        self.files_loaded = 0
        self.files_rejected: list[str] = []

    def summary(self) -> str:
        text = (f"{self.inserted} jobs inserted, {self.updated} updated, {self.unchanged} unchanged, "
                f"{len(self.errors)} rows rejected")
        if self.files_loaded or self.files_rejected:
            text += f"; {self.files_loaded} spool records loaded, {len(self.files_rejected)} rejected"
        return text


def upsert(conn: Connection, table: Table, rows: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    """Insert rows, updating those whose keys exist, in the dialect's own syntax."""
    if not rows:
        return
    name = conn.dialect.name
    cols = [c for c in rows[0] if c not in keys]
    stmt: Insert
    if name in ("sqlite", "postgresql"):
        conflict: SqliteInsert | PgInsert
        if name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            conflict = sqlite_insert(table)
        else:
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            conflict = pg_insert(table)
        stmt = conflict.on_conflict_do_update(index_elements=list(keys),
                                              set_={c: conflict.excluded[c] for c in cols})
    elif name in ("mysql", "mariadb"):
        from sqlalchemy.dialects.mysql import insert as mysql_insert

        duplicate = mysql_insert(table)
        stmt = duplicate.on_duplicate_key_update({c: duplicate.inserted[c] for c in cols})
    else:
        raise RuntimeError(f"unsupported database dialect {name}")
    conn.execute(stmt, rows)


def _chunks(items: Iterable[sacct.JobRecord | sacct.RowError], size: int,
            report: Report) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, sacct.RowError):
            report.errors.append(item)
            continue
        chunk.append(item.values)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def load_jobs(engine: Engine, items: Iterable[sacct.JobRecord | sacct.RowError], report: Report | None = None,
              chunk_size: int = 5000, on_chunk: Callable[[int], None] | None = None) -> Report:
    """Upsert job records chunk by chunk, one transaction each; rows identical to the stored
    ones are not written, so a repeated load changes nothing."""
    report = report or Report()
    for chunk in _chunks(items, chunk_size, report):
        latest = {(r["cluster"], r["job_id"]): r for r in chunk}  # a later row for a job wins
        with engine.begin() as conn:
            stored = _stored(conn, list(latest))
            fresh = []
            now = utcnow()
            for key, row in latest.items():
                old = stored.get(key)
                if old is None:
                    report.inserted += 1
                elif any(old[c] != row[c] for c in JOB_COLUMNS):
                    report.updated += 1
                else:
                    report.unchanged += 1
                    continue
                fresh.append({**row, "updated_at": now})
            upsert(conn, JOBS, fresh, ("cluster", "job_id"))
        if on_chunk:
            on_chunk(len(chunk))
    return report


def _stored(conn: Connection, keys: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    by_cluster: dict[str, list[str]] = {}
    for cluster, job_id in keys:
        by_cluster.setdefault(cluster, []).append(job_id)
    cols = [JOBS.c[c] for c in JOB_COLUMNS]
    for cluster, ids in by_cluster.items():
        for start in range(0, len(ids), 900):  # stay under every backend's bind-parameter limit
            rows = conn.execute(select(*cols).where(JOBS.c.cluster == cluster,
                                                    JOBS.c.job_id.in_(ids[start:start + 900])))
            for r in rows.mappings():
                out[(r["cluster"], r["job_id"])] = dict(r)
    return out


# --- live sacct ---------------------------------------------------------------------------


def sacct_command(since: datetime, until: datetime, cluster: str | None = None) -> list[str]:
    """sacct for all users' jobs active in [since, until] (UTC in; sacct wants local time)."""
    def local(t: datetime) -> str:
        return t.replace(tzinfo=UTC).astimezone().strftime("%Y-%m-%dT%H:%M:%S")

    argv = ["sacct", "--allusers", "--parsable2", "--noheader", f"--delimiter={sacct.LIVE_DELIMITER}",
            f"--format={','.join(sacct.FIELDS)}", f"--starttime={local(since)}", f"--endtime={local(until)}"]
    if cluster:
        argv.append(f"--clusters={cluster}")
    return argv


def watermark(engine: Engine, cluster: str) -> datetime | None:
    with engine.connect() as conn:
        return conn.execute(select(IngestState.watermark).where(IngestState.cluster == cluster)).scalar()


def _set_watermark(conn: Connection, cluster: str, until: datetime) -> None:
    row = {"cluster": cluster, "watermark": until, "updated_at": utcnow()}
    upsert(conn, IngestState.__table__, [row], ("cluster",))  # type: ignore[arg-type]


def ingest_sacct(engine: Engine, cluster: str, since: datetime | None = None, until: datetime | None = None,
                 default_days: int = 30, on_chunk: Callable[[int], None] | None = None) -> Report:
    """Run sacct from the watermark (minus an overlap) to now and load what it prints."""
    until = until or utcnow()
    if since is None:
        mark = watermark(engine, cluster)
        since = mark - OVERLAP if mark else until - timedelta(days=default_days)
    argv = sacct_command(since, until)
    summed = sacct.gpu_usage_is_summed(subprocess.run([argv[0], "--version"], capture_output=True, text=True,
                                                      timeout=30, check=False).stdout)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                            errors="surrogateescape")
    assert proc.stdout is not None and proc.stderr is not None
    try:
        report = load_jobs(engine, sacct.parse_lines(proc.stdout, sacct.FIELDS, sacct.LIVE_DELIMITER, cluster,
                                                     summed), on_chunk=on_chunk)
    finally:
        proc.stdout.close()
        err = proc.stderr.read()
        code = proc.wait()
    if code != 0:
        raise RuntimeError(f"sacct exited {code}: {err.strip()}")
    with engine.begin() as conn:
        _set_watermark(conn, cluster, until)
    return report


# --- submission records -------------------------------------------------------------------

_SUBMISSION_KEYS = {"version", "record_id", "submitted_at", "cluster", "job_id", "script_sha256", "sbatch_exit",
                    "features", "original_request", "decision", "changed"}


def _owner(st: os.stat_result) -> str:
    try:
        return pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        return str(st.st_uid)


def read_submission(path: str) -> dict[str, Any]:
    """Validate one spool file; the user comes from the file's owner."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        data = json.loads(fh.read(1 << 20))
    if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
        raise ValueError("not a version-1 submission record")
    missing = _SUBMISSION_KEYS - data.keys()
    if missing:
        raise ValueError(f"missing {', '.join(sorted(missing))}")
    return {
        "record_id": str(data["record_id"])[:64],
        "cluster": str(data["cluster"] or "default")[:64],
        "job_id": str(data["job_id"])[:64] if data["job_id"] is not None else None,
        "user": _owner(st),
        "submitted_at": datetime.fromisoformat(data["submitted_at"]).astimezone(UTC).replace(tzinfo=None),
        "script_sha256": data["script_sha256"],
        "sbatch_exit": data["sbatch_exit"],
        "features": data["features"],
        "original_request": data["original_request"],
        "decision": data["decision"],
        "changed": bool(data["changed"]),
    }


def drain_spool(engine: Engine, directory: str, wanted: Callable[[str], bool],
                read: Callable[[str], dict[str, Any]], store: Callable[[Connection, list[dict[str, Any]]], None],
                report: Report) -> Report:
    """Read every finished record in a spool, store them in one transaction, then remove them;
    a record that cannot be read is renamed ``*.rejected`` and reported."""
    if not os.path.isdir(directory):
        return report
    rows, paths = [], []
    for name in sorted(n for n in os.listdir(directory) if wanted(n)):
        path = os.path.join(directory, name)
        try:
            rows.append(read(path))
            paths.append(path)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            report.files_rejected.append(str(exc) if str(exc).startswith(path) else f"{path}: {exc}")
            os.replace(path, path + ".rejected")
    if rows:
        with engine.begin() as conn:
            store(conn, rows)
        report.files_loaded += len(rows)
        for path in paths:
            os.unlink(path)
    return report


def _store_submissions(conn: Connection, rows: list[dict[str, Any]]) -> None:
    known = set(conn.execute(select(Submission.record_id).where(
        Submission.record_id.in_([r["record_id"] for r in rows]))).scalars())
    new = [r for r in rows if r["record_id"] not in known]
    if new:
        conn.execute(cast(Table, Submission.__table__).insert(), new)


def load_submissions(engine: Engine, directory: str, report: Report | None = None) -> Report:
    """Load gsbatch's submission records (once each, by record id)."""
    return drain_spool(engine, directory, lambda n: n.startswith("sub-") and n.endswith(".json"),
                       read_submission, _store_submissions, report or Report())


# --- GPU collector records ------------------------------------------------------------------


def _gpu_row(path: str) -> dict[str, Any]:
    from slurmgpu.collector.records import read_record

    rec = read_record(path)
    return {
        "cluster": rec.cluster, "job_id": rec.job_id, "hostname": rec.hostname, "source": rec.source,
        "gpus": len(rec.gpus), "peak_mem_mib": rec.peak_gpu_mem_mib,
        "peak_proc_mem_mib": max((g.peak_proc_mem_mib for g in rec.gpus if g.peak_proc_mem_mib is not None),
                                 default=None),
        "mean_util": rec.mean_gpu_util, "max_util": rec.max_gpu_util, "samples": rec.samples,
        "start_time": rec.start.replace(tzinfo=None), "end_time": rec.end.replace(tzinfo=None),
        "detail": [g._asdict() for g in rec.gpus],
    }


def load_gpu_records(engine: Engine, directory: str, report: Report | None = None) -> Report:
    """Load slurmgpu-monitor's per-job records (a host's record for a job replaces its older one)."""
    def store(conn: Connection, rows: list[dict[str, Any]]) -> None:
        upsert(conn, GpuUsage.__table__, rows, ("cluster", "job_id", "hostname", "source"))  # type: ignore[arg-type]

    return drain_spool(engine, directory, lambda n: n.endswith(".json") and not n.startswith("."), _gpu_row,
                       store, report or Report())
