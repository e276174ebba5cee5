"""Load as a scenario parameter: the arrival rate that keeps a target share of the GPUs allocated.

A policy that moves jobs to idle cards can only gain where jobs wait, so it has to be judged on a
busy cluster as well as a quiet one. The workload generator takes an arrival rate (jobs a day)
and keeps its daily and weekly cycles and array bursts at any rate; how much of the cluster that
rate keeps allocated depends on the jobs drawn and on the users' patience with the queue, so the
rate is calibrated by pilot runs: generate a short pilot period at a rate, replay it with every
request as asked, measure the allocated share, scale the rate by target / measured and try again
(the share rises more slowly than the rate as queues grow and users hold back, so one step is not
enough near saturation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import NamedTuple

from slurmgpu.simulation.scenario import honour, sim_cluster, sim_jobs
from slurmgpu.simulation.simulator import SimResult, simulate
from slurmgpu.simulation.workload import ClusterSpec, generate

WARMUP_S = 86400.0  # the first day of a period: the cluster fills from empty
PILOT_DAYS = 4.0
TOLERANCE = 0.03  # absolute: 0.85 is reached when the pilot measures 0.82 to 0.88
MAX_PILOTS = 5


class Calibration(NamedTuple):
    load: float  # the target share of GPUs allocated
    jobs_per_day: float
    achieved: float  # the share the last pilot measured at that rate
    pilots: tuple[tuple[float, float], ...]  # (rate, measured share) of each pilot


def capacity(cluster: ClusterSpec) -> int:
    return sum(len(pool.hosts) * pool.gpus_per_node for part in cluster.partitions for pool in part.pools)


def window(results: Sequence[SimResult]) -> tuple[float, float]:
    """The measured window of a run: its submissions, less the warm-up day where the period is
    long enough to keep two days (the cluster starts empty; after the last submission it drains)."""
    first, last = min(r.submit_s for r in results), max(r.submit_s for r in results)
    return (first + WARMUP_S if last - first >= 2 * WARMUP_S else first), last


def allocated_share(results: Sequence[SimResult], gpus: int, span: tuple[float, float] | None = None) -> float:
    """GPU-seconds held within SPAN (default: ``window``) over the GPU-seconds the cluster offers."""
    a, b = span or window(results)
    if b <= a:
        return 0.0
    held = sum(r.alloc_gpus * max(0.0, min(r.end_s, b) - max(r.start_s, a)) for r in results)
    return held / (gpus * (b - a))


def pilot_share(cluster: ClusterSpec, start: datetime, days: float, seed: int, jobs_per_day: float) -> float:
    """The allocated share a workload at this rate keeps with every request as asked."""
    jobs = generate(cluster, start, days, seed, jobs_per_day)
    if not jobs:
        return 0.0
    return allocated_share(simulate(sim_jobs(jobs, honour(jobs)), sim_cluster(cluster)), capacity(cluster))


def calibrate(cluster: ClusterSpec, load: float, start: datetime, seed: int, *, days: float = PILOT_DAYS,
              tolerance: float = TOLERANCE, pilots: int = MAX_PILOTS,
              share: Callable[[float], float] | None = None,
              progress: Callable[[str], None] = lambda s: None) -> Calibration:
    """The arrival rate whose pilot keeps LOAD of the GPUs allocated, within TOLERANCE.

    The first guess scales the cluster's own rate by LOAD over the share it gives; the next ones
    interpolate the last two pilots (the share against the log of the rate).
    SHARE(rate) replaces the pilot (tests). Gives the
    closest pilot when none lands within the tolerance (a load the users' patience caps)."""
    if not 0.0 < load < 1.0:
        raise ValueError(f"load {load:g} is not a share of the GPUs between 0 and 1")
    measure = share or (lambda rate: pilot_share(cluster, start, days, seed, rate))
    rate = cluster.jobs_per_day
    tried: list[tuple[float, float]] = []
    for _ in range(pilots):
        got = measure(rate)
        tried.append((rate, got))
        progress(f"load {load:g}: pilot at {rate:,.0f} jobs/day keeps {got:.1%} of the GPUs allocated")
        if abs(got - load) <= tolerance:
            break
        rate = _next_rate(tried, load)
    best_rate, best = min(tried, key=lambda t: abs(t[1] - load))
    return Calibration(load, best_rate, best, tuple(tried))


def _next_rate(tried: Sequence[tuple[float, float]], load: float) -> float:
    """Scale by target / measured after one pilot; after two, the secant through the last two in
    log rate, bounded to a factor of 4 either way."""
    rate, got = tried[-1]
    step = load / max(got, 1e-3)
    if len(tried) >= 2:
        (r0, s0), (r1, s1) = tried[-2], tried[-1]
        if abs(s1 - s0) > 1e-6 and r0 != r1:
            step = math.exp((load - s1) * (math.log(r1) - math.log(r0)) / (s1 - s0))
    return rate * min(max(step, 0.25), 4.0)
