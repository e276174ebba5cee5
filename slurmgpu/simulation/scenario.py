"""Four GPU-allocation policies side by side on one synthetic workload, through the cluster simulator.

A policy can only be judged by what it does to a busy queue, which cannot be tried on a real
cluster, so the same generated jobs are placed by each policy and replayed with
``slurmgpu.simulation.simulator``. Every policy decides once, at submission, from what is known
then; slurmgpu's decider reads the simulated queue as it stands, as it reads squeue live. How each
job then behaves on the GPUs it got comes from the workload model: ``fits`` decides whether it runs
out of GPU memory (it then dies after ``simulate.OOM_AFTER_S``), ``runtime_s`` how long it runs,
and it keeps its requested time limit (a job moved to a slower card may time out).

The policies:

- ``request``: the user's request stands.
- ``rule``: a static rule an admin could write without history: the smallest card by memory
  (the faster one on a tie) that holds ``RULE_SAFETY`` x the analytic estimate of the job's peak
  (``models.analytic_base_mib`` of ``features.script_features``), same count; the requested
  partition first, then any partition that admits the job's time limit. The estimate knows only
  the parameter count, precision and tokens; the factor 1.2 is head-room for what it leaves out
  (allocator slack, fragmentation, CUDA context growth). A job no card holds keeps its request.
- ``slurmgpu``: ``ModelDecider`` with a bundle trained (``train.fit``) on the first
  ``train_share`` of the jobs by submit time, their rows built as ``train.history_rows`` returns
  them from what the collector and sacct would have recorded on the requested GPUs. Only the rest
  is evaluated, under every policy. Its expected wait per type comes from the queue ledger
  (``pipeline/queue.py``) the live daemon builds from squeue, built here from the simulated queue at
  the job's submit time (``squeue``: running jobs hold their GPUs for the time left to their
  limits, pending ones for their limits); true runtimes are never seen. When training is
  impossible it falls back to ``RuleDecider`` and says so.
- ``oracle``: knows each job's true peak memory and runtime, and how many GPUs it truly uses.
  Among the types whose partition admits the time limit, and counts from the process count its
  launcher writes (if any: ``pipeline/launch.py``, the decider's rule) up to the request, that
  truly fit, it picks the one with the earliest estimated completion (a first-come-first-served
  ledger of its own earlier choices with true runtimes), then the lowest runtime x GPUs x cost;
  it prefers candidates that finish within the time limit. A job no card can hold keeps its
  request and runs out of memory under every policy (reported as ``unfittable``).

The decider's config (``scenario_config``) describes the scenario cluster with GPU types named as
in gres.conf, memory from the catalog, and relative speed (16-bit and 32-bit) and cost derived from it
(see ``relative_speed`` and ``relative_cost``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import numpy as np

from slurmgpu.history.queries import IDLE_UTIL_PCT, gpus_busy
from slurmgpu.pipeline.bundle import analytic_base_mib
from slurmgpu.pipeline.config import Config, GpuType, Partition, Policy
from slurmgpu.pipeline.features import script_features
from slurmgpu.pipeline.launch import request_launch_need
from slurmgpu.pipeline.policy import Admits, Decider, ModelDecider, RuleDecider
from slurmgpu.pipeline.queue import GpuLedger
from slurmgpu.pipeline.request import ComponentRequest, JobRequest, build_request
from slurmgpu.pipeline.script import parse_script
from slurmgpu.simulation.simulator import (
    Efficiency,
    Queued,
    SimCluster,
    SimJob,
    SimResult,
    Simulation,
    Summary,
    efficiency,
    simulate,
    summarize,
)
from slurmgpu.simulation.workload import (
    LARGE_CLUSTER,
    ClusterSpec,
    JobSpec,
    fits,
    generate,
    load_catalog,
    run_model,
)
from slurmgpu.simulation.workload.catalog import relative_cost, relative_speed
from slurmgpu.simulation.workload.emit import spool_record
from slurmgpu.simulation.workload.perf import peak_mem_mib, runtime_s, used_gpus
from slurmgpu.simulation.workload.schedule import Outcome, Run
from slurmgpu.simulation.workload.schedule import simulate as history_runs
from slurmgpu.slurm.backend import QueuedJob

RULE_SAFETY = 1.2
USED_STATES = ("COMPLETED", "OUT_OF_MEMORY", "TIMEOUT", "FAILED")  # as train.history_rows keeps them


class Scenario(NamedTuple):
    name: str
    cluster: ClusterSpec
    jobs: int  # about this many are generated, at the arrival rate over the days it takes
    seed: int = 1
    start: datetime = datetime(2026, 11, 2)
    train_share: float = 0.3
    iterations: int = 400  # CatBoost iterations per model
    jobs_per_day: float | None = None  # the arrival rate (default: the cluster's); simulation/load.py calibrates it
    load: float | None = None  # the share of GPUs the rate was calibrated to keep allocated, if it was

    @property
    def rate(self) -> float:
        return self.jobs_per_day or self.cluster.jobs_per_day

    @property
    def days(self) -> float:
        return self.jobs / self.rate


SCENARIOS = {
    "default": Scenario("default", LARGE_CLUSTER, 50_000),
    "small": Scenario("small", LARGE_CLUSTER, 2_000, iterations=100),
}
POLICIES = {"request": "honour request", "rule": "static rule", "slurmgpu": "slurmgpu decider", "oracle": "oracle"}


class PolicyResult(NamedTuple):
    name: str
    placed: dict[str, Outcome]
    note: str
    results: list[SimResult]
    summary: Summary
    efficiency: Efficiency


class Evaluation(NamedTuple):
    scenario: Scenario
    generated: int
    train_jobs: int
    jobs: list[JobSpec]  # the evaluated ones
    decider: str  # "model", or "rules (fallback: why)"
    unfittable: int  # jobs no card in the cluster can hold
    config: Config
    policies: list[PolicyResult]
    seconds: float

    @property
    def evaluated(self) -> int:
        return len(self.jobs)


# ---- the decider's view of the cluster --------------------------------------------------------


def scenario_config(cluster: ClusterSpec) -> Config:
    """The admin config for ``cluster``. A partition's ``gpus_per_node`` is its largest pool's
    (the config has one number per partition); a decision that exceeds a node of its type is
    caught where decisions are mapped to placements."""
    cat = load_catalog()
    types = {}
    for part in cluster.partitions:
        for pool in part.pools:
            spec = cat.gpu_types[pool.gpu_type]
            types[pool.gres] = GpuType(pool.gres, spec.memory_gib, round(relative_speed(spec), 3),
                                       round(relative_cost(spec), 3), fp32_speed=round(relative_speed(spec, "fp32"), 3))
    parts = {p.name: Partition(p.name, tuple(pool.gres for pool in p.pools),
                               max(pool.gpus_per_node for pool in p.pools),
                               len({h for pool in p.pools for h in pool.hosts}), p.default)
             for p in cluster.partitions}
    # The scenario measures time to result: the objective that weighs nothing else. Measured
    # against "balanced" (half the weight on GPU-hours x the types' cost) on seeds 7 and 1: mean JCT
    # 2.04 vs 2.07 h and 2.04 vs 2.03 h, failed 187 vs 244 and 194 vs 208, GPU-hours 132k vs 131k
    # and 108k vs 114k (cheaper, slower cards hold jobs longer).
    return Config(f"<scenario {cluster.name}>", types, parts,
                  Policy(decider="model", objective="fastest", move_partitions=True, lengthen_time_limit=True))


def partition_admits(cluster: ClusterSpec) -> Admits:
    """Slurm's answer for a job in a partition of ``cluster``: its MaxTime must admit the job's
    time limit (a job without one would get the partition's default: not moved)."""
    max_time = {p.name: p.max_time_s for p in cluster.partitions}

    def admits(name: str, comp: ComponentRequest) -> str | None:
        if name not in max_time:
            return f"no partition {name}"
        if not comp.time_limit_s or comp.time_limit_s > max_time[name]:
            return f"partition {name}'s MaxTime does not admit the job's time limit"
        return None

    return admits


def sim_cluster(cluster: ClusterSpec) -> SimCluster:
    return SimCluster((pool.gpu_type, len(pool.hosts), pool.gpus_per_node)
                      for part in cluster.partitions for pool in part.pools)


def _admits(cluster: ClusterSpec, job: JobSpec, gpu_type: str, gpus: int) -> bool:
    """Whether Slurm would run ``job`` on ``gpus`` x ``gpu_type``: one node holds them and the
    partition's time limit admits the job's (a longer one stays pending for ever)."""
    part = cluster.partition_for(gpu_type, job.partition)
    return gpus <= cluster.pool(gpu_type, part.name).gpus_per_node and job.time_limit_s <= part.max_time_s


def _memory_mib(gpu_type: str) -> float:
    return load_catalog().gpu_types[gpu_type].memory_mib


# ---- policies -----------------------------------------------------------------------------------

def honour(jobs: Iterable[JobSpec]) -> dict[str, Outcome]:
    return {j.job_id: Outcome(j.req_gpu_type, j.req_gpus) for j in jobs}


def rule_estimate_mib(job: JobSpec, features: Mapping[str, Any]) -> float:
    """The static rule's per-GPU need: the analytic estimate times the safety factor."""
    return RULE_SAFETY * analytic_base_mib({**features, "gpus": float(job.req_gpus)})


def static_rule(jobs: Iterable[JobSpec], cluster: ClusterSpec,
                features: Mapping[str, Mapping[str, Any]]) -> dict[str, Outcome]:
    """Smallest card holding the estimate, requested partition first; see the module docstring."""
    cat = load_catalog()

    def order(types: Iterable[str]) -> list[str]:
        return sorted(types, key=lambda t: (cat.gpu_types[t].memory_gib, -relative_speed(cat.gpu_types[t])))

    placed = {}
    for job in jobs:
        need = rule_estimate_mib(job, features[job.script])
        own = order(pool.gpu_type for pool in cluster.partition_for(job.req_gpu_type, job.partition).pools)
        rest = order(t for t in cluster.gpu_types() if t not in own)
        choice = next((t for t in own + rest if _memory_mib(t) >= need and _admits(cluster, job, t, job.req_gpus)),
                      job.req_gpu_type)
        placed[job.job_id] = Outcome(choice, job.req_gpus)
    return placed


def training_rows(jobs: Sequence[JobSpec], cluster: ClusterSpec, features: Mapping[str, Mapping[str, Any]],
                  requests: Mapping[str, JobRequest]) -> list[dict[str, Any]]:
    """Rows as ``train.history_rows`` returns them, from the jobs' runs on the GPUs they asked for:
    state and elapsed as sacct would show them, the per-GPU peak and the GPUs kept busy as the
    collector would."""
    def busy(r: Run) -> int | None:
        return gpus_busy([[g._asdict() for g in spool_record(r, cluster).gpus]], or_opened=True)

    return [{"job_id": r.job.job_id, "user": r.job.user, "submit": r.job.submit_time, "state": r.state, "end": r.end,
             "gpu_type": cluster.gres_name(r.gpu_type), "gpus": r.gpus, "elapsed": r.elapsed_s,
             "peak": r.peak_mem_mib, "gpus_used": busy(r), "script": features[r.job.script],
             "request": requests[r.job.script].to_json()}
            for r in history_runs(jobs, cluster) if r.state in USED_STATES]


def squeue(cluster: ClusterSpec, queue: Iterable[Queued]) -> list[QueuedJob]:
    """The simulated queue as the Slurm backend reads squeue: GPU types by their gres names, nodes
    by host name, a running job's time left to its limit, a pending one's limit."""
    gres = {pool.gpu_type: pool.gres for part in cluster.partitions for pool in part.pools}
    hosts: dict[str, list[str]] = {}
    for part in cluster.partitions:  # in sim_cluster's order: a pool's node indices
        for pool in part.pools:
            hosts.setdefault(pool.gpu_type, []).extend(pool.hosts)
    return [QueuedJob(q.job.job_id, q.running, tuple(hosts[q.job.gpu_type][n] for n in q.nodes), q.seconds,
                      {gres[q.job.gpu_type]: q.job.gpus}, max(len(q.nodes), 1), q.job.partition or "")
            for q in queue]


def model_decisions(train: Sequence[JobSpec], jobs: Sequence[JobSpec], cluster: ClusterSpec, config: Config,
                    features: Mapping[str, Mapping[str, Any]], requests: Mapping[str, JobRequest],
                    iterations: int, progress: Callable[[str], None],
                    sim: Simulation) -> tuple[dict[str, Outcome], str, str]:
    """Placements by slurmgpu's decider, which decider made them, and a note on what it changed.
    Each job is submitted to SIM as placed, in submit order, so a later decision reads the queue
    that earlier ones made (``squeue``)."""
    from slurmgpu.learning.train import fit

    capacity: dict[str, int] = {}
    for part in cluster.partitions:
        for pool in part.pools:
            capacity[pool.gres] = capacity.get(pool.gres, 0) + len(pool.hosts) * pool.gpus_per_node
    deciders: dict[str, Decider] = {}
    nodes = cluster.slurm_nodes()
    t0 = jobs[0].submit_time if jobs else datetime(1970, 1, 1)
    now = [0.0, -1.0]  # the submit time being decided (s from t0), and the jobs submitted when its ledger was read
    ledger = [GpuLedger({})]

    def wait(gpu_type: str, gpus: int, *, tasks: int = 1, runtime_s: float = 0.0, at_once: int = 0) -> float:
        if now[1] != len(placed):  # squeue is read once per decision
            ledger[0] = GpuLedger.from_queue(nodes, squeue(cluster, sim.queue(now[0])))
            now[1] = len(placed)
        return ledger[0].wait(gpu_type, gpus, tasks=tasks, runtime_s=runtime_s, at_once=at_once)

    try:
        bundle, _ = fit(training_rows(train, cluster, features, requests), config, iterations=iterations,
                        progress=progress)
        used = "model"

        def decider(user: str) -> Decider:
            return ModelDecider(config, bundle, lambda: capacity, user, partition_admits(cluster), wait=wait)
    except (ValueError, ImportError) as exc:
        used = f"rules (fallback: {exc})"
        progress(f"cannot train the model decider ({exc}); falling back to the rule decider")

        def decider(user: str) -> Decider:
            return RuleDecider(config)

    to_type = {pool.gres: pool.gpu_type for part in cluster.partitions for pool in part.pools}
    decided: dict[str, Outcome] = {}  # by submission: an array's tasks ("<id>_<task>") are one decision
    limits: dict[str, int | None] = {}  # by submission: the longer time limit its move took
    placed: dict[str, Outcome] = {}
    changed, infeasible = 0, 0
    for job in sorted(jobs, key=lambda j: (j.submit_time, j.job_id)):  # simulate's queue order
        key = job.job_id.partition("_")[0]
        now[0] = (job.submit_time - t0).total_seconds()
        if key not in decided:
            choice = Outcome(job.req_gpu_type, job.req_gpus)
            if job.user not in deciders:
                deciders[job.user] = decider(job.user)
            decision = deciders[job.user].decide(requests[job.script])
            if decision.changes and not decision.refusal:
                change = decision.changes[0]
                gres = change.gpu_type or cluster.gres_name(job.req_gpu_type)
                new = Outcome(to_type[gres], change.gpus_total or job.req_gpus)
                limited = job if change.time_limit_s is None else job._replace(time_limit_s=change.time_limit_s)
                if _admits(cluster, limited, *new):  # a move to a slower card may take a longer limit
                    choice = new
                    limits[key] = change.time_limit_s
                else:
                    infeasible += 1
            decided[key] = choice
        placed[job.job_id] = decided[key]
        limit = limits.get(key)
        sim.submit(sim_job(job if limit is None else job._replace(time_limit_s=limit), t0, decided[key]))
        changed += placed[job.job_id] != (job.req_gpu_type, job.req_gpus)
    note = f"{used}; changed {changed:,} of {len(jobs):,} jobs"
    return placed, used, note + (f"; {infeasible} decisions beyond a node kept as asked" if infeasible else "")


def oracle(jobs: Sequence[JobSpec], cluster: ClusterSpec, cost: Mapping[str, float],
           requests: Mapping[str, JobRequest]) -> dict[str, Outcome]:
    """Earliest estimated completion among truly fitting placements; see the module docstring.
    REQUESTS: each script's parsed request, for the process count its launcher writes."""
    t0 = jobs[0].submit_time
    free = {pool.gpu_type: np.zeros((len(pool.hosts), pool.gpus_per_node))
            for part in cluster.partitions for pool in part.pools}
    placed = {}
    for job in jobs:
        submit = (job.submit_time - t0).total_seconds()
        best: tuple[tuple[bool, float, float], str, int, int] | None = None
        # It knows how many GPUs a job really uses, but not a way round a count its launcher writes
        # (torchrun --nproc_per_node=4 on 3 GPUs starts 4 processes on 3 cards).
        fewest = request_launch_need(requests[job.script]).min_gpus or 1
        counts = range(min(fewest, job.req_gpus), min(job.req_gpus, job.params["nproc"]) + 1)
        peaks = {k: peak_mem_mib(job, job.req_gpu_type, k) for k in counts}
        for gpu_type, slots in free.items():
            ready_by_k = np.sort(slots, axis=1)  # column k-1: when k GPUs of each node are free
            for k, peak in peaks.items():  # the same tensors on any card
                if peak > _memory_mib(gpu_type) or not _admits(cluster, job, gpu_type, k):
                    continue
                ready = ready_by_k[:, k - 1]
                host = int(ready.argmin())
                run = runtime_s(job, gpu_type, k)
                score = (run > job.time_limit_s, max(submit, float(ready[host])) + run, run * k * cost[gpu_type])
                if best is None or score < best[0]:
                    best = (score, gpu_type, k, host)
        if best is None:
            placed[job.job_id] = Outcome(job.req_gpu_type, job.req_gpus)
            continue
        (_, end, _), gpu_type, k, host = best
        row = free[gpu_type][host]
        row[np.argsort(row)[:k]] = end
        placed[job.job_id] = Outcome(gpu_type, k)
    return placed


def fits_somewhere(job: JobSpec, cluster: ClusterSpec) -> bool:
    biggest = max(_memory_mib(t) for t in cluster.gpu_types())
    return any(peak_mem_mib(job, job.req_gpu_type, k) <= biggest for k in range(1, job.req_gpus + 1))


# ---- simulation and measures ------------------------------------------------------------------

def sim_job(job: JobSpec, t0: datetime, placed: Outcome) -> SimJob:
    """The job as placed, with what the workload model says it then does; T0 is time zero."""
    gpu_type, gpus = placed
    return SimJob(job.job_id, (job.submit_time - t0).total_seconds(), gpu_type, gpus, runtime_s(job, gpu_type, gpus),
                  float(job.time_limit_s), not fits(job, gpu_type, gpus), job.user, job.partition)


def sim_jobs(jobs: Sequence[JobSpec], placed: Mapping[str, Outcome]) -> list[SimJob]:
    """The jobs as placed; t0 is the first submit."""
    return [sim_job(job, jobs[0].submit_time, placed[job.job_id]) for job in jobs]


def measure(jobs: Sequence[JobSpec], results: Sequence[SimResult]) -> Efficiency:
    """Memory used over allocated and idle GPU-hours. A job uses ``used_gpus`` of its GPUs, each
    up to its peak (the card's memory when it ran out); the others hold nothing. It is idle when
    its mean utilisation over all its allocated GPUs and its elapsed time stays below 5%."""
    by_id = {j.job_id: j for j in jobs}
    used_mem: dict[str, float] = {}
    idle: dict[str, bool] = {}
    for r in results:
        job = by_id[r.job_id]
        card = _memory_mib(r.gpu_type)
        share = used_gpus(job, r.gpus) / r.gpus
        used_mem[r.job_id] = min(peak_mem_mib(job, r.gpu_type, r.gpus), card) / card * share
        idle[r.job_id] = run_model(job, r.gpu_type, r.gpus).util(r.end_s - r.start_s) * share < IDLE_UTIL_PCT
    return efficiency(results, used_mem, idle)


def evaluate(scenario: Scenario, progress: Callable[[str], None] = lambda s: None) -> Evaluation:
    """Generate the scenario's workload, place it by every policy and simulate each placement."""
    began = time.perf_counter()
    cluster = scenario.cluster
    jobs = generate(cluster, scenario.start, scenario.days, scenario.seed, scenario.rate)
    cut = int(len(jobs) * scenario.train_share)
    train, tested = jobs[:cut], jobs[cut:]
    progress(f"{len(jobs):,} jobs generated on {cluster.name}; training on {len(train):,}, "
             f"evaluating {len(tested):,}")
    config = scenario_config(cluster)
    features = {s: script_features(s) for s in dict.fromkeys(j.script for j in jobs)}
    requests: dict[str, JobRequest] = {}
    for job in jobs:
        if job.script not in requests:  # an array's tasks, and reruns as they were, share one script
            requests[job.script] = build_request(parse_script(job.script.encode(), f"{job.job_id}.sh"), (), {},
                                                 config.gpu_features())
    cost = {pool.gpu_type: config.gpu_types[pool.gres].cost for part in cluster.partitions for pool in part.pools}
    sim = sim_cluster(cluster)
    closed = Simulation(sim)
    model, decider, model_note = model_decisions(train, tested, cluster, config, features, requests,
                                                 scenario.iterations, progress, closed)
    rule = static_rule(tested, cluster, features)
    placements = {
        "request": (honour(tested), "every job as asked"),
        "rule": (rule, f"changed {sum(rule[j.job_id] != (j.req_gpu_type, j.req_gpus) for j in tested):,} jobs"),
        "slurmgpu": (model, model_note),
        "oracle": (oracle(tested, cluster, cost, requests), "true peak and runtime; earliest estimated completion"),
    }
    policies = []
    for name, (placed, note) in placements.items():
        progress(f"simulating {POLICIES[name]}")
        results = closed.results() if name == "slurmgpu" else simulate(sim_jobs(tested, placed), sim)
        policies.append(PolicyResult(name, placed, note, results, summarize(results), measure(tested, results)))
    unfittable = sum(not fits_somewhere(j, cluster) for j in tested)
    return Evaluation(scenario, len(jobs), len(train), tested, decider, unfittable, config, policies,
                      time.perf_counter() - began)


