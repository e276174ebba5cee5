"""The GPU usage report: what was allocated, what was used, and what slurmgpu changed.

Numbers come from the history store: jobs with GPUs that ended in the window, the collector's
measurements (else sacct's gres/gpumem and gres/gpuutil) and gsbatch's submission records.
Estimates are named as such in ``DEFINITIONS``, which every output format carries, so that an
admin can tell a measurement from a guess.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime
from typing import Any, NamedTuple

from slurmgpu.collector.oom import HOST_OOM_STATE
from slurmgpu.pipeline.config import Config
from slurmgpu.reporting import alerts
from slurmgpu.reporting.alerts import AlertRow
from slurmgpu.reporting.queries import IDLE_PEAK_MIB, IDLE_UTIL_PCT, JobUse
from slurmgpu.slurm.sacct import format_duration

DEFINITIONS = {
    "window": "jobs with GPUs whose end time falls in [since, until), UTC; running jobs are not counted yet",
    "gpu_hours": "allocated GPUs x elapsed time",
    "measured": "a job is measured when the collector (else sacct's gres/gpumem) recorded its per-GPU peak memory",
    "mem_used_share": "per-GPU peak memory / the card's memory (config gpu_types), capped at 1, "
                      "weighted by GPU-hours over measured jobs",
    "mem_asked_gib / mem_used_gib": "GPU-hour-weighted mean card memory and peak memory per GPU over measured jobs",
    "idle_gpu_hours": f"GPU-hours of jobs whose max GPU utilisation stayed below {IDLE_UTIL_PCT:g}% or whose "
                      f"peak memory stayed below {IDLE_PEAK_MIB:g} MiB (less than a CUDA context)",
    "gpus_asked / gpus_busy": f"over jobs with per-GPU collector figures: GPUs allocated, and those that reached "
                              f"{IDLE_UTIL_PCT:g}% utilisation",
    "ooms": f"jobs that ran out of memory: GPU OOMs (alert gpu_oom) and host-memory kills (state {HOST_OOM_STATE})",
    "gpu_ooms": "jobs that ran out of GPU memory, as alert gpu_oom defines it",
    "changed": "jobs whose gsbatch submission record says slurmgpu changed the request",
    "gpu_hours_saved": "estimate: (GPUs originally requested - GPUs decided) x the job's elapsed time; a change of "
                       "GPU type alone saves none (the run time on the original type is unknown)",
    "queue_hours_saved": "estimate: the decider's expected queue wait for the original request minus that for the "
                         "decision, from the per-type numbers it recorded; empty where it recorded none",
    "advised": "jobs submitted as written in advise mode ([policy] mode, pipeline/modes.py) whose record holds a "
               "change slurmgpu would have made; their GPU-h and queue h are what that change would have saved, "
               "estimated as for changed jobs. Not counted as changed",
    "daily": "GPU-hours by the UTC day the job ended",
    "model": "the installed model version (the registry's active one) and its figures on the jobs held out "
             "(the last --test-days) when it was trained: its decider replayed on them and judged by what the "
             "history measured, the type it picks beside the datasheet's fastest and the users' own (within 5% "
             "of the best measured throughput, mean share of the best, 95% bootstrap intervals), peak-memory "
             "bound under-predicted and its median error, run time median error. Shown to whoever may read the "
             "history database",
    **{f"alert {k}": v for k, v in alerts.DEFINITIONS.items()},
}


class TypeRow(NamedTuple):
    gpu_type: str
    jobs: int
    gpu_hours: float
    measured_gpu_hours: float
    mem_used_share: float | None
    idle_gpu_hours: float
    mem_asked_gib: float | None = None  # as UserRow's: card and peak memory per GPU, GPU-hour weighted
    mem_used_gib: float | None = None


class UserRow(NamedTuple):
    user: str
    account: str
    jobs: int
    gpu_hours: float
    idle_gpu_hours: float
    mem_asked_gib: float | None
    mem_used_gib: float | None
    mem_used_share: float | None
    gpus_asked: int
    gpus_busy: int
    ooms: int
    gpu_ooms: int
    changed: int
    gpu_hours_saved: float
    queue_hours_saved: float | None


class ChangeRow(NamedTuple):
    change: str
    jobs: int
    users: int
    gpu_hours_saved: float
    queue_hours_saved: float | None


class Report(NamedTuple):
    since: datetime
    until: datetime
    user: str | None  # the only user the report covers; None: everyone
    types: list[TypeRow]
    users: list[UserRow]
    changes: list[ChangeRow]
    daily: dict[date, dict[str, float]]  # day -> GPU type -> GPU-hours
    alerts: tuple[AlertRow, ...] = ()  # per user, account and kind; see slurmgpu.reporting.alerts
    advised: tuple[ChangeRow, ...] = ()  # decided in advise mode, submitted as written: what would have changed
    model: Mapping[str, Any] | None = None  # learning.registry.installed: the installed model and its figures

    def totals(self) -> dict[str, Any]:
        gpu_h = sum(t.gpu_hours for t in self.types)
        measured = sum(t.measured_gpu_hours for t in self.types if t.mem_used_share is not None)
        queue = [u.queue_hours_saved for u in self.users if u.queue_hours_saved is not None]
        return {
            "jobs": sum(t.jobs for t in self.types),
            "gpu_hours": gpu_h,
            "idle_gpu_hours": sum(t.idle_gpu_hours for t in self.types),
            "mem_used_share": (sum(t.measured_gpu_hours * (t.mem_used_share or 0.0) for t in self.types) / measured
                               if measured else None),
            "ooms": sum(u.ooms for u in self.users),
            "gpu_ooms": sum(u.gpu_ooms for u in self.users),
            "changed": sum(u.changed for u in self.users),
            "gpu_hours_saved": sum(u.gpu_hours_saved for u in self.users),
            "queue_hours_saved": sum(queue) if queue else None,
            "advised": sum(a.jobs for a in self.advised),
            "advised_gpu_hours": sum(a.gpu_hours_saved for a in self.advised),
            "advised_queue_hours": _sum_optional(a.queue_hours_saved for a in self.advised),
        }


# --- reading the store ------------------------------------------------------------------------


# --- what slurmgpu changed --------------------------------------------------------------------


def describe_change(original: Mapping[str, Any] | None, decision: Mapping[str, Any] | None) -> str:
    """'a100 -> v100; 4 -> 2 GPUs; partition gpu -> gpu-small', from the recorded request and decision."""
    original = original or {}
    comps = original.get("components") or [original]
    parts = []
    for ch in (decision or {}).get("changes") or []:
        index = ch.get("index", 0)
        was = comps[index] if index < len(comps) else {}
        where = f"component {index}: " if index else ""
        if ch.get("gpu_type"):
            parts.append(f"{where}{was.get('gpu_type') or 'any'} -> {ch['gpu_type']}")
        if ch.get("gpus_total"):
            parts.append(f"{where}{was.get('gpus_total')} -> {ch['gpus_total']} GPUs")
        if ch.get("partition"):
            parts.append(f"{where}partition {was.get('partition') or 'default'} -> {ch['partition']}")
        if isinstance(ch.get("time_limit_s"), int) and isinstance(was.get("time_limit_s"), int):
            was_limit, now_limit = (format_duration(x["time_limit_s"]) for x in (was, ch))
            parts.append(f"{where}time limit {was_limit} -> {now_limit}")
    return "; ".join(parts) or "changed"


def _decided(job: JobUse) -> tuple[str | None, int | None, str | None, int | None]:
    """(original type, original GPUs, decided type, decided GPUs) of component 0."""
    original = job.original or {}
    change: dict[str, Any] = next(
        (c for c in (job.decision or {}).get("changes") or [] if c.get("index", 0) == 0), {})
    o_type, o_gpus = original.get("gpu_type"), original.get("gpus_total")
    return o_type, o_gpus, change.get("gpu_type") or o_type, change.get("gpus_total") or o_gpus


def gpu_hours_saved(job: JobUse) -> float:
    """(GPUs originally requested - GPUs decided) x elapsed: see DEFINITIONS['gpu_hours_saved']."""
    _, o_gpus, _, d_gpus = _decided(job)
    if not job.changed or not o_gpus or not d_gpus:
        return 0.0
    return (o_gpus - d_gpus) * job.elapsed_s / 3600.0


def queue_seconds_saved(job: JobUse) -> float | None:
    """The decider's expected wait as asked minus as decided; None without its per-type numbers.

    'As asked' is the candidate the model decider took as its baseline: the requested count of the
    requested type (any type when untyped) with the soonest expected finish.
    """
    per_type = (job.decision or {}).get("per_type") or []
    o_type, o_gpus, d_type, d_gpus = _decided(job)
    if not job.changed or not per_type or o_gpus is None:
        return None
    asked = [c for c in per_type if c.get("gpus") == o_gpus and (o_type is None or c.get("gpu_type") == o_type)]
    chosen = [c for c in per_type if c.get("gpus") == d_gpus and c.get("gpu_type") == d_type]
    if not asked or not chosen:
        return None
    base = min(asked, key=lambda c: c["expected_wait_s"] + c["pred_runtime_s"])
    return float(base["expected_wait_s"] - chosen[0]["expected_wait_s"])


# --- the summaries ----------------------------------------------------------------------------


def advised(job: JobUse) -> bool:
    """Decided in advise mode and submitted as written, with a change that was not applied."""
    decision = job.decision or {}
    return not job.changed and decision.get("advised") is True and bool(decision.get("changes"))


def _advice_rows(jobs: Iterable[JobUse]) -> tuple[ChangeRow, ...]:
    """Advised jobs by the change they would have had, with what it would have saved."""
    by_change: dict[str, list[JobUse]] = defaultdict(list)
    for j in jobs:
        if advised(j):
            by_change[describe_change(j.original, j.decision)].append(j._replace(changed=True))
    rows = [ChangeRow(what, len(group), len({j.user for j in group}), sum(gpu_hours_saved(j) for j in group),
                      _hours(_sum_optional(queue_seconds_saved(j) for j in group)))
            for what, group in by_change.items()]
    return tuple(sorted(rows, key=lambda c: (-c.jobs, c.change)))


def _card_mib(config: Config | None, gpu_type: str) -> float | None:
    t = config.gpu_types.get(gpu_type) if config else None
    return t.memory_gib * 1024.0 if t else None


def _mem(jobs: Iterable[JobUse], config: Config | None) -> tuple[float, float | None, float | None, float | None]:
    """(measured GPU-hours, share used, mean card GiB, mean peak GiB), GPU-hour weighted."""
    hours = share = card = peak = 0.0
    for j in jobs:
        mib = _card_mib(config, j.gpu_type)
        if j.peak_mib is None or mib is None or j.gpu_hours <= 0:
            continue
        hours += j.gpu_hours
        share += j.gpu_hours * min(j.peak_mib / mib, 1.0)
        card += j.gpu_hours * mib / 1024.0
        peak += j.gpu_hours * min(j.peak_mib, mib) / 1024.0
    if not hours:
        return 0.0, None, None, None
    return hours, share / hours, card / hours, peak / hours


def _sum_optional(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _hours(seconds: float | None) -> float | None:
    return None if seconds is None else seconds / 3600.0


def build(jobs: Sequence[JobUse], config: Config | None, since: datetime, until: datetime,
          user: str | None = None, model: Mapping[str, Any] | None = None) -> Report:
    by_type: dict[str, list[JobUse]] = defaultdict(list)
    by_user: dict[tuple[str, str], list[JobUse]] = defaultdict(list)
    by_change: dict[str, list[JobUse]] = defaultdict(list)
    daily: dict[date, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for j in jobs:
        by_type[j.gpu_type].append(j)
        by_user[(j.user, j.account)].append(j)
        if j.changed:
            by_change[describe_change(j.original, j.decision)].append(j)
        daily[j.end_time.date()][j.gpu_type] += j.gpu_hours
    types = []
    for name, group in by_type.items():
        measured, share, asked, used = _mem(group, config)
        types.append(TypeRow(name, len(group), sum(j.gpu_hours for j in group), measured, share,
                             sum(j.gpu_hours for j in group if j.idle), asked, used))
    users = []
    for (name, account), group in by_user.items():
        _, share, asked, used = _mem(group, config)
        detailed = [j for j in group if j.gpus_busy is not None]
        changed = [j for j in group if j.changed]
        users.append(UserRow(name, account, len(group), sum(j.gpu_hours for j in group),
                             sum(j.gpu_hours for j in group if j.idle), asked, used, share,
                             sum(j.gpu_count for j in detailed), sum(j.gpus_busy or 0 for j in detailed),
                             sum(1 for j in group if j.state == HOST_OOM_STATE or alerts.gpu_oom(j, config)),
                             sum(1 for j in group if j.state != HOST_OOM_STATE and alerts.gpu_oom(j, config)),
                             len(changed),
                             sum(gpu_hours_saved(j) for j in changed),
                             _hours(_sum_optional(queue_seconds_saved(j) for j in changed))))
    changes = [ChangeRow(what, len(group), len({j.user for j in group}), sum(gpu_hours_saved(j) for j in group),
                         _hours(_sum_optional(queue_seconds_saved(j) for j in group)))
               for what, group in by_change.items()]
    return Report(since, until, user, sorted(types, key=lambda t: -t.gpu_hours),
                  sorted(users, key=lambda u: (-u.gpu_hours, u.user, u.account)),
                  sorted(changes, key=lambda c: (-c.jobs, c.change)),
                  {d: dict(v) for d, v in sorted(daily.items())}, tuple(alerts.build(jobs, config)),
                  _advice_rows(jobs), model)


# --- output formats ---------------------------------------------------------------------------


# --- the HTML page ----------------------------------------------------------------------------


