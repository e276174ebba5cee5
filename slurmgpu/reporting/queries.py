"""What a report reads from the history database: each GPU job with its hosts' GPU use and its
submission record."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.engine import Engine

from slurmgpu.history.db import GpuUsage, Job, Submission
from slurmgpu.history.queries import IDLE_PEAK_MIB, IDLE_UTIL_PCT, gpus_busy

UNTYPED = "untyped"
# A collector record that started this long before sacct's start of the job belongs to an earlier
# attempt of a requeued job (sacct keeps the latest attempt only); the slack absorbs the prolog's
# delay and clock differences between the nodes and slurmctld.
ATTEMPT_SLACK = timedelta(seconds=60)
NOT_STARTED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})  # the latest attempt has not run


class JobUse(NamedTuple):
    """One GPU job of the window with its measurements and, if gsbatch submitted it, its decision."""

    job_id: str
    user: str
    account: str
    gpu_type: str
    gpu_count: int
    elapsed_s: int
    state: str
    end_time: datetime
    peak_mib: float | None  # per GPU
    max_util: float | None  # percent
    gpus_busy: int | None  # GPUs that reached IDLE_UTIL_PCT; None without per-GPU figures
    original: Mapping[str, Any] | None
    decision: Mapping[str, Any] | None
    changed: bool
    mean_util: float | None = None  # percent, over the job's GPUs (collector only)
    partition: str | None = None
    gpu_oom: str | None = None  # the framework whose GPU OOM message the collector found in stderr
    usable_mib: float | None = None  # the least memory NVML reported for the job's GPUs (collector only)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_count * self.elapsed_s / 3600.0

    @property
    def idle(self) -> bool:
        return ((self.max_util is not None and self.max_util < IDLE_UTIL_PCT)
                or (self.peak_mib is not None and self.peak_mib < IDLE_PEAK_MIB))



def load_jobs(engine: Engine, since: datetime, until: datetime, user: str | None = None,
              account: str | None = None, cluster: str | None = None) -> list[JobUse]:
    """GPU jobs that ended in [since, until) (naive UTC), with their collector rows and submission.

    Those are matched here rather than joined in SQL: the keys are ids as text on one side and
    numbers on the other, and a cast in the join trips MariaDB's collation rules.
    """
    stmt = (select(Job.cluster, Job.job_id, Job.job_id_raw, Job.array_job_id, Job.het_job_id, Job.user, Job.account,
                   Job.gpu_type, Job.gpu_count, Job.elapsed_s, Job.state, Job.end_time, Job.sacct_gpu_mem_mib,
                   Job.sacct_gpu_util, Job.partition, Job.start_time)
            .where(Job.gpu_count > 0, Job.end_time >= since, Job.end_time < until)
            .order_by(Job.end_time, Job.id))
    if user is not None:
        stmt = stmt.where(Job.user == user)
    if account is not None:
        stmt = stmt.where(Job.account == account)
    if cluster is not None:
        stmt = stmt.where(Job.cluster == cluster)
    with engine.connect() as conn:
        jobs = conn.execute(stmt).all()
        usage = _rows_by_id(conn, GpuUsage.__table__, {k for j in jobs for k in _usage_keys(j)})
        subs = _rows_by_id(conn, Submission.__table__, {k for j in jobs for k in _submission_keys(j)})
    return [job_use(j, this_attempt(j, [u for k in _usage_keys(j) for u in usage.get(k, ())])[0],
                     next((s for k in _submission_keys(j) for s in subs.get(k, ())), None)) for j in jobs]



class OneJob(NamedTuple):
    """A job row (every column) with its collector rows, one per host, and its submission record."""

    job: Any
    hosts: list[Any]
    submission: Any | None


def find_job(engine: Engine, job_id: str, cluster: str | None = None) -> OneJob | None:
    """The job sacct calls ``job_id`` (or whose raw id it is), newest first when clusters share ids."""
    stmt = select(Job.__table__).order_by(Job.submit_time.desc(), Job.id.desc())
    if cluster is not None:
        stmt = stmt.where(Job.cluster == cluster)
    with engine.connect() as conn:
        row = conn.execute(stmt.where(Job.job_id == job_id).limit(1)).first()
        if row is None and job_id.isdigit():
            row = conn.execute(stmt.where(Job.job_id_raw == int(job_id)).limit(1)).first()
        if row is None:
            return None
        usage = _rows_by_id(conn, GpuUsage.__table__, set(_usage_keys(row)))
        subs = _rows_by_id(conn, Submission.__table__, set(_submission_keys(row)))
    hosts = [u for k in _usage_keys(row) for u in usage.get(k, ())]
    return OneJob(row, sorted(hosts, key=lambda h: h.hostname),
                  next((s for k in _submission_keys(row) for s in subs.get(k, ())), None))



def this_attempt(job: Any, hosts: list[Any]) -> tuple[list[Any], list[Any]]:
    """(the collector rows of the attempt sacct describes, those of earlier attempts).

    A requeued job keeps one id: sacct reports its latest attempt while the collector's records of
    an earlier one stay in the store. Mixing them would put one attempt's samples beside another's
    state and run time. A record without a start time, or a job without times that has run, keeps
    its records (nothing tells them apart)."""
    start = job.start_time
    if start is None and job.end_time is not None and job.elapsed_s is not None:
        start = job.end_time - timedelta(seconds=job.elapsed_s)  # a history imported without Start
    kept, earlier = [], []
    for h in hosts:
        if h.start_time is not None and (h.start_time < start - ATTEMPT_SLACK if start is not None
                                         else job.state in NOT_STARTED):
            earlier.append(h)
        else:
            kept.append(h)
    return kept, earlier


def _usage_keys(job: Any) -> tuple[tuple[str, str], ...]:
    """A prolog-started collector may only know an array task's raw id."""
    raw = str(job.job_id_raw) if job.job_id_raw is not None else job.job_id
    return ((job.cluster, job.job_id),) if raw == job.job_id else ((job.cluster, job.job_id), (job.cluster, raw))



def _submission_keys(job: Any) -> tuple[tuple[str, str], ...]:
    """gsbatch records the id sbatch printed: an array's or hetjob's, shared by its tasks/components."""
    shared = job.array_job_id if job.array_job_id is not None else job.het_job_id
    return ((job.cluster, str(shared)),) if shared is not None else ((job.cluster, job.job_id),)



def _rows_by_id(conn: Any, table: Any, keys: set[tuple[str, str]],
                chunk: int = 900) -> dict[tuple[str, str], list[Any]]:
    """Rows of table whose (cluster, job_id) is one of keys, in chunks under every backend's bind limit."""
    ids = sorted({job_id for _, job_id in keys})
    out: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for start in range(0, len(ids), chunk):
        for row in conn.execute(select(table).where(table.c.job_id.in_(ids[start:start + chunk]))):
            if (row.cluster, row.job_id) in keys:
                out[(row.cluster, row.job_id)].append(row)
    return out



def job_use(job: Any, hosts: list[Any], sub: Any) -> JobUse:
    """One job with its collector rows (one per host) folded: peaks are maxima, busy GPUs a sum."""
    mean: float | None = None
    if hosts:
        peak: float | None = max(h.peak_mem_mib for h in hosts)
        utils = [h.max_util for h in hosts if h.max_util is not None]
        util = max(utils) if utils else None
        busy = gpus_busy([h.detail for h in hosts])
        means = [(h.mean_util, max(h.gpus, 1)) for h in hosts if h.mean_util is not None]
        mean = sum(m * n for m, n in means) / sum(n for _, n in means) if means else None
        oom = next((h.gpu_oom for h in hosts if h.gpu_oom), None)
        totals = [g["memory_total_mib"] for h in hosts if isinstance(h.detail, list) for g in h.detail
                  if isinstance(g, dict) and isinstance(g.get("memory_total_mib"), (int, float))
                  and g["memory_total_mib"] > 0]
        usable = min(totals) if totals else None
    else:
        peak, util, busy, oom, usable = job.sacct_gpu_mem_mib, job.sacct_gpu_util, None, None, None
    return JobUse(job.job_id, job.user or "?", job.account or "-", job.gpu_type or UNTYPED, job.gpu_count,
                  job.elapsed_s or 0, job.state, job.end_time, peak, util, busy,
                  sub.original_request if sub else None, sub.decision if sub else None, bool(sub and sub.changed),
                  mean, job.partition, oom, usable)
