"""What happened to each synthetic job: where and when it ran, how it ended, what its GPUs showed.

Jobs are placed in submission order on the earliest-free GPUs of the GPU type they run on
(first come, first served per GPU; no backfill reservations), one node per job. How a job ends
follows from the performance model on the GPUs it got: more memory than the card has fails at
the first step (FAILED, exit 1: PyTorch raises ``torch.cuda.OutOfMemoryError`` and Python exits 1;
Slurm's OUT_OF_MEMORY state is only for the host-memory cgroup, see below); more host memory than
``--mem`` is killed while loading (OUT_OF_MEMORY, exit 0:125); a job with ``fails`` exits 1 and one
with ``cancels`` is cancelled by its owner part-way; whatever is still running at its time limit
ends TIMEOUT; the rest COMPLETED.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from slurmgpu.simulation.workload.catalog import load_catalog
from slurmgpu.simulation.workload.cluster import ClusterSpec, PartitionSpec
from slurmgpu.simulation.workload.jobs import JobSpec
from slurmgpu.simulation.workload.perf import fits, host_rss_mib, peak_mem_mib, run_model, used_gpus


class Outcome(NamedTuple):
    """The GPUs a job ran on (catalog type name and count)."""

    gpu_type: str
    gpus: int


class Run(NamedTuple):
    job: JobSpec
    gpu_type: str
    gpus: int
    partition: str
    host: str
    gpu_indices: tuple[int, ...]
    start: datetime  # naive UTC
    end: datetime
    state: str  # COMPLETED, FAILED, OUT_OF_MEMORY, TIMEOUT or CANCELLED
    exit_code: int  # the program's exit status (0:125 for OUT_OF_MEMORY is exit_code 0, signal 125)
    used_gpus: int
    peak_mem_mib: float  # on each GPU the program used
    gpu_util: float  # mean percent on each GPU the program used
    rss_mib: float

    @property
    def elapsed_s(self) -> int:
        return int((self.end - self.start).total_seconds())


def jitter(job_id: str, salt: str) -> float:
    """A stable number in [0, 1) per job, for details that need no seeded draw of their own."""
    return zlib.crc32(f"{salt}:{job_id}".encode()) / 2**32


def _ending(job: JobSpec, gpu_type: str, gpus: int) -> tuple[str, int, float, float, float]:
    """State, exit code, elapsed seconds, peak GPU memory and mean utilisation on the GPUs used."""
    cat = load_catalog()
    model = run_model(job, gpu_type, gpus)
    if not fits(job, gpu_type, gpus):
        elapsed = model.startup_s + model.step_s
        return "FAILED", 1, elapsed, cat.gpu_types[gpu_type].memory_mib, model.util(elapsed)
    peak = peak_mem_mib(job, gpu_type, gpus)
    if host_rss_mib(job, gpus) > job.mem_mb:
        return "OUT_OF_MEMORY", 0, model.startup_s, cat.value("framework_overhead_gib") * 1024, 0.0
    state, code, elapsed = "COMPLETED", 0, model.runtime_s
    if job.fails:
        state, code, elapsed = "FAILED", 1, elapsed * job.stop_frac
    elif job.cancels:
        state, elapsed = "CANCELLED", elapsed * job.stop_frac
    if elapsed > job.time_limit_s:
        state, code = "TIMEOUT", 0
        elapsed = job.time_limit_s + 2 * cat.value("timeout_overrun_s") * jitter(job.job_id, "timeout")
    return state, code, max(1.0, elapsed), peak, model.util(elapsed)


class Scheduler:
    """The placement ``simulate`` does, one job at a time, so that the workload generator can see
    the queue a user would see before submitting (``start_of``): a job's start depends only on
    the jobs submitted before it."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.latency = timedelta(seconds=load_catalog().value("queue_latency_s"))
        self.free: dict[tuple[str, str], list[datetime]] = {}  # (gpu type, host) -> when each GPU frees up
        self.task_ends: dict[str, list[datetime]] = {}  # array job -> its tasks' ends, for %N throttles

    def _best(self, gpu_type: str, gpus: int, partition: str | None,
              eligible: datetime) -> tuple[datetime, str, list[int], PartitionSpec]:
        part = self.cluster.partition_for(gpu_type, partition)
        pool = self.cluster.pool(gpu_type, part.name)
        if not 0 < gpus <= pool.gpus_per_node:
            raise ValueError(f"{gpus} x {gpu_type} do not fit one node of {part.name}")
        best: tuple[datetime, str, list[int]] | None = None
        for host in pool.hosts:
            slots = self.free.get((gpu_type, host)) or [eligible] * pool.gpus_per_node
            order = sorted(range(len(slots)), key=lambda i: (slots[i], i))[:gpus]
            start = max(eligible, slots[order[-1]])
            if best is None or start < best[0]:
                best = (start, host, order)
        assert best is not None
        return (*best, part)

    def start_of(self, gpu_type: str, gpus: int, when: datetime, partition: str | None = None) -> datetime:
        """When a job of ``gpus`` x ``gpu_type`` submitted at ``when`` would start (nothing is placed)."""
        return self._best(gpu_type, gpus, partition, when + self.latency)[0]

    def place(self, job: JobSpec, outcome: Outcome | None = None) -> Run:
        """Run ``job`` on ``outcome`` (default: what it asked for) after every job placed before it."""
        gpu_type, gpus = outcome or Outcome(job.req_gpu_type, job.req_gpus)
        eligible = job.submit_time + self.latency
        array_id, _, _ = job.job_id.partition("_")
        ends = self.task_ends.setdefault(array_id, [])
        if job.array and "%" in job.array:
            limit = int(job.array.rsplit("%", 1)[1])
            if len(ends) >= limit:
                eligible = max(eligible, sorted(ends)[len(ends) - limit])
        try:
            start, host, order, partition = self._best(gpu_type, gpus, job.partition, eligible)
        except ValueError as exc:
            raise ValueError(f"job {job.job_id}: {exc}") from None
        pool = self.cluster.pool(gpu_type, partition.name)
        state, code, elapsed, peak, util = _ending(job, gpu_type, gpus)
        end = start + timedelta(seconds=round(elapsed))
        slots = self.free.setdefault((gpu_type, host), [eligible] * pool.gpus_per_node)
        for i in order:
            slots[i] = end
        ends.append(end)
        return Run(job, gpu_type, gpus, partition.name, host, tuple(pool.first_index + i for i in sorted(order)),
                   start, end, state, code, used_gpus(job, gpus), peak, util, _rss(job, gpus, state))


def simulate(jobs: Sequence[JobSpec], cluster: ClusterSpec,
             outcomes: Mapping[str, Outcome] | None = None) -> list[Run]:
    """Run every job on its outcome (by job id; the requested GPUs where none is given)."""
    outcomes = outcomes or {}
    scheduler = Scheduler(cluster)
    return [scheduler.place(job, outcomes.get(job.job_id)) for job in sorted(jobs, key=lambda j: j.submit_time)]


def _rss(job: JobSpec, gpus: int, state: str) -> float:
    """Host memory the job reached: all of ``--mem`` when the cgroup killed it."""
    return float(job.mem_mb) if state == "OUT_OF_MEMORY" else host_rss_mib(job, gpus)
