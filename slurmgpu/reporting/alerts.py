"""Admin alerts: the jobs an admin can do something about, grouped per user and account, each
with the fix to tell the user.

Kinds, from the history store's measurements (collector, else sacct) and submission records:

- ``oversized_type``: the card was far bigger than the job: its per-GPU peak memory (plus the
  policy's memory margin) fits a card with at most half the memory, and mean utilisation stayed low;
- ``idle_gpus``: a multi-GPU job left some of its GPUs idle (per-GPU collector figures);
- ``no_gpu_use``: a job never used any of its GPUs;
- ``gpu_oom``: a GPU OOM as ``collector.oom.ran_out_of_gpu_memory`` defines it (the collector's
  record of a framework's message, else a FAILED job whose peak reached the usable memory NVML
  reported); ``host_oom``: Slurm's OUT_OF_MEMORY, which is the host-memory cgroup;
- ``over_requested``: slurmgpu's model, at submission, predicted that fewer GPUs of the same type
  finish within the policy's scaling factor, but the request was kept (e.g. a launcher that pins
  its process count).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from slurmgpu.collector.oom import HOST_OOM_STATE, OOM_SHARE, ran_out_of_gpu_memory
from slurmgpu.pipeline.config import Config
from slurmgpu.reporting.queries import IDLE_PEAK_MIB, IDLE_UTIL_PCT, UNTYPED, JobUse

LOW_UTIL_PCT = 40.0  # mean utilisation below this: the card's speed is not what the job needs
SMALLER_CARD = 0.5  # "too powerful": the peak fits a card with at most this share of the memory
MIN_IDLE_S = 600  # shorter jobs (tests, crashes at start-up) are not flagged for idle GPUs

KINDS = {
    "gpu_oom": "ran out of GPU memory",
    "host_oom": "killed for host memory (Slurm OUT_OF_MEMORY)",
    "oversized_type": "GPU type too powerful",
    "idle_gpus": "idle GPUs in multi-GPU jobs",
    "no_gpu_use": "never used its GPUs",
    "over_requested": "more GPUs than the model predicts it needs",
}

DEFINITIONS = {
    "oversized_type": f"per-GPU peak memory plus the policy's memory margin fits a card with at most "
                      f"{SMALLER_CARD:.0%} of the memory, and mean GPU utilisation stayed below {LOW_UTIL_PCT:g}%",
    "idle_gpus": f"a job of {MIN_IDLE_S // 60} minutes or more on several GPUs, some of which never reached "
                 f"{IDLE_UTIL_PCT:g}% utilisation (per-GPU collector figures)",
    "no_gpu_use": f"a job of {MIN_IDLE_S // 60} minutes or more whose GPUs stayed below {IDLE_UTIL_PCT:g}% "
                  f"utilisation or {IDLE_PEAK_MIB:g} MiB",
    "gpu_oom": f"the collector found a framework's GPU out-of-memory message in stderr (state not COMPLETED), or "
               f"FAILED with a per-GPU peak of at least {OOM_SHARE:.0%} of the card's usable memory (as NVML reports "
               "it; the config's nominal size without a collector record)",
    "host_oom": f"state {HOST_OOM_STATE}: Slurm's host-memory cgroup killed the job (not the GPU)",
    "over_requested": "the model decider's recorded candidates show fewer GPUs of the same type finishing within "
                      "the policy's scaling factor, and the request was kept",
    "wasted_gpu_hours": "idle GPUs x elapsed (idle_gpus, no_gpu_use, over_requested), the whole job for OOMs; "
                        "0 for oversized_type (the GPUs were used, just bigger than needed)",
}


class JobAlert(NamedTuple):
    job_id: str
    user: str
    account: str
    kind: str
    detail: str
    fix: str
    gpu_hours: float
    wasted_gpu_hours: float


class AlertRow(NamedTuple):
    """One kind of alert for one user and account."""

    user: str
    account: str
    kind: str
    jobs: int
    gpu_hours: float
    wasted_gpu_hours: float
    example_job: str
    detail: str  # the example job's
    fix: str  # the most common fix among the jobs


def _gres(gpu_type: str, gpus: int, config: Config | None, partition: str | None = None,
          moved: bool = True) -> str:
    """'--gres=gpu:t4:1', with a partition when the job moves to a type its own does not offer."""
    out = f"--gres=gpu:{gpu_type}:{gpus}"
    if config is None or not moved:
        return out
    offering = [p.name for p in config.partitions_with(gpu_type)]
    if offering and partition not in offering:
        default = config.default_partition
        out += f" -p {default if default in offering else offering[0]}"
    return out


def _card_mib(config: Config | None, gpu_type: str) -> float | None:
    t = config.gpu_types.get(gpu_type) if config else None
    return t.memory_gib * 1024.0 if t and t.memory_gib > 0 else None


def oom_card_mib(job: JobUse, config: Config | None) -> float | None:
    """The memory a GPU OOM is measured against: what NVML said the job's cards offer, else nominal."""
    return job.usable_mib or _card_mib(config, job.gpu_type)


def gpu_oom(job: JobUse, config: Config | None) -> bool:
    """The job ran out of GPU memory (``collector.oom.ran_out_of_gpu_memory``)."""
    return ran_out_of_gpu_memory(job.state, job.gpu_oom, job.peak_mib, oom_card_mib(job, config))


def smaller_card(job: JobUse, config: Config | None) -> str | None:
    """The smallest (then cheapest) card holding the job's peak plus margin, if it has at most
    SMALLER_CARD of the job's card's memory."""
    card = _card_mib(config, job.gpu_type)
    if config is None or card is None or job.peak_mib is None:
        return None
    need = job.peak_mib * (1 + config.policy.memory_margin)
    fitting = [t for t in config.gpu_types.values()
               if t.memory_gib > 0 and need <= t.memory_gib * 1024.0 <= SMALLER_CARD * card
               and config.partitions_with(t.name) and not t.is_slice]  # a slice needs utilisation evidence
    if not fitting:
        return None
    return min(fitting, key=lambda t: (t.memory_gib, t.cost, t.name)).name


def _bigger_card(job: JobUse, config: Config | None) -> str | None:
    card = _card_mib(config, job.gpu_type)
    if config is None or card is None:
        return None
    bigger = [t for t in config.gpu_types.values()
              if t.memory_gib * 1024.0 > card and config.partitions_with(t.name) and not t.is_slice]
    return min(bigger, key=lambda t: (t.memory_gib, t.cost, t.name)).name if bigger else None


def _fewer_gpus(job: JobUse, config: Config | None) -> tuple[int, float, float] | None:
    """(GPUs, their predicted runtime, the asked count's) from the decider's recorded candidates."""
    per_type = (job.decision or {}).get("per_type") or []
    factor = config.policy.scaling_factor if config else 1.25
    same = [c for c in per_type if c.get("gpu_type") == job.gpu_type and c.get("fits", True)
            and isinstance(c.get("gpus"), int) and isinstance(c.get("pred_runtime_s"), (int, float))]
    asked = next((c for c in same if c["gpus"] == job.gpu_count), None)
    if job.changed or asked is None:
        return None
    fewer = [c for c in same if c["gpus"] < job.gpu_count and c["pred_runtime_s"] <= factor * asked["pred_runtime_s"]]
    if not fewer:
        return None
    best = min(fewer, key=lambda c: c["gpus"])
    return best["gpus"], float(best["pred_runtime_s"]), float(asked["pred_runtime_s"])


def job_alerts(job: JobUse, config: Config | None) -> list[JobAlert]:
    """Every alert one job raises, most serious first."""
    out: list[JobAlert] = []
    hours = job.gpu_hours

    def add(kind: str, detail: str, fix: str, wasted: float) -> None:
        out.append(JobAlert(job.job_id, job.user, job.account, kind, detail, fix, hours, wasted))

    typed = job.gpu_type != UNTYPED
    card = _card_mib(config, job.gpu_type)
    if job.state == HOST_OOM_STATE:
        add("host_oom", "Slurm killed it for host memory (OUT_OF_MEMORY)",
            "ask for more host memory (--mem or --mem-per-cpu); the GPUs were not the limit", hours)
    elif gpu_oom(job, config):
        bigger = _bigger_card(job, config)
        fix = (f"ask for {_gres(bigger, job.gpu_count, config, job.partition)}, or a smaller batch / gradient "
               "checkpointing" if bigger else
               "lower per-GPU memory: a smaller batch, gradient checkpointing, or ZeRO-3/FSDP over more GPUs")
        usable = oom_card_mib(job, config)
        peak = (f"peak {job.peak_mib / 1024:.1f} GiB of the card's {usable / 1024:.1f} GiB"
                if job.peak_mib is not None and usable else "")
        said = f"{job.gpu_oom} reported CUDA out of memory" if job.gpu_oom else ""
        add("gpu_oom", "; ".join(x for x in (said, peak) if x), fix, hours)
    if out or job.elapsed_s <= 0:
        return out
    long_enough = job.elapsed_s >= MIN_IDLE_S
    if long_enough and job.idle:
        add("no_gpu_use", f"{job.gpu_count} GPU(s) for {job.elapsed_s / 3600:.1f} h with no GPU work",
            "run it without --gres=gpu, or check that it sees its GPUs (CUDA_VISIBLE_DEVICES, framework build)", hours)
        return out
    fewer = _fewer_gpus(job, config)
    if fewer is not None and typed:
        gpus, runtime, asked = fewer
        add("over_requested", f"model: {gpus} GPU(s) take {runtime / asked:.2f}x the time of {job.gpu_count}",
            f"use {gpus} GPU(s), not {job.gpu_count} ({_gres(job.gpu_type, gpus, config, moved=False)}; and the "
            "launcher's "
            "process count)", (job.gpu_count - gpus) * job.elapsed_s / 3600.0)
    elif (long_enough and job.gpu_count > 1 and job.gpus_busy is not None and 0 < job.gpus_busy < job.gpu_count):
        idle = job.gpu_count - job.gpus_busy
        fix = f"use {job.gpus_busy} GPU(s), not {job.gpu_count}"
        if typed:
            fix += f" ({_gres(job.gpu_type, job.gpus_busy, config, moved=False)})"
        add("idle_gpus", f"{idle} of {job.gpu_count} GPUs idle", fix, idle * job.elapsed_s / 3600.0)
    smaller = smaller_card(job, config) if typed else None
    if (smaller and job.peak_mib is not None and card and job.mean_util is not None
            and job.mean_util < LOW_UTIL_PCT):
        gpus = job.gpus_busy if job.gpus_busy and out else job.gpu_count
        add("oversized_type", f"peak {job.peak_mib / 1024:.1f} of {card / 1024:.0f} GiB, mean utilisation "
            f"{job.mean_util:.0f}%", f"ask for {_gres(smaller, gpus, config, job.partition)}", 0.0)
    return out


def build(jobs: Iterable[JobUse], config: Config | None) -> list[AlertRow]:
    """Alerts per (user, account, kind), the most wasted GPU-hours first."""
    groups: dict[tuple[str, str, str], list[JobAlert]] = defaultdict(list)
    for job in jobs:
        for alert in job_alerts(job, config):
            groups[(alert.user, alert.account, alert.kind)].append(alert)
    rows = []
    for (user, account, kind), alerts in groups.items():
        example = max(alerts, key=lambda a: (a.wasted_gpu_hours, a.gpu_hours))
        fix = Counter(a.fix for a in alerts).most_common(1)[0][0]
        rows.append(AlertRow(user, account, kind, len(alerts), sum(a.gpu_hours for a in alerts),
                             sum(a.wasted_gpu_hours for a in alerts), example.job_id, example.detail, fix))
    order = list(KINDS)
    return sorted(rows, key=lambda r: (-r.wasted_gpu_hours, -r.gpu_hours, order.index(r.kind), r.user, r.account))


def to_dicts(rows: Sequence[AlertRow]) -> list[dict[str, Any]]:
    return [{**{k: round(v, 4) if isinstance(v, float) else v for k, v in r._asdict().items()},
             "what": KINDS[r.kind]} for r in rows]


def totals(rows: Sequence[AlertRow]) -> Mapping[str, Any]:
    by_kind: dict[str, int] = Counter()
    for r in rows:
        by_kind[r.kind] += r.jobs
    return {"jobs_by_kind": dict(by_kind), "wasted_gpu_hours": round(sum(r.wasted_gpu_hours for r in rows), 4)}
