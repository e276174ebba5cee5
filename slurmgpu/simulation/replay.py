"""Replay a small generated workload on the real local Slurm, then check the simulator against it.

The simulator (``slurmgpu.simulation.simulator``) is only worth its policy comparisons if it schedules as
Slurm does, so the same jobs are run both ways and their starts and ends compared.

- **Workload.** Jobs generated for ``DEFAULT_CLUSTER`` (the local cluster of
  ``contrib/slurmgpu.toml``: one node with a100:4 and v100:4 in partition ``gpu``, t4:4 in
  ``gpu-small``), time-compressed by ``SPEEDUP`` (1 h becomes 10 s): submit times are scaled, a
  job sleeps its modelled runtime on the card it got, scaled and clipped to ``RUN_S``, and its time
  limit is scaled and rounded up to Slurm's whole minutes (no job times out). Array tasks are
  submitted as jobs of their own (no throttle on either side).
- **Submission.** Each job goes through the installed ``gsbatch`` at its compressed submit time,
  with its own ``#SBATCH`` GPU request, partition and job name as the generator wrote them, and one
  CPU, 64 MiB, its scaled limit and a payload instead of the rest. The payload
  (``python -m slurmgpu.simulation.replay payload SPEC``) reads the type it got from ``scontrol show job`` and
  its GPUs from ``SLURM_JOB_GPUS``, sleeps, and writes the record the collector would have written
  (``source = "synthetic"``, as ``workload.emit`` makes them); it exits 1 after its start-up when the
  model says the job runs out of memory on that card.
- **Ingest.** A live ``sacct`` is loaded into a temporary SQLite store (``ingest.ingest_sacct``),
  with the collector and submission spools.
- **Why the workload is chosen.** Slurm's main scheduler starts jobs at submission and at each job
  end in submit order, and stops at a partition's first job that does not fit: the jobs behind it
  wait for the backfill scheduler, which runs every 30 s (``bf_interval``; the local slurm.conf
  keeps the default). The simulator backfills at once and keeps GPU types apart (a100 and v100
  share partition ``gpu``); it does not model CPUs (the node has 8, one per job here). So
  ``select_workload`` takes the first seed whose workload has 20-30 jobs, at least 3 of which
  wait, on which the simulator starts each partition's jobs in submit order (FIFO decides, with the
  runtimes as planned and 1 s longer, the payload's overhead) and never runs more than 8 at once.
- **Validation.** The simulator gets each job's submit time, elapsed time and limit as sacct
  recorded them, on ``SimCluster.from_config`` of the sample config (one node, 4 GPUs of each
  type), so a difference is the scheduler's alone; Slurm's start latency (``SCHED_LATENCY_S``) is
  added on the simulator's side. ``compare_orders`` over (start, end), held to ``TOLERANCE``: no
  pair of jobs in opposite order, where real events at most ``ORDER_RESOLUTION_S`` apart have no
  order (sacct's whole seconds and the 0-2 s start latency cannot order them), Kendall tau at least
  0.95, and starts and ends within 8 s. The latency varies by 0-2 s per start and adds up along a
  chain of jobs waiting for each other's GPUs: two early runs gave 2 s; on a fresh clone, runs of
  the same workload gave 4, 6 and 6 s, and once a pair of ends came out in opposite order. Other jobs on the
  cluster while the replay runs take GPUs and CPUs the simulation does not know of: they are
  listed in ``Replay.foreign``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.script import parse_script
from slurmgpu.simulation.simulator import OrderReport, SimCluster, SimJob, SimResult, compare_orders, simulate
from slurmgpu.simulation.workload import DEFAULT_CLUSTER, JobSpec, fits, generate, run_model, used_gpus
from slurmgpu.simulation.workload.catalog import load_catalog
from slurmgpu.simulation.workload.perf import host_rss_mib, peak_mem_mib

SPEEDUP = 360.0  # 1 h of the workload is 10 s of replay
RUN_S = (2.0, 12.0)  # a replayed job sleeps this long at least and at most
PAYLOAD_OVERHEAD_S = 1.0  # Python start-up, scontrol and the record around the sleep
# slurmctld starts jobs from a loop that runs about once a second: its log shows a job allocated
# 0-2 s after the submission or the end that lets it start; in sacct's whole seconds a start
# follows that event by 1 s most often (measured on the local cluster, Slurm 22.05).
SCHED_LATENCY_S = 1.0
ORDER_RESOLUTION_S = 2.0  # real starts/ends closer than this have no measurable order (see above)
NODE_CPUS = 8  # contrib/local-slurm/cluster.sh: CPUs=8; every replayed job takes one
JOBS = (20, 30)
MIN_WAITING = 3
START = datetime(2026, 11, 2, 9)  # a Monday morning: submissions follow office hours
DAYS, JOBS_PER_DAY = 0.3, 85.0  # ~25 jobs over 7.2 h: 72 s of submissions
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source checkout
SAMPLE_CONFIG = os.path.join(ROOT, "contrib", "slurmgpu.toml")
KEPT_DIRECTIVES = ("job-name", "partition", "gres", "gpus", "gpus-per-node")


class Tolerance(NamedTuple):
    """What the replay may differ by from the simulation of the same jobs."""

    start_discordant: int = 0
    end_discordant: int = 0
    min_tau: float = 0.95
    max_start_diff_s: float = 8.0
    max_end_diff_s: float = 8.0


TOLERANCE = Tolerance()


class ReplayJob(NamedTuple):
    job: JobSpec
    gres: str
    submit_s: float  # compressed, from the first submission
    run_s: float  # compressed runtime on the requested GPUs
    limit_s: int  # the Slurm time limit, whole minutes


class Replay(NamedTuple):
    seed: int
    jobs: list[ReplayJob]
    slurm_ids: dict[str, str]  # workload job id -> Slurm job id
    rows: list[dict[str, Any]]  # the store's rows for the replayed jobs (history.job_rows)
    ingest: str  # the ingest's summary lines
    foreign: list[str]  # other jobs with GPUs that ran while the replay did (they take GPUs and CPUs)
    simulated: list[SimResult]
    report: OrderReport


def compressed(seconds: float) -> float:
    return min(max(seconds / SPEEDUP, RUN_S[0]), RUN_S[1])


def compress(jobs: Sequence[JobSpec]) -> list[ReplayJob]:
    t0 = jobs[0].submit_time
    return [ReplayJob(j, DEFAULT_CLUSTER.gres_name(j.req_gpu_type), (j.submit_time - t0).total_seconds() / SPEEDUP,
                      compressed(run_model(j, j.req_gpu_type, j.req_gpus).runtime_s),
                      60 * max(1, math.ceil(j.time_limit_s / SPEEDUP / 60))) for j in jobs]


def local_cluster() -> SimCluster:
    return SimCluster.from_config(load_config(SAMPLE_CONFIG))


def _sim(jobs: Sequence[ReplayJob], ids: Sequence[str], submit: Sequence[float],
         runs: Sequence[float]) -> list[SimResult]:
    """The simulator's schedule with Slurm's start latency: each job becomes eligible
    ``SCHED_LATENCY_S`` after its submission and holds its GPUs that long after its end, so that a
    start follows the event that allows it by the latency; results give submit, start and end."""
    lat = SCHED_LATENCY_S
    results = simulate([SimJob(i, s + lat, r.gres, r.job.req_gpus, run + lat, r.limit_s + lat, False, r.job.user,
                               r.job.partition) for r, i, s, run in zip(jobs, ids, submit, runs, strict=True)],
                       local_cluster())
    return [r._replace(submit_s=r.submit_s - lat, end_s=r.end_s - lat, wait_s=r.wait_s + lat) for r in results]


def fifo_decides(results: Sequence[SimResult], partitions: Mapping[str, str]) -> bool:
    """Whether every partition's jobs start in submit order (results are in submit order)."""
    last: dict[str, float] = {}
    for r in results:
        part = partitions[r.job_id]
        if r.start_s < last.get(part, -math.inf):
            return False
        last[part] = r.start_s
    return True


def max_running(results: Sequence[SimResult]) -> int:
    events = sorted([(r.end_s, -1) for r in results] + [(r.start_s, 1) for r in results])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def suitable(jobs: Sequence[ReplayJob]) -> bool:
    """20-30 jobs, some waiting, FIFO deciding with planned and overhead-lengthened runtimes, CPUs enough."""
    if not JOBS[0] <= len(jobs) <= JOBS[1]:
        return False
    ids, submit = [r.job.job_id for r in jobs], [r.submit_s for r in jobs]
    partitions = {r.job.job_id: r.job.partition for r in jobs}
    planned, longer = (_sim(jobs, ids, submit, [r.run_s + extra for r in jobs]) for extra in (0.0, PAYLOAD_OVERHEAD_S))
    return (all(fifo_decides(res, partitions) and max_running(res) <= NODE_CPUS for res in (planned, longer))
            and sum(r.wait_s > SCHED_LATENCY_S for r in planned) >= MIN_WAITING)


def select_workload(seed: int = 1, tries: int = 200) -> tuple[int, list[ReplayJob]]:
    """The first seed from ``seed`` on whose workload the simulator's rules and Slurm's coincide."""
    for s in range(seed, seed + tries):
        jobs = compress(generate(DEFAULT_CLUSTER, START, DAYS, s, JOBS_PER_DAY))
        if suitable(jobs):
            return s, jobs
    raise RuntimeError(f"no suitable replay workload among seeds {seed}-{seed + tries - 1}")


# ---- running it on Slurm ------------------------------------------------------------------------

def batch_script(r: ReplayJob, spec: str, out_dir: str) -> str:
    """The job's own GPU request, partition and name; one CPU, little memory, its scaled limit, the payload."""
    kept = [" ".join(w.text for w in d.words) for d in parse_script(r.job.script.encode()).directives
            if d.name in KEPT_DIRECTIVES]
    lines = ["#!/bin/bash", *(f"#SBATCH {k}" for k in kept), "#SBATCH --cpus-per-task=1", "#SBATCH --mem=64M",
             f"#SBATCH --time={r.limit_s // 60}", f"#SBATCH --output={out_dir}/%j.out",
             f"exec {sys.executable} -m slurmgpu.simulation.replay payload {spec}"]
    return "\n".join(lines) + "\n"


def _squeue_empty() -> bool:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    return not out.strip()


def wait_idle(timeout_s: float = 90.0) -> None:
    """Other jobs would take GPUs and CPUs the simulation does not know about."""
    deadline = time.monotonic() + timeout_s
    while not _squeue_empty():
        if time.monotonic() > deadline:
            raise RuntimeError("the local cluster still runs other jobs; the replay needs it to itself")
        time.sleep(2)


def submit_all(jobs: Sequence[ReplayJob], workdir: str, env: Mapping[str, str]) -> dict[str, str]:
    """gsbatch each job at its compressed submit time; returns workload id -> Slurm job id."""
    gsbatch = os.path.join(os.path.dirname(sys.executable), "gsbatch")
    out_dir, spool = os.path.join(workdir, "out"), os.path.join(workdir, "gpu-spool")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(spool, exist_ok=True)
    began, ids = time.monotonic(), {}
    for r in jobs:
        spec = os.path.join(workdir, f"{r.job.job_id}.json")
        with open(spec, "w", encoding="utf-8") as fh:
            json.dump({"job": {**r.job._asdict(), "submit_time": r.job.submit_time.isoformat()}, "spool": spool}, fh)
        script = os.path.join(workdir, f"{r.job.job_id}.sh")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(batch_script(r, spec, out_dir))
        time.sleep(max(0.0, began + r.submit_s - time.monotonic()))
        res = subprocess.run([gsbatch, "--parsable", script], capture_output=True, text=True, cwd=workdir,
                             env=dict(env), check=False, timeout=60)
        if res.returncode != 0:
            raise RuntimeError(f"gsbatch {script} failed ({res.returncode}): {res.stderr.strip()}")
        ids[r.job.job_id] = res.stdout.strip().split(";")[0]
    return ids


def wait_done(slurm_ids: Sequence[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(slurm_ids)], capture_output=True,
                             text=True, check=False).stdout
        if not out.strip():
            time.sleep(2)  # sacct's record of the last end lags squeue a little
            return
        time.sleep(1)
    raise RuntimeError(f"replayed jobs still queued or running after {timeout_s:.0f} s")


def ingest(url: str, since: datetime, workdir: str) -> str:
    """Live sacct, the collector spool and the submission spool into the store at ``url``."""
    from slurmgpu.history import db
    from slurmgpu.history.ingest import ingest_sacct, load_gpu_records, load_submissions

    db.upgrade(url)
    engine = db.make_engine(url)
    report = ingest_sacct(engine, DEFAULT_CLUSTER.name, since=since)
    load_gpu_records(engine, os.path.join(workdir, "gpu-spool"), report)
    load_submissions(engine, os.path.join(workdir, "submissions"), report)
    return report.summary()


def _seconds(iso: str, t0: datetime) -> float:
    return (datetime.fromisoformat(iso.rstrip("Z")) - t0).total_seconds()


def validate(pairs: Sequence[tuple[ReplayJob, Mapping[str, Any]]]) -> tuple[list[SimResult], OrderReport]:
    """Simulate the jobs with the submit and elapsed times sacct recorded; compare the schedules.

    Jobs are named by their zero-padded Slurm id on both sides, so that the simulator's tie-break
    (submit time, then id) is Slurm's (job id order) for jobs submitted within the same second.
    """
    t0 = min(datetime.fromisoformat(row["submit_time"].rstrip("Z")) for _, row in pairs)
    ids = [f"{int(row['job_id']):010d}" for _, row in pairs]
    real = {i: (_seconds(row["start_time"], t0), _seconds(row["end_time"], t0))
            for i, (_, row) in zip(ids, pairs, strict=True)}
    simulated = _sim([r for r, _ in pairs], ids, [_seconds(row["submit_time"], t0) for _, row in pairs],
                     [float(row["elapsed_s"]) for _, row in pairs])
    return simulated, compare_orders(real, simulated, ORDER_RESOLUTION_S)


def problems(report: OrderReport, jobs: int, tolerance: Tolerance = TOLERANCE) -> list[str]:
    """What exceeds the tolerance (empty when the simulator agrees with Slurm)."""
    t = tolerance
    checks = [(report.jobs == jobs and not report.missing, f"{report.jobs} of {jobs} jobs compared, "
                                                           f"missing {list(report.missing)}"),
              (report.start_discordant <= t.start_discordant, f"{report.start_discordant} start-discordant pairs"),
              (report.end_discordant <= t.end_discordant, f"{report.end_discordant} end-discordant pairs"),
              (report.start_tau >= t.min_tau and report.end_tau >= t.min_tau,
               f"Kendall tau {report.start_tau:.3f} (starts), {report.end_tau:.3f} (ends) < {t.min_tau}"),
              (report.max_start_diff_s <= t.max_start_diff_s, f"start differs by {report.max_start_diff_s:.0f} s"),
              (report.max_end_diff_s <= t.max_end_diff_s, f"end differs by {report.max_end_diff_s:.0f} s")]
    return [why for ok, why in checks if not ok]


def replay(workdir: str, seed: int = 1, progress: Callable[[str], None] = lambda s: None) -> Replay:
    """Select, submit, wait, ingest and compare; ``workdir`` holds scripts, logs, spools and the store."""
    from slurmgpu.history.db import make_engine
    from slurmgpu.history.queries import job_rows

    seed, jobs = select_workload(seed)
    progress(f"seed {seed}: {len(jobs)} jobs over {jobs[-1].submit_s:.0f} s")
    # Byte-compile the package first, as an install is: otherwise (PYTHONDONTWRITEBYTECODE, a fresh
    # checkout) every gsbatch and every payload compiles it again, up to 8 at once on this node's
    # CPUs, and slurmctld's start latency grows with the load.
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.dirname(os.path.dirname(__file__))],
                   check=True, stdout=subprocess.DEVNULL)
    wait_idle()
    os.makedirs(os.path.join(workdir, "submissions"), exist_ok=True)
    env = {**os.environ, "SLURMGPU_CONFIG": SAMPLE_CONFIG,
           "SLURMGPU_SUBMISSION_SPOOL": os.path.join(workdir, "submissions")}
    began = datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=5)
    slurm_ids = submit_all(jobs, workdir, env)
    progress("submitted; waiting for the jobs to end")
    wait_done(list(slurm_ids.values()), jobs[-1].submit_s + sum(r.run_s + PAYLOAD_OVERHEAD_S for r in jobs) + 60)
    url = f"sqlite:///{os.path.join(workdir, 'history.db')}"
    summary = ingest(url, began, workdir)
    window = job_rows(make_engine(url), since=began - timedelta(days=1))
    found = {row["job_id"]: row for row in window if row["job_id"] in slurm_ids.values()}
    pairs = [(r, found[slurm_ids[r.job.job_id]]) for r in jobs if slurm_ids[r.job.job_id] in found]
    first = min((row["start_time"] for row in found.values() if row["start_time"]), default="")
    last = max((row["end_time"] for row in found.values() if row["end_time"]), default="")
    foreign = [row["job_id"] for row in window if row["job_id"] not in found and row["gpu_count"]
               and row["start_time"] and row["start_time"] <= last and (row["end_time"] or last) >= first]
    simulated, report = validate(pairs)
    return Replay(seed, jobs, slurm_ids, [row for _, row in pairs], summary, foreign, simulated, report)


def describe(result: Replay) -> str:
    rep = result.report
    waited = sum(r.wait_s > SCHED_LATENCY_S for r in result.simulated)
    shared = f"; {len(result.foreign)} other jobs with GPUs ran meanwhile" if result.foreign else ""
    return (f"replay of {rep.jobs} jobs (seed {result.seed}, {waited} waiting in the simulation{shared}): "
            f"{rep.start_discordant} start- and {rep.end_discordant} end-discordant pairs of {rep.pairs}, "
            f"Kendall tau {rep.start_tau:.3f} (starts) / {rep.end_tau:.3f} (ends), "
            f"max |start diff| {rep.max_start_diff_s:.0f} s, max |end diff| {rep.max_end_diff_s:.0f} s")


# ---- the payload: what runs inside each replayed job ----------------------------------------------

def payload(spec_path: str) -> int:
    """Sleep the job's scaled runtime on the card it got and leave the collector's record."""
    from slurmgpu.collector import records as monitor_records
    from slurmgpu.simulation.workload.emit import spool_record
    from slurmgpu.simulation.workload.schedule import Run

    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    job = JobSpec(**{**spec["job"], "submit_time": datetime.fromisoformat(spec["job"]["submit_time"])})
    job_id = os.environ["SLURM_JOB_ID"]
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    m = re.search(r"gres/gpu:([\w.-]+)=(\d+)", shown)
    if m is None:
        raise RuntimeError(f"job {job_id}: no typed GPU in scontrol's TRES")
    gpu_type = next(p.gpu_type for part in DEFAULT_CLUSTER.partitions for p in part.pools if p.gres == m.group(1))
    gpus = int(m.group(2))
    indices = tuple(int(i) for i in os.environ.get("SLURM_JOB_GPUS", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
                    .split(",") if i.isdigit())
    model = run_model(job, gpu_type, gpus)
    ok = fits(job, gpu_type, gpus)
    modelled = model.runtime_s if ok else model.startup_s + model.step_s  # out of memory at the first step
    start = datetime.now(UTC).replace(tzinfo=None)
    time.sleep(compressed(modelled))
    end = datetime.now(UTC).replace(tzinfo=None)
    peak = peak_mem_mib(job, gpu_type, gpus) if ok else load_catalog().gpu_types[gpu_type].memory_mib
    run = Run(job._replace(job_id=job_id), gpu_type, gpus, os.environ.get("SLURM_JOB_PARTITION", job.partition),
              os.environ.get("SLURMD_NODENAME", "localhost"), indices, start, end, "COMPLETED" if ok else "FAILED",
              0 if ok else 1, used_gpus(job, gpus), peak, model.util(modelled), host_rss_mib(job, gpus))
    monitor_records.write_record(spool_record(run, DEFAULT_CLUSTER), spec["spool"])
    return 0 if ok else 1


def main(argv: Sequence[str]) -> int:
    """``payload SPEC`` inside a job; with no arguments, run the whole replay and print the comparison."""
    if argv[:1] == ["payload"] and len(argv) == 2:
        return payload(argv[1])
    with tempfile.TemporaryDirectory(prefix="slurmgpu-replay-") as workdir:
        result = replay(workdir, progress=lambda s: print(f"replay: {s}", file=sys.stderr))
    print(result.ingest)
    print(describe(result))
    bad = problems(result.report, len(result.jobs))
    for why in bad:
        print(f"replay: outside tolerance: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
