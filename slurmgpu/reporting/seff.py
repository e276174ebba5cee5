"""``slurmgpu seff JOBID``: what ``seff`` says about CPUs and memory, for a job's GPUs.

Per GPU, peak memory against the card (config ``gpu_types``) and utilisation; the GPUs that did
nothing; GPU-hours used and wasted (idle GPUs x elapsed); what was asked and what slurmgpu
decided or would have chosen (the gsbatch submission record); and the alerts the admin report
would raise for it, with their fixes. Every figure that is missing says why.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from slurmgpu.pipeline.config import Config
from slurmgpu.reporting import alerts
from slurmgpu.reporting.queries import IDLE_PEAK_MIB, IDLE_UTIL_PCT, UNTYPED, OneJob, job_use, this_attempt
from slurmgpu.reporting.report import describe_change
from slurmgpu.slurm.sacct import format_duration
from slurmgpu.slurm.usage import HostUse

MIN_SAMPLES = 3  # fewer collector samples than this: utilisation is a guess
MIN_ELAPSED_S = 60  # the collector samples every few seconds; shorter jobs have no reliable mean


class GpuFigure(NamedTuple):
    host: str
    gpu: int  # the GPU's index on its host
    peak_mib: float | None
    mem_share: float | None  # of the card
    mean_util: float | None
    max_util: float | None
    idle: bool


class Seff(NamedTuple):
    job_id: str
    cluster: str
    user: str
    account: str
    partition: str | None
    state: str
    exit_code: int | None
    gpu_type: str | None
    gpu_count: int
    card_gib: float | None
    nodes: str | None
    elapsed_s: int
    time_limit_s: int | None
    source: str | None  # collector | sacct | None
    gpus: list[GpuFigure]
    peak_mib: float | None  # the largest per-GPU peak
    mean_util: float | None  # over all the job's GPUs
    idle_gpus: int | None
    gpu_hours: float
    wasted_gpu_hours: float | None
    asked: str | None
    decision: str | None
    alerts: list[alerts.JobAlert]
    advice: list[str]  # one line per alert with its fix, or why there is none
    missing: list[str]
    host: HostUse | None = None  # CPU and host memory, from Slurm when seff is asked (not in the history)

    def to_dict(self) -> dict[str, Any]:
        out = self._asdict()
        if self.host is not None:
            out["host"] = {**self.host._asdict(), "cpu_efficiency": self.host.cpu_efficiency,
                           "mem_efficiency": self.host.mem_efficiency}
            out["host"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in out["host"].items()}
        out["gpus"] = [{k: round(v, 4) if isinstance(v, float) else v for k, v in g._asdict().items()}
                       for g in self.gpus]
        out["alerts"] = [{"kind": a.kind, "what": alerts.KINDS[a.kind], "detail": a.detail, "fix": a.fix,
                          "wasted_gpu_hours": round(a.wasted_gpu_hours, 4)} for a in self.alerts]
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def _request_text(req: Any) -> str | None:
    if not isinstance(req, dict):
        return None
    gpus, gtype = req.get("gpus_total"), req.get("gpu_type")
    if not gpus:
        return "no GPUs"
    return f"{gpus} x {gtype or 'any'} GPU" + ("s" if gpus != 1 else "") + (
        f" in partition {req['partition']}" if req.get("partition") else "")


def _decision_text(original: Any, decision: Any, applied: bool) -> str | None:
    """What slurmgpu did; ``applied``: the record says the job went in changed (advise mode and
    waivers record the changes slurmgpu would have made, and submit the job as written)."""
    if not isinstance(decision, dict):
        return None
    reasons = decision.get("reasons") or []
    by = f"{decision['decider']} decider" if decision.get("decider") else ""
    why = "; ".join(x for x in (by, reasons[-1] if reasons else "") if x)
    why = f" ({why})" if why else ""
    if decision.get("refused"):
        return f"refused: {decision['refused']}{why}"
    if decision.get("changes") and applied:
        return f"changed it: {describe_change(original, decision)}{why}"
    if decision.get("changes"):
        mode = " (advise mode)" if decision.get("advised") else ""
        return f"advised, not applied{mode}: would have changed {describe_change(original, decision)}; the job ran " \
               f"as written{why}"
    return f"kept the request{why}"


def _advice(found: list[alerts.JobAlert], idle: int | None, gpu_count: int, elapsed: int,
            measured: bool) -> list[str]:
    """The alerts' fixes; without any, why not, so that an idle GPU is never called a fit."""
    if found:
        return [f"{alerts.KINDS[a.kind]}: {a.detail}; {a.fix}" for a in found]
    if not measured:
        return []
    if idle and elapsed < alerts.MIN_IDLE_S:
        return [f"none: {idle} of {gpu_count} GPU(s) sat idle, but the job ran {_duration(elapsed)}, under the "
                f"{alerts.MIN_IDLE_S // 60}-minute floor below which idle GPUs are not flagged (test runs, "
                "crashes at start-up)"]
    return ["none; the GPUs fit the job"]


def build(found: OneJob, config: Config | None) -> Seff:
    job, sub = found.job, found.submission
    hosts, earlier = this_attempt(job, found.hosts)
    missing: list[str] = []
    if earlier:
        missing.append(f"collector figures of an earlier attempt: the job was requeued and sacct describes its latest "
                       f"attempt ({job.state}, " + (f"started {job.start_time:%Y-%m-%d %H:%M:%S} UTC" if job.start_time
                                                    else "not started") +
                       f"); {len(earlier)} host record(s) of an earlier attempt are left out, not mixed with it")
    gtype = job.gpu_type
    card_t = config.gpu_types.get(gtype) if config and gtype else None
    card_mib = card_t.memory_gib * 1024.0 if card_t and card_t.memory_gib > 0 else None
    if job.gpu_count and card_mib is None:
        missing.append(f"card memory: GPU type {gtype or 'unknown'} is not in the config's gpu_types"
                       if config else "card memory: no config (pass --config or set SLURMGPU_CONFIG)")
    elapsed = job.elapsed_s or 0
    gpus: list[GpuFigure] = []
    source: str | None = None
    for h in hosts:
        detail = h.detail if isinstance(h.detail, list) else []
        for g in detail:
            peak = g.get("peak_mem_mib")
            util = g.get("max_util")
            idle = (util is not None and util < IDLE_UTIL_PCT) or (peak is not None and peak < IDLE_PEAK_MIB)
            gpus.append(GpuFigure(h.hostname, int(g.get("index", len(gpus))), peak,
                                  peak / card_mib if peak is not None and card_mib else None,
                                  g.get("mean_util"), util, idle))
    if hosts:
        source = "collector"
        samples = min(h.samples for h in hosts)
        if elapsed < MIN_ELAPSED_S or samples < MIN_SAMPLES:
            missing.append(f"utilisation: the job ran {elapsed} s and the collector took {samples} sample(s): "
                           "too short for reliable figures")
        if not gpus:
            missing.append("per-GPU figures: the collector record has none (idle GPUs cannot be told apart)")
    elif job.sacct_gpu_mem_mib is not None:
        source = "sacct"
        missing.append("per-GPU figures: no collector record, only sacct's job-wide gres/gpumem and gres/gpuutil")
    elif job.gpu_count:
        missing.append("GPU memory and utilisation: no collector record for this job (slurmgpu-monitor not run "
                       "in its prolog/epilog, or not ingested yet) and no sacct GPU figures")
    use = job_use(job, hosts, sub)
    per_gpu_means = [g.mean_util for g in gpus if g.mean_util is not None]
    mean = (sum(per_gpu_means) / len(per_gpu_means) if per_gpu_means and len(per_gpu_means) == len(gpus)
            else use.mean_util)
    idle = sum(g.idle for g in gpus) if gpus else None
    gpu_hours = job.gpu_count * elapsed / 3600.0
    found_alerts = alerts.job_alerts(use, config) if job.gpu_count else []
    if sub is None and job.gpu_count:
        missing.append("decision: no submission record (not submitted with gsbatch, or its record not ingested)")
    return Seff(job.job_id, job.cluster, job.user or "?", job.account or "-", job.partition, job.state,
                job.exit_code, gtype or (UNTYPED if job.gpu_count else None), job.gpu_count,
                card_mib / 1024.0 if card_mib else None, job.node_list, elapsed, job.time_limit_s, source, gpus,
                use.peak_mib, mean, idle, gpu_hours, idle * elapsed / 3600.0 if idle is not None else None,
                _request_text(sub.original_request) if sub else None,
                _decision_text(sub.original_request, sub.decision, bool(sub.changed)) if sub else None,
                found_alerts, _advice(found_alerts, idle, job.gpu_count, elapsed, source is not None), missing)


def _duration(seconds: int | None) -> str:
    return "-" if seconds is None else format_duration(seconds)


def _gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f} GiB"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def host_lines(h: HostUse | None) -> list[str]:
    """seff's own CPU and memory lines (CPU time over CPUs x elapsed; MaxRSS over the memory asked for)."""
    if h is None:
        return []
    so_far = " so far" if h.live else ""
    cpu, mem = h.cpu_efficiency, h.mem_efficiency
    wall = h.cpus * h.elapsed_s if h.cpus and h.elapsed_s else None
    return [
        f"Cores: {h.cpus or '-'}",
        f"CPU Utilized{so_far}: " + (_duration(round(h.total_cpu_s)) if h.total_cpu_s is not None else "-"),
        f"CPU Efficiency{so_far}: " + (f"{cpu:.2%} of {_duration(wall)} core-walltime" if cpu is not None and wall
                                       else "-"),
        f"Memory Utilized{so_far}: " + (_gib(h.max_rss_mib) if h.max_rss_mib is not None else "-"),
        f"Memory Efficiency{so_far}: " + (f"{mem:.2%} of {_gib(h.req_mem_mib)}" if mem is not None else "-"),
    ]


def to_text(s: Seff) -> str:
    """seff's layout: one 'Label: value' line each, then per-GPU lines, advice and what is missing."""
    lines = [f"Job ID: {s.job_id}", f"Cluster: {s.cluster}", f"User/Account: {s.user}/{s.account}",
             f"State: {s.state} (exit code {'-' if s.exit_code is None else s.exit_code})",
             f"Partition: {s.partition or '-'}   Nodes: {s.nodes or '-'}", *host_lines(s.host)]
    if not s.gpu_count:
        lines.append("GPUs: none (this job had no GPUs; `seff` covers its CPUs and memory)")
        return "\n".join(lines + [f"Missing: {m}" for m in s.missing]) + "\n"
    card = f" ({s.card_gib:g} GiB each)" if s.card_gib else ""
    lines += [
        f"GPUs: {s.gpu_count} x {s.gpu_type}{card}",
        f"Elapsed: {_duration(s.elapsed_s)} (time limit {_duration(s.time_limit_s)})",
        f"GPU-hours used: {s.gpu_hours:.2f}",
        "GPU-hours wasted: " + (f"{s.wasted_gpu_hours:.2f} ({s.idle_gpus} idle GPU(s) x {_duration(s.elapsed_s)})"
                                if s.wasted_gpu_hours is not None else "- (no per-GPU figures)"),
        f"GPU utilisation (mean): {_pct(s.mean_util)}",
        "GPU memory (peak per GPU): " + (
            f"{_gib(s.peak_mib)} of {s.card_gib:g} GiB ({s.peak_mib / 1024 / s.card_gib:.1%})"
            if s.peak_mib is not None and s.card_gib else _gib(s.peak_mib)),
        f"Figures from: {s.source or 'nothing recorded'}",
    ]
    if s.gpus:
        lines.append("Per GPU:")
        for g in s.gpus:
            mem = _gib(g.peak_mib) + (f" ({g.mem_share:.0%})" if g.mem_share is not None else "")
            lines.append(f"  {g.host} GPU {g.gpu}: peak {mem}, utilisation mean {_pct(g.mean_util)} "
                         f"max {_pct(g.max_util)}" + ("  IDLE" if g.idle else ""))
    lines.append(f"Asked for: {s.asked or '-'}")
    lines.append(f"slurmgpu: {s.decision or '-'}")
    lines += [f"Advice: {a}" for a in s.advice]
    lines += [f"Missing: {m}" for m in s.missing]
    return "\n".join(lines) + "\n"


def to_json(seffs: Sequence[Seff]) -> str:
    return json.dumps([s.to_dict() for s in seffs], indent=2)
