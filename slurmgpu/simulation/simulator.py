"""Discrete-event simulation of a heterogeneous GPU cluster under Slurm-like scheduling.

A GPU-allocation policy is judged by what its decisions do to the queue: waits, job completion
times, GPU-hours held, jobs killed for memory. That only shows when thousands of jobs compete for
the same nodes, which cannot be tried on the real cluster, so this module replays the decided jobs
against a model of Slurm's ``sched/backfill``: FIFO by submit time, and EASY backfill in which the
queue head holds a reservation computed from running jobs' time limits (not their true runtimes,
which Slurm does not know). The workload model is not here: jobs arrive already decided.

A job runs only on its decided GPU type, so each type's nodes and queue are simulated on their own.
Results are deterministic: ties are broken by submit time, then job id.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from slurmgpu.pipeline.config import Config

COMPLETED = "COMPLETED"
TIMEOUT = "TIMEOUT"
OUT_OF_MEMORY = "OUT_OF_MEMORY"
OOM_AFTER_S = 60.0
# Slurm's bf_max_job_test default: backfill looks no deeper into the queue than this.
BF_MAX_JOB_TEST = 500


class SimJob(NamedTuple):
    """One job as the policy decided it: this GPU type and count, and what it will then do.

    ``user`` and ``partition`` are for the caller's breakdowns: jobs are placed by GPU type alone.
    """

    job_id: str
    submit_s: float  # seconds from t0
    gpu_type: str
    gpus: int
    runtime_s: float  # true runtime on this type and count
    time_limit_s: float  # what backfill plans with; the job is killed here
    oom: bool = False  # dies out of memory after min(runtime_s, oom_after_s)
    user: str | None = None
    partition: str | None = None


class NodeGroup(NamedTuple):
    gpu_type: str
    nodes: int
    gpus_per_node: int


class SimResult(NamedTuple):
    job_id: str
    submit_s: float
    start_s: float
    end_s: float
    state: str  # COMPLETED, TIMEOUT or OUT_OF_MEMORY
    gpu_type: str
    gpus: int
    wait_s: float
    jct_s: float
    alloc_gpus: int  # GPUs held: ``gpus``, or every GPU of the whole nodes a multi-node job takes
    nodes: tuple[int, ...]  # indices into SimCluster.node_gpus(gpu_type)


class Summary(NamedTuple):
    jobs: int
    mean_jct_s: float
    p50_jct_s: float
    p99_jct_s: float
    mean_wait_s: float
    p50_wait_s: float
    p99_wait_s: float
    makespan_s: float  # first submit to last end
    gpu_hours: float  # allocated, not used
    oom: int
    timeout: int
    failed: int  # every job that did not complete
    utilisation: list[tuple[float, dict[str, int]]]  # allocated GPUs per type from t until the next sample


class Efficiency(NamedTuple):
    mem_used_share: float  # used / allocated GPU memory, weighted by GiB-hours held; nan without data
    idle_gpu_hours: float


class OrderReport(NamedTuple):
    jobs: int  # jobs on both sides
    missing: tuple[str, ...]  # jobs on one side only
    pairs: int
    start_discordant: int
    end_discordant: int
    start_tau: float  # Kendall tau-b; nan when undefined (fewer than two jobs, or all tied)
    end_tau: float
    max_start_diff_s: float
    max_end_diff_s: float


class SimCluster:
    """GPU nodes grouped by type. Nodes of one type form one pool, indexed in group order."""

    def __init__(self, groups: Iterable[tuple[str, int, int]]) -> None:
        self.groups = tuple(NodeGroup(*g) for g in groups)
        for g in self.groups:
            if g.nodes < 1 or g.gpus_per_node < 1:
                raise ValueError(f"node group {g}: nodes and gpus_per_node must be at least 1")
        self._pools: dict[str, tuple[int, ...]] = {}
        for g in self.groups:
            self._pools[g.gpu_type] = self._pools.get(g.gpu_type, ()) + (g.gpus_per_node,) * g.nodes

    def __repr__(self) -> str:
        return f"SimCluster({list(self.groups)!r})"

    @classmethod
    def from_config(cls, config: Config) -> SimCluster:
        """The admin config's partitions as node groups.

        The config does not say which node holds which type, so a partition's nodes are split
        evenly between its types (the first types get the remainder), and a partition with fewer
        nodes than types carries every type on each node, as the local test cluster's one node
        does. Partitions are taken to be disjoint sets of nodes.
        """
        groups = []
        for part in config.partitions.values():
            k = len(part.gpu_types)
            for i, gpu_type in enumerate(part.gpu_types):
                nodes = max(1, part.nodes // k + (i < part.nodes % k))
                groups.append((gpu_type, nodes, part.gpus_per_node))
        return cls(groups)

    @classmethod
    def large(cls) -> SimCluster:
        """A 64-node synthetic cluster for evaluating policies at scale."""
        return cls([("a100", 16, 8), ("v100", 16, 8), ("t4", 32, 4)])

    def gpu_types(self) -> list[str]:
        return list(self._pools)

    def node_gpus(self, gpu_type: str) -> tuple[int, ...]:
        return self._pools[gpu_type]

    def capacity(self, gpu_type: str) -> int:
        return sum(self._pools[gpu_type])


def simulate(jobs: Iterable[SimJob], cluster: SimCluster, *, oom_after_s: float = OOM_AFTER_S,
             max_job_test: int = BF_MAX_JOB_TEST) -> list[SimResult]:
    """Run every job to its end; results are ordered by submit time, then job id."""
    ordered = sorted(jobs, key=lambda j: (j.submit_s, j.job_id))
    by_type: dict[str, list[SimJob]] = {}
    seen: set[str] = set()
    for job in ordered:
        _check(job, cluster, seen)
        by_type.setdefault(job.gpu_type, []).append(job)
    done: dict[str, SimResult] = {}
    for gpu_type, pool_jobs in by_type.items():
        for job, (start, end, state, alloc) in zip(
                pool_jobs, _run_pool(pool_jobs, cluster.node_gpus(gpu_type), oom_after_s, max_job_test),
                strict=True):
            done[job.job_id] = SimResult(
                job.job_id, job.submit_s, start, end, state, gpu_type, job.gpus, start - job.submit_s,
                end - job.submit_s, sum(c for _, c in alloc), tuple(n for n, _ in alloc))
    return [done[j.job_id] for j in ordered]


def _check(job: SimJob, cluster: SimCluster, seen: set[str]) -> None:
    """Refuse a job that could never run, rather than let it wait forever."""
    if job.job_id in seen:
        raise ValueError(f"job {job.job_id}: duplicate job id")
    seen.add(job.job_id)
    if job.gpu_type not in cluster.gpu_types():
        raise ValueError(f"job {job.job_id}: GPU type {job.gpu_type!r} is not in the cluster")
    if not 1 <= job.gpus <= cluster.capacity(job.gpu_type):
        raise ValueError(f"job {job.job_id}: {job.gpus} GPUs, the cluster has "
                         f"{cluster.capacity(job.gpu_type)} {job.gpu_type}")
    if not (job.runtime_s >= 0 and job.time_limit_s > 0 and math.isfinite(job.submit_s)):
        raise ValueError(f"job {job.job_id}: needs a finite submit time, runtime >= 0 and time limit > 0")


Alloc = list[tuple[int, int]]  # (node index, GPUs taken there)


def _place(gpus: int, avail: list[int], cap: Sequence[int], max_gpn: int) -> Alloc | None:
    """Where a job would go given ``avail`` free GPUs per node, or None.

    A job that fits one node takes the fullest node that still fits it (best fit, keeping
    whole nodes free for large jobs); a larger job takes whole free nodes in index order.
    """
    if gpus <= max_gpn:
        best = -1
        for n, a in enumerate(avail):
            if gpus <= a and (best < 0 or a < avail[best]):
                best = n
        return None if best < 0 else [(best, gpus)]
    alloc, got = [], 0
    for n, a in enumerate(avail):
        if a == cap[n]:
            alloc.append((n, a))
            got += a
            if got >= gpus:
                return alloc
    return None


def _run_pool(jobs: list[SimJob], cap: tuple[int, ...], oom_after_s: float,
              max_job_test: int) -> list[tuple[float, float, str, Alloc]]:
    """Simulate one GPU type's nodes; ``jobs`` are in queue order (submit time, job id)."""
    n_jobs, max_gpn = len(jobs), max(cap)
    submit = [j.submit_s for j in jobs]
    gpus = [j.gpus for j in jobs]
    limit = [j.time_limit_s for j in jobs]
    out: list[tuple[float, float, str, Alloc]] = [(0.0, 0.0, "", [])] * n_jobs
    free = list(cap)
    ends: list[tuple[float, int]] = []  # (actual end, queue rank): ties end in queue order
    running: dict[int, tuple[float, int, Alloc]] = {}  # rank -> (end by time limit, rank, allocation)
    queue: list[int] = []  # pending ranks in queue order
    # The head's reservation: it starts at ``shadow``; ``extra`` is what it leaves over on each
    # node it will take, and ``long_free`` what a job running past ``shadow`` may use now.
    shadow = 0.0
    extra: dict[int, int] = {}
    long_free: list[int] = []

    def start(i: int, t: float, alloc: Alloc) -> None:
        for n, c in alloc:
            free[n] -= c
        job = jobs[i]
        ran, state = (min(job.runtime_s, oom_after_s), OUT_OF_MEMORY) if job.oom else (job.runtime_s, COMPLETED)
        if ran > job.time_limit_s:
            ran, state = job.time_limit_s, TIMEOUT
        running[i] = (t + job.time_limit_s, i, alloc)
        heapq.heappush(ends, (t + ran, i))
        out[i] = (t, t + ran, state, alloc)

    def reserve(head: int) -> None:
        """Earliest time the head fits if running jobs end at their limits, and where."""
        nonlocal shadow, extra, long_free
        sim = free[:]
        by_limit = sorted(running.values())
        k = 0
        while k < len(by_limit):
            shadow = by_limit[k][0]
            while k < len(by_limit) and by_limit[k][0] == shadow:
                for n, c in by_limit[k][2]:
                    sim[n] += c
                k += 1
            held = _place(gpus[head], sim, cap, max_gpn)
            if held is not None:
                extra = {n: sim[n] - c for n, c in held}
                long_free = [min(f, extra[n]) if n in extra else f for n, f in enumerate(free)]
                return
        raise AssertionError("a job that fits the empty pool found no reservation")

    def backfill(t: float, lo: int) -> None:
        """Start what fits among queue positions ``lo`` to the test depth without delaying the head."""
        # Placement only gets harder as jobs start, so once a size fails, every larger one of the
        # same kind fails too. fail[2 * multi-node + long]: the smallest size known not to fit.
        fail = [max(free) + 1, max(long_free) + 1, math.inf, math.inf]
        started = []
        for pos in range(lo, min(len(queue), max_job_test)):
            if fail[0] == 1:  # not one GPU free
                break
            i = queue[pos]
            g = gpus[i]
            long = t + limit[i] > shadow
            kind = 2 * (g > max_gpn) + long
            if g >= fail[kind]:
                continue
            alloc = _place(g, long_free if long else free, cap, max_gpn)
            if alloc is None:
                fail[kind] = g
                fail[kind | 1] = min(fail[kind | 1], g)  # what does not fit in free fits no less
                continue
            start(i, t, alloc)
            for n, c in alloc:
                if long and n in extra:
                    extra[n] -= c
                long_free[n] = min(free[n], extra[n]) if n in extra else free[n]
            fail[0] = min(fail[0], max(free) + 1)
            fail[1] = min(fail[1], max(long_free) + 1)
            started.append(pos)
        for pos in reversed(started):
            del queue[pos]

    nxt, dirty = 0, False
    while nxt < n_jobs or ends:
        t = min(submit[nxt] if nxt < n_jobs else math.inf, ends[0][0] if ends else math.inf)
        while ends and ends[0][0] == t:
            for n, c in running.pop(heapq.heappop(ends)[1])[2]:
                free[n] += c
            dirty = True
        first_new = len(queue)
        while nxt < n_jobs and submit[nxt] == t:
            queue.append(nxt)
            nxt += 1
        if dirty or first_new == 0:
            # Resources came back or the queue was empty: FIFO from the head, then a fresh
            # reservation and a backfill pass over the whole test depth.
            dirty = False
            k = 0
            while k < len(queue):
                alloc = _place(gpus[queue[k]], free, cap, max_gpn)
                if alloc is None:
                    break
                start(queue[k], t, alloc)
                k += 1
            del queue[:k]
            if queue:
                reserve(queue[0])
                backfill(t, 1)
        else:
            # Only arrivals: the reservation stands until a job ends, and jobs already tested still
            # cannot start (free GPUs only shrank, time only moved on), so only new ones are tried.
            backfill(t, first_new)
    return out


def summarize(results: Sequence[SimResult]) -> Summary:
    """Queueing and allocation statistics; percentiles interpolate linearly between jobs."""
    if not results:
        raise ValueError("no jobs to summarise")
    jct = np.array([r.jct_s for r in results], dtype=float)
    wait = np.array([r.wait_s for r in results], dtype=float)
    p_jct, p_wait = np.percentile(jct, [50, 99]), np.percentile(wait, [50, 99])
    states = [r.state for r in results]
    return Summary(
        jobs=len(results),
        mean_jct_s=float(jct.mean()), p50_jct_s=float(p_jct[0]), p99_jct_s=float(p_jct[1]),
        mean_wait_s=float(wait.mean()), p50_wait_s=float(p_wait[0]), p99_wait_s=float(p_wait[1]),
        makespan_s=max(r.end_s for r in results) - min(r.submit_s for r in results),
        gpu_hours=sum(r.alloc_gpus * (r.end_s - r.start_s) for r in results) / 3600,
        oom=states.count(OUT_OF_MEMORY), timeout=states.count(TIMEOUT),
        failed=len(states) - states.count(COMPLETED),
        utilisation=utilisation(results),
    )


def utilisation(results: Sequence[SimResult]) -> list[tuple[float, dict[str, int]]]:
    """Allocated GPUs per type after each moment the allocation changes (a step function)."""
    events = sorted([(r.start_s, r.gpu_type, r.alloc_gpus) for r in results]
                    + [(r.end_s, r.gpu_type, -r.alloc_gpus) for r in results], key=lambda e: e[0])
    now = dict.fromkeys((r.gpu_type for r in results), 0)
    samples: list[tuple[float, dict[str, int]]] = []
    k = 0
    while k < len(events):
        t = events[k][0]
        while k < len(events) and events[k][0] == t:
            now[events[k][1]] += events[k][2]
            k += 1
        if not samples or samples[-1][1] != now:
            samples.append((t, dict(now)))
    return samples


def efficiency(results: Iterable[SimResult], used_mem_fraction: Mapping[str, float], idle: Mapping[str, float],
               memory_gib: Mapping[str, float] | None = None) -> Efficiency:
    """How much of what was allocated was used, from per-job measurements the caller supplies.

    ``used_mem_fraction``: share of its GPUs' memory a job used; ``idle``: share of its allocated
    GPU time its GPUs sat idle (a bool counts as all or none). ``memory_gib`` weighs each type's
    GPUs by their memory; without it every GPU weighs the same. A job missing from a mapping is
    left out of that measure.
    """
    used = held = idle_hours = 0.0
    for r in results:
        gpu_hours = r.alloc_gpus * (r.end_s - r.start_s) / 3600
        if r.job_id in used_mem_fraction:
            gib_hours = gpu_hours * (memory_gib[r.gpu_type] if memory_gib is not None else 1.0)
            used += used_mem_fraction[r.job_id] * gib_hours
            held += gib_hours
        if r.job_id in idle:
            idle_hours += float(idle[r.job_id]) * gpu_hours
    return Efficiency(used / held if held else math.nan, idle_hours)


def compare_orders(real: Mapping[str, tuple[float, float]], simulated: Iterable[SimResult],
                   resolution_s: float = 0.0) -> OrderReport:
    """How far the simulator's schedule is from a real replay of the same jobs.

    ``real`` maps job id to (start, end) in seconds from the same t0 as the simulated submit times.
    Discordant pairs are pairs of jobs the two schedules start (or end) in opposite order; ties
    on either side are not discordant, and two real events at most ``resolution_s`` apart are a
    tie (the real clock cannot order them).
    """
    sim = {r.job_id: (r.start_s, r.end_s) for r in simulated}
    common = sorted(real.keys() & sim.keys())
    missing = tuple(sorted(real.keys() ^ sim.keys()))
    a = np.array([real[j] for j in common], dtype=float).reshape(-1, 2)
    b = np.array([sim[j] for j in common], dtype=float).reshape(-1, 2)
    s_disc, s_tau = _kendall(a[:, 0], b[:, 0], resolution_s)
    e_disc, e_tau = _kendall(a[:, 1], b[:, 1], resolution_s)
    diff = np.abs(a - b).max(axis=0) if common else np.zeros(2)
    return OrderReport(len(common), missing, len(common) * (len(common) - 1) // 2, s_disc, e_disc, s_tau, e_tau,
                       float(diff[0]), float(diff[1]))


def _kendall(x: np.ndarray, y: np.ndarray, x_resolution: float = 0.0) -> tuple[int, float]:
    """Discordant pairs and Kendall's tau-b, one row of pairs at a time to keep memory linear;
    x values at most ``x_resolution`` apart count as tied."""
    n = len(x)
    concordant = discordant = tied_x = tied_y = 0
    for i in range(n - 1):
        gap = x[i + 1:] - x[i]
        dx, dy = np.where(np.abs(gap) <= x_resolution, 0.0, np.sign(gap)), np.sign(y[i + 1:] - y[i])
        prod = dx * dy
        concordant += int((prod > 0).sum())
        discordant += int((prod < 0).sum())
        tied_x += int((dx == 0).sum())
        tied_y += int((dy == 0).sum())
    pairs = n * (n - 1) // 2
    denom = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return discordant, (concordant - discordant) / denom if denom else math.nan
