"""Write a synthetic history in the formats the ingest reads, so it takes the real ingest path.

- ``scripts/<job id>.sh``: each job's batch script;
- ``sacct.txt``: ``sacct --parsable2 --noheader`` output in the field order of
  ``slurmgpu.slurm.sacct.FIELDS``, a job line followed by its ``.batch`` step, its ``.extern`` step where
  the cluster contains jobs (PrologFlags=Contain) and a ``.0`` step when the script launches with
  srun; values formatted as the captured Slurm 22.05 output in ``tests/fixtures/sacct`` shows them
  (times in the local zone, as sacct prints them; ``[D-]HH:MM:SS``; TRES strings; ``CANCELLED by
  UID``; ``0:125`` for OUT_OF_MEMORY; a timed-out job's batch step ``CANCELLED 0:15``);
- ``spool/``: one GPU collector record per job, as ``slurmgpu-monitor`` writes it, with
  ``source = "synthetic"``.

The step lines' CPU time, disk bytes and virtual memory are format fillers: slurmgpu reads only
MaxRSS and GPU figures from steps. Output is byte-identical for the same jobs, outcomes and zone.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import NamedTuple

from slurmgpu.collector import records
from slurmgpu.simulation.workload.catalog import load_catalog
from slurmgpu.simulation.workload.cluster import ClusterSpec
from slurmgpu.simulation.workload.jobs import JobSpec
from slurmgpu.simulation.workload.schedule import Outcome, Run, jitter, simulate
from slurmgpu.slurm.sacct import FIELDS, format_duration

SAMPLE_INTERVAL_S = 5.0  # slurmgpu-monitor's default
_SHELL_RSS_KIB = 3208  # a batch shell that only waits on srun (tests/fixtures/sacct, job 1076)
_BATCH_STATE = {"TIMEOUT": "CANCELLED", "CANCELLED": "CANCELLED"}


def _local(t: datetime) -> str:
    return t.replace(tzinfo=UTC).astimezone().strftime("%Y-%m-%dT%H:%M:%S")


def _mem(mb: float) -> str:
    mb = int(mb)
    return f"{mb // 1024}G" if mb % 1024 == 0 else f"{mb}M"


def _tres(run: Run, cluster: ClusterSpec, billing: bool) -> str:
    gres, n, job = cluster.gres_name(run.gpu_type), run.gpus, run.job
    head = f"billing={job.cpus}," if billing else ""
    return f"{head}cpu={job.cpus},gres/gpu:{gres}={n},gres/gpu={n},mem={_mem(job.mem_mb)},node=1"


def _exit(run: Run) -> tuple[str, str]:
    """(job line, steps) exit codes as ``code:signal``."""
    if run.state == "OUT_OF_MEMORY":
        return "0:125", "0:125"
    if run.state in ("TIMEOUT", "CANCELLED"):
        return "0:0", "0:15"
    return f"{run.exit_code}:0", f"{run.exit_code}:0"


def _usage(run: Run, rss_kib: int) -> str:
    disk = int(1e6 + 1e10 * jitter(run.job.job_id, "disk"))
    return (f"cpu={format_duration(run.elapsed_s)},energy=0,fs/disk={disk},mem={rss_kib}K,pages=0,"
            f"vmem={rss_kib * 2 + 5512}K")


def sacct_lines(runs: Sequence[Run], cluster: ClusterSpec) -> Iterator[str]:
    """One ``|``-joined line per job and step, in ``slurmgpu.slurm.sacct.FIELDS`` order."""
    for run in runs:
        job = run.job
        start, end, elapsed = _local(run.start), _local(run.end), format_duration(run.elapsed_s)
        job_exit, step_exit = _exit(run)
        state = f"CANCELLED by {job.uid}" if run.state == "CANCELLED" else run.state
        step_state = _BATCH_STATE.get(run.state, run.state)
        rss_kib = int(run.rss_mib * 1024)
        srun = job.params.get("launcher") == "srun"
        rows = [{
            "JobID": job.job_id, "JobIDRaw": str(job.job_id_raw), "User": job.user, "Partition": run.partition,
            "QOS": "normal", "Submit": _local(job.submit_time), "Eligible": _local(job.submit_time),
            "Timelimit": format_duration(job.time_limit_s), "State": state, "ExitCode": job_exit,
            "ReqTRES": _tres(run, cluster, True), "AllocTRES": _tres(run, cluster, True), "ReqMem": _mem(job.mem_mb),
            "JobName": job.job_name,
        }, {
            "JobID": f"{job.job_id}.batch", "JobIDRaw": f"{job.job_id_raw}.batch", "State": step_state,
            "ExitCode": step_exit, "AllocTRES": _tres(run, cluster, False),
            "MaxRSS": f"{_SHELL_RSS_KIB if srun else rss_kib}K", "JobName": "batch",
            "TRESUsageInMax": _usage(run, _SHELL_RSS_KIB if srun else rss_kib),
        }]
        if cluster.extern_steps:
            rows.append({"JobID": f"{job.job_id}.extern", "JobIDRaw": f"{job.job_id_raw}.extern",
                         "State": "COMPLETED", "ExitCode": "0:0", "AllocTRES": _tres(run, cluster, True),
                         "MaxRSS": "0", "TRESUsageInMax": "cpu=00:00:00,energy=0,fs/disk=5329,mem=0,pages=0,vmem=0",
                         "JobName": "extern"})
        if srun:
            task_kib = rss_kib // job.params["nproc"]
            rows.append({"JobID": f"{job.job_id}.0", "JobIDRaw": f"{job.job_id_raw}.0", "State": step_state,
                         "ExitCode": step_exit, "AllocTRES": _tres(run, cluster, False), "MaxRSS": f"{task_kib}K",
                         "TRESUsageInMax": _usage(run, task_kib), "JobName": "python"})
        for i, row in enumerate(rows):
            common = {"Cluster": cluster.name, "Account": job.account, "Start": start, "End": end,
                      "Elapsed": elapsed, "NNodes": "1", "NCPUS": str(job.cpus), "NodeList": run.host}
            if i:  # steps: submitted and eligible when they start
                common.update(Submit=start, Eligible=start)
            merged = {**common, **row}
            yield "|".join(merged.get(field, "") for field in FIELDS)


def _uuid(cluster: str, host: str, index: int) -> str:
    h = hashlib.sha256(f"{cluster}/{host}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def spool_record(run: Run, cluster: ClusterSpec) -> records.JobRecord:
    """What slurmgpu-monitor would have written for the run: its GPUs' peaks and means."""
    cat = load_catalog()
    spec = cat.gpu_types[run.gpu_type]
    samples = max(1, int(run.elapsed_s // SAMPLE_INTERVAL_S) + 1)
    peak_util = min(100.0, run.gpu_util * cat.value("util_peak_factor"))
    gpus = tuple(
        records.GpuRecord(index, _uuid(cluster.name, run.host, index), spec.nvml_name, spec.memory_mib, mem, mem,
                          util, top, samples)
        for n, index in enumerate(run.gpu_indices)
        for mem, util, top in [(run.peak_mem_mib, run.gpu_util, peak_util) if n < run.used_gpus
                               else (float(cat.value("idle_gpu_mem_mib")), 0.0, 0.0)])
    return records.JobRecord(
        records.SCHEMA_VERSION, "synthetic", cluster.name, run.job.job_id, run.host, run.job.user,
        run.start.replace(tzinfo=UTC), run.end.replace(tzinfo=UTC), SAMPLE_INTERVAL_S, samples, gpus,
        max(g.peak_mem_mib for g in gpus), sum(g.mean_util for g in gpus) / len(gpus), max(g.max_util for g in gpus))


class Emitted(NamedTuple):
    runs: list[Run]  # those written: every job, or those ended by ``until``
    scripts_dir: str
    sacct_path: str
    spool_dir: str


def emit(out_dir: str, jobs: Sequence[JobSpec], cluster: ClusterSpec,
         outcomes: Mapping[str, Outcome] | None = None, until: datetime | None = None) -> Emitted:
    """Simulate ``jobs`` on their outcomes and write scripts/, sacct.txt and spool/ under ``out_dir``.

    With ``until`` (naive UTC), the history is the one an ingest at that moment loads: jobs still
    queued or running then are left out of sacct.txt and spool/ (the collector writes its record
    when a job ends; the next night's ingest would load them), so no job ends after ``until``."""
    runs = [r for r in simulate(jobs, cluster, outcomes) if until is None or r.end <= until]
    scripts, spool = os.path.join(out_dir, "scripts"), os.path.join(out_dir, "spool")
    os.makedirs(scripts, exist_ok=True)
    os.makedirs(spool, exist_ok=True)
    for job in jobs:
        with open(os.path.join(scripts, f"{job.job_id}.sh"), "w", encoding="utf-8") as f:
            f.write(job.script)
    sacct_path = os.path.join(out_dir, "sacct.txt")
    with open(sacct_path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in sacct_lines(runs, cluster))
    for run in runs:
        records.write_record(spool_record(run, cluster), spool)
    return Emitted(runs, scripts, sacct_path, spool)
