"""Reading the history back: jobs joined with their best GPU measurement."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import String, cast, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from slurmgpu.db import GpuUsage, Job


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() + "Z" if t else None


def job_rows(engine: Engine, user: str | None = None, since: datetime | None = None,
             job_ids: Sequence[str] = (), limit: int = 1000) -> list[dict[str, Any]]:
    """Jobs as plain dicts; GPU peaks come from the collector, else from sacct's gres/gpumem."""
    usage = (select(GpuUsage.cluster, GpuUsage.job_id,
                    func.max(GpuUsage.peak_mem_mib).label("peak"), func.max(GpuUsage.max_util).label("util"))
             .group_by(GpuUsage.cluster, GpuUsage.job_id).subquery())
    stmt = (select(Job, usage.c.peak, usage.c.util)
            # A prolog-started collector may only know the raw id of an array task.
            .outerjoin(usage, (usage.c.cluster == Job.cluster)
                       & ((usage.c.job_id == Job.job_id) | (usage.c.job_id == cast(Job.job_id_raw, String))))
            .order_by(Job.submit_time, Job.job_id_raw, Job.job_id).limit(limit))
    if user:
        stmt = stmt.where(Job.user == user)
    if since:
        stmt = stmt.where(Job.submit_time >= since)
    if job_ids:
        stmt = stmt.where(Job.job_id.in_(list(job_ids)))
    with Session(engine) as session:
        return [_row(job, peak, util) for job, peak, util in session.execute(stmt)]


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
        "gpu_usage_source": "nvml" if peak is not None else ("sacct" if job.sacct_gpu_mem_mib is not None else None),
    }
