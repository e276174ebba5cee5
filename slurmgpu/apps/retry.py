"""``slurmgpu retry``: a job that ran out of GPU memory is requeued once, onto a card that holds it.

Opt-in per site (``[policy] oom_retry = true``), run by root after the ingest (the nightly, or a
timer every few minutes: slurmctld keeps a finished job for ``MinJobAge`` seconds, and only then can
it be requeued). The job is requeued, not resubmitted: it keeps its id, its user and everything it
asked for but the GPUs, and Slurm counts the requeue (``Restarts``), which is what "never twice"
reads. A job that asked not to be requeued (``--no-requeue``: ``Requeue=0``) is left alone.

The GPU OOM is the collector's finding in the job's stderr (collector/oom.py, stored with the job's
GPU record); the next card is the smallest configured type with more memory than the one it ran out
on that the model, when there is one and it knows the job, predicts to hold it, in a partition whose
Slurm rules admit the job (the job's own first). The user is told in the job's comment when it has
none of its own (``squeue -o %k``, ``sacct -o Comment``), and every action is one log line.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.engine import Engine

from slurmgpu.history.db import GpuUsage, Job, Submission
from slurmgpu.pipeline.config import Config, GpuType
from slurmgpu.pipeline.decision_tag import parse_tag, with_retry_mark

Run = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]
Fits = Callable[[GpuType], bool]
# Finished states a GPU OOM ends in (a rank's OOM can leave the others hanging to the limit).
RETRY_STATES = ("FAILED", "OUT_OF_MEMORY", "TIMEOUT")


class Candidate(NamedTuple):
    job_id: str
    user: str | None
    gpu_type: str
    gpus: int
    framework: str


class Action(NamedTuple):
    job_id: str
    done: bool
    message: str


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


def candidates(engine: Engine, cluster: str, since: datetime) -> list[Candidate]:
    """Jobs that ended since ``since`` with a GPU OOM in their collector record."""
    stmt = (select(Job.job_id, Job.user, Job.gpu_type, Job.gpu_count, GpuUsage.gpu_oom)
            .join(GpuUsage, (GpuUsage.cluster == Job.cluster) & (GpuUsage.job_id == Job.job_id))
            .where(Job.cluster == cluster, GpuUsage.gpu_oom.is_not(None), Job.state.in_(RETRY_STATES),
                   Job.end_time >= since, Job.gpu_type.is_not(None), Job.gpu_count > 0)
            .order_by(Job.end_time))
    with engine.connect() as conn:
        seen: dict[str, Candidate] = {}
        for job_id, user, gpu_type, gpus, framework in conn.execute(stmt):
            seen.setdefault(job_id, Candidate(job_id, user, str(gpu_type), int(gpus), str(framework)))
    return list(seen.values())


def show_job(job_id: str, run: Run) -> dict[str, str] | None:
    """The fields of ``scontrol show job -o`` retry needs (None when slurmctld no longer knows it)."""
    res = run(["scontrol", "show", "job", "-o", job_id])
    if res.returncode != 0 or f"JobId={job_id} " not in res.stdout + " ":
        return None
    fields = {}
    for key in ("JobState", "Requeue", "Restarts", "Partition", "Account", "QOS", "UserId", "Comment",
                "TimeLimit"):
        m = re.search(rf"(?:^|\s){key}=(\S*)", res.stdout)
        if m:
            fields[key] = m.group(1)
    return fields


def next_card(config: Config, gpu_type: str, fits: Fits | None = None) -> GpuType | None:
    """The smallest configured type with more memory than ``gpu_type`` (the faster on a tie) that
    ``fits`` accepts (the model's prediction, when there is one)."""
    ran_on = config.gpu_types.get(gpu_type)
    if ran_on is None:
        return None
    larger = sorted((t for t in config.gpu_types.values() if t.memory_gib > ran_on.memory_gib
                     and config.partitions_with(t.name)), key=lambda t: (t.memory_gib, -t.relative_speed))
    return next((t for t in larger if fits is None or fits(t)), None)


def retry_job(c: Candidate, config: Config, run: Run, partition_ok: Callable[[str, Mapping[str, str]], bool],
              fits: Fits | None = None) -> Action:
    """Requeue one job onto the next card, or say why not."""
    info = show_job(c.job_id, run)
    if info is None:
        return Action(c.job_id, False, "no longer known to slurmctld (older than MinJobAge): not retried")
    if info.get("Requeue") == "0":
        return Action(c.job_id, False, "asked not to be requeued (--no-requeue): not retried")
    if info.get("Restarts", "0") != "0":
        return Action(c.job_id, False, f"already requeued ({info.get('Restarts')}x): never retried twice")
    if info.get("JobState") not in RETRY_STATES:
        return Action(c.job_id, False, f"state {info.get('JobState')}: not retried")
    card = next_card(config, c.gpu_type, fits)
    if card is None:
        return Action(c.job_id, False, f"no configured card holds more than {c.gpu_type}: not retried")
    own = info.get("Partition", "").split(",")[0]
    parts = sorted(config.partitions_with(card.name), key=lambda p: p.name != own)
    part = next((p.name for p in parts if partition_ok(p.name, info)), None)
    if part is None:
        return Action(c.job_id, False, f"no partition with {card.name} admits the job: not retried")
    ran_on = config.gpu_types[c.gpu_type]
    why = (f"GPU out of memory ({c.framework}) on {c.gpu_type} ({ran_on.memory_gib:g} GiB); requeued once on "
           f"{c.gpus} x {card.name} ({card.memory_gib:g} GiB) in partition {part}")
    comment = info.get("Comment", "")
    tag = parse_tag(comment)
    note = with_retry_mark(comment) if tag is not None else f"slurmgpu: {why}" if comment in ("", "(null)") else None
    update = ["scontrol", "update", f"JobId={c.job_id}", f"TresPerNode=gres:gpu:{card.name}:{c.gpus}",
              f"Partition={part}", *([f"Comment={note}"] if note else [])]
    for argv in (["scontrol", "requeuehold", c.job_id], update, ["scontrol", "release", c.job_id]):
        res = run(argv)
        if res.returncode != 0:
            return Action(c.job_id, False, f"{' '.join(argv[:2])} failed ({res.stderr.strip() or res.returncode}); "
                                           "the job may be left held: check it with scontrol show job")
    return Action(c.job_id, True, why)


def retry(engine: Engine, config: Config, cluster: str, since_hours: float = 24.0, run: Run = run_command,
          partition_ok: Callable[[str, Mapping[str, str]], bool] | None = None,
          fits_for: Callable[[Candidate], Fits | None] | None = None,
          now: datetime | None = None) -> list[Action]:
    """Requeue every GPU-OOM job of the last ``since_hours`` that may be retried."""
    from slurmgpu.history.db import utcnow

    since = (now or utcnow()) - timedelta(hours=since_hours)
    ok = partition_ok or (lambda name, info: True)
    return [retry_job(c, config, run, ok, fits_for(c) if fits_for else None)
            for c in candidates(engine, cluster, since)]


def slurm_admits(rules: Mapping[str, Any]) -> Callable[[str, Mapping[str, str]], bool]:
    """A partition check from ``scontrol show partition`` rules (slurm/partitions.py) and the job's
    user, account, QOS and time limit as scontrol shows them."""
    import pwd

    from slurmgpu.slurm.partitions import JobAccess, user_groups
    from slurmgpu.slurm.sacct import ParseError, parse_duration

    def check(name: str, info: Mapping[str, str]) -> bool:
        if name not in rules:
            return False
        m = re.match(r"(\w[\w.-]*)\((\d+)\)", info.get("UserId", ""))
        uid = int(m.group(2)) if m else None
        try:
            user = pwd.getpwuid(uid).pw_name if uid is not None else None
            limit = parse_duration(info.get("TimeLimit", ""), "TimeLimit")
        except (KeyError, ParseError):
            return False
        job = JobAccess(uid=uid, groups=user_groups(user, uid), account=info.get("Account") or None,
                        qos=info.get("QOS") or None, time_limit_min=-(-limit // 60) if limit else None)
        return rules[name].refusal(job) is None

    return check


def model_fits(config: Config, bundle: Any, engine: Engine, cluster: str) -> Callable[[Candidate], Fits | None]:
    """For a job gsbatch recorded: whether the model predicts a card holds it (with the margin)."""
    from slurmgpu.pipeline.features import job_features

    def for_job(c: Candidate) -> Fits | None:
        with engine.connect() as conn:
            row = conn.execute(select(Submission.features, Submission.original_request)
                               .where(Submission.cluster == cluster, Submission.job_id == c.job_id)).first()
        script = (row[0] or {}).get("script") if row else None
        if not script:
            return None
        request = dict(row[1] or {}) if row else {}

        def fits(card: GpuType) -> bool:
            gpu = {"memory_gib": card.memory_gib, "relative_speed": card.relative_speed}
            asked = config.gpu_types.get(c.gpu_type)
            f = job_features(script, {**request, "req_gpu_mem_gib": asked.memory_gib if asked else 0.0}, gpu,
                             c.gpus, bundle.history)
            peak = bundle.predict(f, script).peak_mem_mib
            return peak * (1 + config.policy.memory_margin) <= card.memory_gib * 1024

        return fits

    return for_job
