"""Reading the history back: jobs joined with their best GPU measurement."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from slurmgpu.history.db import GpuUsage, Job


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() + "Z" if t else None


def gpu_peaks(conn: Any, cluster_ids: dict[str, set[str]]) -> dict[tuple[str, str], tuple[float, float | None]]:
    """Collector peaks (memory, utilisation) per (cluster, job id), for the ids asked.

    Matching happens here rather than in SQL: a prolog-started collector may only know the raw
    id of an array task, and comparing a text column with a cast number trips MariaDB's collations.
    """
    out: dict[tuple[str, str], tuple[float, float | None]] = {}
    for cluster, ids in cluster_ids.items():
        id_list = sorted(ids)
        for start in range(0, len(id_list), 900):
            stmt = (select(GpuUsage.job_id, func.max(GpuUsage.peak_mem_mib), func.max(GpuUsage.max_util))
                    .where(GpuUsage.cluster == cluster, GpuUsage.job_id.in_(id_list[start:start + 900]))
                    .group_by(GpuUsage.job_id))
            for job_id, peak, util in conn.execute(stmt):
                out[(cluster, job_id)] = (peak, util)
    return out


def peak_of(peaks: dict[tuple[str, str], tuple[float, float | None]], cluster: str, job_id: str,
            raw: int | None) -> tuple[float, float | None] | None:
    return peaks.get((cluster, job_id)) or (peaks.get((cluster, str(raw))) if raw is not None else None)


def _job_filter(stmt: Any, user: str | None, since: datetime | None, job_ids: Sequence[str]) -> Any:
    if user:
        stmt = stmt.where(Job.user == user)
    if since:
        stmt = stmt.where(Job.submit_time >= since)
    if job_ids:
        stmt = stmt.where(Job.job_id.in_(list(job_ids)))
    return stmt


def job_rows(engine: Engine, user: str | None = None, since: datetime | None = None,
             job_ids: Sequence[str] = (), limit: int = 1000) -> list[dict[str, Any]]:
    """The newest ``limit`` jobs, newest first, as plain dicts; GPU peaks come from the collector,
    else from sacct's gres/gpumem."""
    stmt = _job_filter(select(Job), user, since, job_ids) \
        .order_by(Job.submit_time.desc(), Job.job_id_raw.desc(), Job.job_id.desc()).limit(limit)
    with Session(engine) as session:
        jobs = list(session.scalars(stmt))
        wanted: dict[str, set[str]] = {}
        for j in jobs:
            wanted.setdefault(j.cluster, set()).update({j.job_id, str(j.job_id_raw)})
        peaks = gpu_peaks(session.connection(), wanted)
        return [_row(j, *(peak_of(peaks, j.cluster, j.job_id, j.job_id_raw) or (None, None))) for j in jobs]


def job_count(engine: Engine, user: str | None = None, since: datetime | None = None,
              job_ids: Sequence[str] = ()) -> int:
    """How many stored jobs match (so a listing cut at its limit can say how many it left out)."""
    with engine.connect() as conn:
        return int(conn.execute(_job_filter(select(func.count()).select_from(Job), user, since, job_ids)).scalar_one())


def _row(job: Any, peak: float | None, util: float | None) -> dict[str, Any]:
    return {
        "cluster": job.cluster,
        "job_id": job.job_id,
        "user": job.user,
        "account": job.account,
        "partition": job.partition,
        "state": job.state,
        "state_detail": job.state_detail,
        "exit_code": job.exit_code,
        "gpu_type": job.gpu_type,
        "gpu_count": job.gpu_count,
        "nodes": job.nodes,
        "cpus": job.cpus,
        "submit_time": _iso(job.submit_time),
        "start_time": _iso(job.start_time),
        "end_time": _iso(job.end_time),
        "elapsed_s": job.elapsed_s,
        "time_limit_s": job.time_limit_s,
        "peak_gpu_mem_mib": peak if peak is not None else job.sacct_gpu_mem_mib,
        "max_gpu_util": util if util is not None else job.sacct_gpu_util,
        "gpu_usage_source": "collector" if peak is not None
        else ("sacct" if job.sacct_gpu_mem_mib is not None else None),
    }
