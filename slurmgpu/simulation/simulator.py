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


class Queued(NamedTuple):
    """A job in the simulated queue at some moment, as squeue shows it."""

    job: SimJob
    running: bool
    nodes: tuple[int, ...]  # running: indices into SimCluster.node_gpus(job.gpu_type)
    seconds: float  # running: time left to its limit; pending: its time limit


class Simulation:
    """The simulator fed one job at a time, in submit order, for a policy that decides from the
    queue as it stands (``queue``), as slurmgpu's daemon decides from squeue; ``simulate`` is the
    same run with every job known up front."""

    def __init__(self, cluster: SimCluster, *, oom_after_s: float = OOM_AFTER_S,
                 max_job_test: int = BF_MAX_JOB_TEST) -> None:
        self.cluster = cluster
        self._settings = (oom_after_s, max_job_test)
        self._pools: dict[str, _Pool] = {}
        self._jobs: list[SimJob] = []
        self._seen: set[str] = set()

    def submit(self, job: SimJob) -> None:
        """Queue JOB; jobs must come in submit order (ties: in the order they are submitted)."""
        if self._jobs and job.submit_s < self._jobs[-1].submit_s:
            raise ValueError(f"job {job.job_id}: submitted at {job.submit_s} s, before the previous job")
        _check(job, self.cluster, self._seen)
        if job.gpu_type not in self._pools:
            self._pools[job.gpu_type] = _Pool(self.cluster.node_gpus(job.gpu_type), *self._settings)
        self._pools[job.gpu_type].add(job)
        self._jobs.append(job)

    def queue(self, now: float) -> list[Queued]:
        """Running and pending jobs at NOW, everything before NOW simulated (pending in queue order)."""
        out = []
        for pool in self._pools.values():
            pool.advance(now)
            out += pool.snapshot(now)
        return out

    def results(self) -> list[SimResult]:
        """Run every submitted job to its end; results in submit order."""
        done: dict[str, SimResult] = {}
        for gpu_type, pool in self._pools.items():
            pool.advance(math.inf)
            for job, (start, end, state, alloc) in zip(pool.jobs, pool.out, strict=True):
                done[job.job_id] = SimResult(
                    job.job_id, job.submit_s, start, end, state, gpu_type, job.gpus, start - job.submit_s,
                    end - job.submit_s, sum(c for _, c in alloc), tuple(n for n, _ in alloc))
        return [done[j.job_id] for j in self._jobs]


def simulate(jobs: Iterable[SimJob], cluster: SimCluster, *, oom_after_s: float = OOM_AFTER_S,
             max_job_test: int = BF_MAX_JOB_TEST) -> list[SimResult]:
    """Run every job to its end; results are ordered by submit time, then job id."""
    sim = Simulation(cluster, oom_after_s=oom_after_s, max_job_test=max_job_test)
    for job in sorted(jobs, key=lambda j: (j.submit_s, j.job_id)):
        sim.submit(job)
    return sim.results()


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


class _Pool:
    """One GPU type's nodes and queue; jobs are added in queue order (submit time, then as added)."""

    def __init__(self, cap: tuple[int, ...], oom_after_s: float, max_job_test: int) -> None:
        self.cap, self.max_gpn = cap, max(cap)
        self.oom_after_s, self.max_job_test = oom_after_s, max_job_test
        self.jobs: list[SimJob] = []
        self.out: list[tuple[float, float, str, Alloc]] = []  # (start, end, state, allocation) by rank
        self.free = list(cap)
        self.ends: list[tuple[float, int]] = []  # (actual end, queue rank): ties end in queue order
        self.running: dict[int, tuple[float, int, Alloc]] = {}  # rank -> (end by time limit, rank, allocation)
        self.queue: list[int] = []  # pending ranks in queue order
        # The head's reservation: it starts at ``shadow``; ``extra`` is what it leaves over on each
        # node it will take, and ``long_free`` what a job running past ``shadow`` may use now.
        self.shadow = 0.0
        self.extra: dict[int, int] = {}
        self.long_free: list[int] = []
        self.nxt, self.dirty = 0, False  # the first job not yet arrived; whether GPUs came back

    def add(self, job: SimJob) -> None:
        self.jobs.append(job)
        self.out.append((0.0, 0.0, "", []))

    def snapshot(self, now: float) -> list[Queued]:
        running = [Queued(self.jobs[i], True, tuple(n for n, _ in alloc), limit_end - now)
                   for limit_end, i, alloc in sorted(self.running.values(), key=lambda r: r[1])]
        pending = [*self.queue, *range(self.nxt, len(self.jobs))]
        return running + [Queued(self.jobs[i], False, (), self.jobs[i].time_limit_s) for i in pending]

    def start(self, i: int, t: float, alloc: Alloc) -> None:
        for n, c in alloc:
            self.free[n] -= c
        job = self.jobs[i]
        ran, state = (min(job.runtime_s, self.oom_after_s), OUT_OF_MEMORY) if job.oom else (job.runtime_s, COMPLETED)
        if ran > job.time_limit_s:
            ran, state = job.time_limit_s, TIMEOUT
        self.running[i] = (t + job.time_limit_s, i, alloc)
        heapq.heappush(self.ends, (t + ran, i))
        self.out[i] = (t, t + ran, state, alloc)

    def reserve(self, head: int) -> None:
        """Earliest time the head fits if running jobs end at their limits, and where."""
        sim = self.free[:]
        by_limit = sorted(self.running.values())
        k = 0
        while k < len(by_limit):
            self.shadow = by_limit[k][0]
            while k < len(by_limit) and by_limit[k][0] == self.shadow:
                for n, c in by_limit[k][2]:
                    sim[n] += c
                k += 1
            held = _place(self.jobs[head].gpus, sim, self.cap, self.max_gpn)
            if held is not None:
                self.extra = {n: sim[n] - c for n, c in held}
                self.long_free = [min(f, self.extra[n]) if n in self.extra else f for n, f in enumerate(self.free)]
                return
        raise AssertionError("a job that fits the empty pool found no reservation")

    def backfill(self, t: float, lo: int) -> None:
        """Start what fits among queue positions ``lo`` to the test depth without delaying the head."""
        free, long_free, extra, queue = self.free, self.long_free, self.extra, self.queue
        # Placement only gets harder as jobs start, so once a size fails, every larger one of the
        # same kind fails too. fail[2 * multi-node + long]: the smallest size known not to fit.
        fail = [max(free) + 1, max(long_free) + 1, math.inf, math.inf]
        started = []
        for pos in range(lo, min(len(queue), self.max_job_test)):
            if fail[0] == 1:  # not one GPU free
                break
            i = queue[pos]
            g = self.jobs[i].gpus
            long = t + self.jobs[i].time_limit_s > self.shadow
            kind = 2 * (g > self.max_gpn) + long
            if g >= fail[kind]:
                continue
            alloc = _place(g, long_free if long else free, self.cap, self.max_gpn)
            if alloc is None:
                fail[kind] = g
                fail[kind | 1] = min(fail[kind | 1], g)  # what does not fit in free fits no less
                continue
            self.start(i, t, alloc)
            for n, c in alloc:
                if long and n in extra:
                    extra[n] -= c
                long_free[n] = min(free[n], extra[n]) if n in extra else free[n]
            fail[0] = min(fail[0], max(free) + 1)
            fail[1] = min(fail[1], max(long_free) + 1)
            started.append(pos)
        for pos in reversed(started):
            del queue[pos]

    def advance(self, until: float) -> None:
        """Process every arrival and end before UNTIL (math.inf: run to the end)."""
        jobs, ends, queue = self.jobs, self.ends, self.queue
        while self.nxt < len(jobs) or ends:
            t = min(jobs[self.nxt].submit_s if self.nxt < len(jobs) else math.inf, ends[0][0] if ends else math.inf)
            if t >= until:
                return
            while ends and ends[0][0] == t:
                for n, c in self.running.pop(heapq.heappop(ends)[1])[2]:
                    self.free[n] += c
                self.dirty = True
            first_new = len(queue)
            while self.nxt < len(jobs) and jobs[self.nxt].submit_s == t:
                queue.append(self.nxt)
                self.nxt += 1
            if self.dirty or first_new == 0:
                # Resources came back or the queue was empty: FIFO from the head, then a fresh
                # reservation and a backfill pass over the whole test depth.
                self.dirty = False
                k = 0
                while k < len(queue):
                    alloc = _place(jobs[queue[k]].gpus, self.free, self.cap, self.max_gpn)
                    if alloc is None:
                        break
                    self.start(queue[k], t, alloc)
                    k += 1
                del queue[:k]
                if queue:
                    self.reserve(queue[0])
                    self.backfill(t, 1)
            else:
                # Only arrivals: the reservation stands until a job ends, and jobs already tested still
                # cannot start (free GPUs only shrank, time only moved on), so only new ones are tried.
                self.backfill(t, first_new)


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
