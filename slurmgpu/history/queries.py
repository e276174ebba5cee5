"""Reading the history back: jobs joined with their best GPU measurement, and the decisions recorded
for them (source, decider, model version, script)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from slurmgpu.history.db import GpuUsage, Job, JobScript, ModelVersion, Submission

T = TypeVar("T")
IDLE_UTIL_PCT = 5.0  # a GPU that never got busier than this did no real work for the job
IDLE_PEAK_MIB = 256.0  # less than a CUDA context takes: the job never opened the GPU


def gpus_busy(details: Sequence[Any], or_opened: bool = False) -> int | None:
    """GPUs that reached IDLE_UTIL_PCT (or, with OR_OPENED, held IDLE_PEAK_MIB: a GPU holding a
    model's shard at low utilisation is still in use), summed over a job's collector rows (their
    per-GPU ``detail``, one row per host); None where a row has no per-GPU figures."""
    if not details or not all(isinstance(d, list) and d for d in details):
        return None
    return sum(1 for d in details for g in d if isinstance(g, dict) and (
        (g.get("max_util") or 0.0) >= IDLE_UTIL_PCT or (or_opened and (g.get("peak_mem_mib") or 0.0) >= IDLE_PEAK_MIB)))


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


def of_job(by_job: Mapping[tuple[str, str], T], cluster: str, job_id: str, raw: int | None) -> T | None:
    """A job's collector entry in BY_JOB, under its id or else its raw id (an array task's, as a
    prolog-started collector may know it)."""
    return by_job.get((cluster, job_id)) or (by_job.get((cluster, str(raw))) if raw is not None else None)


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
        return [_row(j, *(of_job(peaks, j.cluster, j.job_id, j.job_id_raw) or (None, None))) for j in jobs]


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


# --- decision lineage: what was decided, by which source and model version, with what outcome ------------


def _submission_jobs(conn: Any, subs: Sequence[Any]) -> dict[tuple[str, str], list[Any]]:
    """The stored jobs each submission (its cluster and job id as sbatch printed it) stands for: the job
    itself, an array's tasks or a hetjob's components, and only jobs of the submission's user. A
    submission made without a cluster name ("default") matches its job on any cluster."""
    wanted: dict[str | None, set[str]] = {}
    for s in subs:
        if s.job_id is not None:
            wanted.setdefault(None if s.cluster == "default" else s.cluster, set()).add(s.job_id)
    found: dict[tuple[str | None, str], list[Any]] = {}
    cols = (Job.cluster, Job.job_id, Job.user, Job.array_job_id, Job.het_job_id, Job.state, Job.gpu_type,
            Job.gpu_count, Job.elapsed_s, Job.partition, Job.submit_time, Job.job_id_raw, Job.sacct_gpu_mem_mib)
    for cluster, ids in wanted.items():
        ordered = sorted(ids)
        for start in range(0, len(ordered), 300):
            part = ordered[start:start + 300]
            numbers = {int(i): i for i in part if i.isdigit() and len(i) <= 18}
            cond: ColumnElement[bool] = Job.job_id.in_(part)
            if numbers:
                cond = or_(cond, Job.array_job_id.in_(list(numbers)), Job.het_job_id.in_(list(numbers)))
            stmt = select(*cols).where(cond)
            if cluster is not None:
                stmt = stmt.where(Job.cluster == cluster)
            for r in conn.execute(stmt):
                names = {r.job_id} | {numbers[n] for n in (r.array_job_id, r.het_job_id) if n in numbers}
                for name in names & set(part):
                    found.setdefault((cluster, name), []).append(r)
    out: dict[tuple[str, str], list[Any]] = {}
    for s in subs:
        if s.job_id is not None:
            key = (None if s.cluster == "default" else s.cluster, s.job_id)
            out[(s.cluster, s.job_id)] = [j for j in found.get(key, []) if j.user == s.user]
    return out


def script_texts(engine: Engine, since: datetime | None = None) -> dict[tuple[str, str], str]:
    """The batch script text of each stored job, keyed by (cluster, job id) as in ``jobs``, where a
    submission record (gsbatch's, or the Lua hook's once linked) carried it: job_scripts holds each
    text once by sha256. Array tasks and hetjob components get their submission's script. ``since``:
    only submissions made from then on. The newest submission of a job wins."""
    with engine.connect() as conn:
        stmt = (select(Submission.cluster, Submission.job_id, Submission.user, Submission.script_sha256)
                .join(JobScript, JobScript.sha256 == Submission.script_sha256)
                .where(Submission.job_id.isnot(None)).order_by(Submission.submitted_at, Submission.id))
        if since is not None:
            stmt = stmt.where(Submission.submitted_at >= since)
        subs = conn.execute(stmt).all()
        if not subs:
            return {}
        shas = sorted({s.script_sha256 for s in subs})
        texts: dict[str, str] = {}
        for start in range(0, len(shas), 500):
            for digest, text in conn.execute(select(JobScript.sha256, JobScript.text)
                                             .where(JobScript.sha256.in_(shas[start:start + 500]))):
                texts[digest] = text
        jobs = _submission_jobs(conn, subs)
    out: dict[tuple[str, str], str] = {}
    for s in subs:  # oldest first: a newer submission of the same job replaces an older one
        for j in jobs.get((s.cluster, s.job_id), []):
            out[(j.cluster, j.job_id)] = texts[s.script_sha256]
    return out


def decision_rows(engine: Engine, model_version: str | None = None, source: str | None = None,
                  user: str | None = None, since: datetime | None = None, limit: int = 1000) -> list[dict[str, Any]]:
    """Recorded decisions, newest first: where each came from (``source``: gsbatch or lua), the decider
    and the model version (``model_version``: Bundle.digest; ``registered_version``: its number in the
    registry, when registered there), what it changed, the script's hash (``script_stored``: its text
    is in job_scripts) and, once the job is in the accounting, the job's outcome (the job's own row,
    or an array's or hetjob's first). Filters: a model digest (or a prefix of one), a source, a user,
    a time."""
    stmt = (select(Submission.record_id, Submission.submitted_at, Submission.cluster, Submission.job_id,
                   Submission.user, Submission.source, Submission.decider, Submission.model_version,
                   ModelVersion.version.label("registered_version"), Submission.decision_id, Submission.changed,
                   Submission.decision, Submission.original_request, Submission.script_sha256,
                   JobScript.sha256.label("stored_sha"))
            .outerjoin(ModelVersion, ModelVersion.id == Submission.model_version_id)
            .outerjoin(JobScript, JobScript.sha256 == Submission.script_sha256)
            .order_by(Submission.submitted_at.desc(), Submission.id.desc()).limit(limit))
    if model_version:
        stmt = stmt.where(Submission.model_version.startswith(model_version, autoescape=True))
    if source:
        stmt = stmt.where(Submission.source == source)
    if user:
        stmt = stmt.where(Submission.user == user)
    if since:
        stmt = stmt.where(Submission.submitted_at >= since)
    with engine.connect() as conn:
        subs = conn.execute(stmt).all()
        jobs = _submission_jobs(conn, subs)
        wanted: dict[str, set[str]] = {}
        for found in jobs.values():
            for j in found:
                wanted.setdefault(j.cluster, set()).update({j.job_id, str(j.job_id_raw)})
        peaks = gpu_peaks(conn, wanted)
    out = []
    for s in subs:
        found = sorted(jobs.get((s.cluster, s.job_id), []), key=lambda j: j.job_id)
        job = found[0] if found else None
        decision = s.decision if isinstance(s.decision, dict) else {}
        peak = of_job(peaks, job.cluster, job.job_id, job.job_id_raw) if job else None
        out.append({
            "record_id": s.record_id, "submitted_at": _iso(s.submitted_at), "cluster": s.cluster, "job_id": s.job_id,
            "user": s.user, "source": s.source, "decider": s.decider, "model_version": s.model_version,
            "registered_version": s.registered_version, "decision_id": s.decision_id, "changed": s.changed,
            "mode": decision.get("mode", "rewrite"), "changes": decision.get("changes") or [],
            "refused": decision.get("refused"), "request": s.original_request,
            "script_sha256": s.script_sha256, "script_stored": s.stored_sha is not None,
            "jobs": len(found), "state": job.state if job else None, "partition": job.partition if job else None,
            "gpu_type": job.gpu_type if job else None, "gpu_count": job.gpu_count if job else None,
            "elapsed_s": job.elapsed_s if job else None,
            "peak_gpu_mem_mib": (peak[0] if peak else job.sacct_gpu_mem_mib) if job else None,
        })
    return out
