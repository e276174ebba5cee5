"""The cluster simulator: hand-computed schedules for FIFO, EASY backfill, multi-node jobs, TIMEOUT
and OOM ends, per-type isolation and determinism; summary statistics on a known schedule; a property
test that no GPU is ever over-allocated; the order comparison; and a scale smoke test (skipped only
with SLURMGPU_SKIP_SCALE=1)."""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgpu.pipeline.config import load_config, parse_config
from slurmgpu.simulation.simulator import (
    BF_MAX_JOB_TEST,
    COMPLETED,
    OOM_AFTER_S,
    OUT_OF_MEMORY,
    TIMEOUT,
    SimCluster,
    SimJob,
    SimResult,
    Simulation,
    compare_orders,
    efficiency,
    simulate,
    summarize,
)


def job(job_id: str, submit: float, gpus: int, runtime: float, limit: float | None = None, *,
        gpu_type: str = "a100", oom: bool = False) -> SimJob:
    return SimJob(job_id, submit, gpu_type, gpus, runtime, runtime if limit is None else limit, oom)


def run(cluster: list[tuple[str, int, int]], jobs: list[SimJob], *, oom_after_s: float = OOM_AFTER_S,
        max_job_test: int = BF_MAX_JOB_TEST) -> dict[str, SimResult]:
    results = simulate(jobs, SimCluster(cluster), oom_after_s=oom_after_s, max_job_test=max_job_test)
    return {r.job_id: r for r in results}


def spans(results: dict[str, SimResult]) -> dict[str, tuple[float, float]]:
    return {k: (r.start_s, r.end_s) for k, r in results.items()}


def test_fifo_without_backfill_opportunity() -> None:
    res = run([("a100", 1, 4)], [job("A", 0, 4, 100), job("B", 10, 4, 50, 60), job("C", 20, 4, 10)])
    assert spans(res) == {"A": (0, 100), "B": (100, 150), "C": (150, 160)}
    assert [res[k].wait_s for k in "ABC"] == [0, 90, 130]
    assert [res[k].jct_s for k in "ABC"] == [100, 140, 140]
    assert all(r.state == COMPLETED and r.alloc_gpus == 4 and r.nodes == (0,) for r in res.values())


def test_short_job_backfills_without_delaying_the_head() -> None:
    # B (4 GPUs) is reserved for t=100, when A's limit frees its 2 GPUs; C's limit ends exactly then.
    res = run([("a100", 1, 4)], [job("A", 0, 2, 100), job("B", 1, 4, 50), job("C", 2, 2, 30, 98)])
    assert spans(res) == {"A": (0, 100), "B": (100, 150), "C": (2, 32)}


def test_the_queue_as_squeue_shows_it_between_submissions() -> None:
    # The schedule of the backfill test above, read at t=50: A and C ran (C ended at 32), B waits.
    sim = Simulation(SimCluster([("a100", 1, 4)]))
    for j in (job("A", 0, 2, 100), job("B", 1, 4, 50), job("C", 2, 2, 30, 98)):
        sim.submit(j)
    queue = sim.queue(50)
    assert [(q.job.job_id, q.running, q.nodes, q.seconds) for q in queue] == [("A", True, (0,), 50),
                                                                              ("B", False, (), 50)]
    sim.submit(job("D", 50, 1, 10))  # arrives now: pending until the next step is simulated
    assert [q.job.job_id for q in sim.queue(50) if not q.running] == ["B", "D"]
    assert {r.job_id: (r.start_s, r.end_s) for r in sim.results()} == {
        "A": (0, 100), "B": (100, 150), "C": (2, 32), "D": (50, 60)}
    with pytest.raises(ValueError, match="before the previous job"):
        sim.submit(job("E", 40, 1, 10))


def test_long_job_must_not_backfill() -> None:
    # C would really end at 32, but its limit (2 + 99) runs past B's reservation: it waits for B.
    res = run([("a100", 1, 4)], [job("A", 0, 2, 100), job("B", 1, 4, 50), job("C", 2, 2, 30, 99)])
    assert spans(res) == {"A": (0, 100), "B": (100, 150), "C": (150, 180)}


def test_backfill_looks_no_deeper_than_max_job_test() -> None:
    jobs = [job("A", 0, 2, 100), job("B", 1, 4, 50), job("X", 1.5, 4, 10), job("C", 2, 2, 30, 98)]
    assert run([("a100", 1, 4)], jobs)["C"].start_s == 2
    # C is third in the queue; with only two tested it waits behind B and X.
    assert spans(run([("a100", 1, 4)], jobs, max_job_test=2)) == {
        "A": (0, 100), "B": (100, 150), "X": (150, 160), "C": (160, 190)}


def test_long_job_backfills_on_gpus_the_head_leaves_over() -> None:
    # One 8-GPU node: B (6 GPUs) is reserved for t=100 and leaves 2 over; C takes them, D (1 GPU)
    # fits in the free GPUs now but not in what B leaves, so it waits.
    res = run([("a100", 1, 8)], [job("A", 0, 4, 100), job("B", 1, 6, 10), job("C", 2, 2, 500),
                                 job("D", 3, 1, 500)])
    assert spans(res) == {"A": (0, 100), "B": (100, 110), "C": (2, 502), "D": (110, 610)}


def test_long_job_backfills_on_a_node_the_head_does_not_need() -> None:
    # Two 4-GPU nodes; B is reserved node 0 (best fit, lowest index), so long C may use node 1.
    res = run([("a100", 2, 4)], [job("A", 0, 4, 100), job("A2", 0, 2, 100), job("B", 1, 4, 10),
                                 job("C", 2, 1, 1000)])
    assert (res["A"].nodes, res["A2"].nodes) == ((0,), (1,))
    assert (res["C"].start_s, res["C"].nodes) == (2, (1,))
    assert (res["B"].start_s, res["B"].nodes) == (100, (0,))


def test_multi_node_jobs_take_whole_nodes() -> None:
    # B needs both 4-GPU nodes; short C backfills on A's node, long D waits until B is done.
    res = run([("a100", 2, 4)], [job("A", 0, 1, 50), job("B", 1, 6, 100), job("C", 2, 1, 10),
                                 job("D", 3, 1, 10, 100)])
    assert spans(res) == {"A": (0, 50), "B": (50, 150), "C": (2, 12), "D": (150, 160)}
    assert (res["B"].gpus, res["B"].alloc_gpus, res["B"].nodes) == (6, 8, (0, 1))
    assert res["C"].nodes == res["A"].nodes == (0,)


def test_timeout_at_the_limit() -> None:
    res = run([("a100", 1, 4)], [job("A", 0, 4, 200, 100), job("B", 5, 4, 10), job("C", 6, 4, 30, 30)])
    assert (res["A"].end_s, res["A"].state) == (100, TIMEOUT)
    assert (res["B"].start_s, res["B"].end_s, res["B"].state) == (100, 110, COMPLETED)
    assert (res["C"].end_s, res["C"].state) == (140, COMPLETED)  # a runtime equal to the limit completes


def test_oom_ends_early() -> None:
    jobs = [job("A", 0, 1, 1000, 2000, oom=True), job("B", 0, 1, 30, oom=True), job("C", 0, 1, 1000, 20, oom=True)]
    res = run([("a100", 1, 8)], jobs)
    assert {k: (r.end_s, r.state) for k, r in res.items()} == {
        "A": (60, OUT_OF_MEMORY), "B": (30, OUT_OF_MEMORY), "C": (20, TIMEOUT)}
    assert run([("a100", 1, 8)], jobs[:1], oom_after_s=5)["A"].end_s == 5


def test_types_do_not_block_each_other() -> None:
    res = run([("t4", 1, 4), ("a100", 1, 4)], [job("X", 0, 4, 1000, gpu_type="t4"), job("Y", 1, 4, 10, gpu_type="t4"),
                                               job("Z", 2, 4, 10)])
    assert spans(res) == {"X": (0, 1000), "Y": (1000, 1010), "Z": (2, 12)}


def test_deterministic_whatever_the_input_order() -> None:
    jobs = _synthetic_jobs(400, SimCluster.large(), load=1.1, seed=3)
    first = simulate(jobs, SimCluster.large())
    random.Random(1).shuffle(jobs)
    assert simulate(jobs, SimCluster.large()) == first
    # Equal submit times: the job id decides.
    res = run([("a100", 1, 4)], [job("b", 0, 4, 10), job("a", 0, 4, 10)])
    assert spans(res) == {"a": (0, 10), "b": (10, 20)}


def test_summary_of_a_known_schedule() -> None:
    results = simulate([job("A", 0, 2, 100), job("B", 10, 4, 50, 40), job("C", 20, 1, 500, gpu_type="t4", oom=True)],
                       SimCluster([("a100", 1, 4), ("t4", 1, 4)]))
    assert [(r.start_s, r.end_s, r.state) for r in results] == [
        (0, 100, COMPLETED), (100, 140, TIMEOUT), (20, 80, OUT_OF_MEMORY)]
    s = summarize(results)
    assert s.jobs == 3
    assert s.mean_jct_s == pytest.approx(290 / 3)
    assert (s.p50_jct_s, s.p99_jct_s) == (100, pytest.approx(100 + 0.98 * 30))
    assert (s.mean_wait_s, s.p50_wait_s, s.p99_wait_s) == (30, 0, pytest.approx(0.98 * 90))
    assert s.makespan_s == 140
    assert s.gpu_hours == pytest.approx((2 * 100 + 4 * 40 + 1 * 60) / 3600)
    assert (s.oom, s.timeout, s.failed) == (1, 1, 2)
    assert s.utilisation == [(0, {"a100": 2, "t4": 0}), (20, {"a100": 2, "t4": 1}), (80, {"a100": 2, "t4": 0}),
                             (100, {"a100": 4, "t4": 0}), (140, {"a100": 0, "t4": 0})]

    eff = efficiency(results, {"A": 0.5, "B": 0.25}, {"A": 0.1, "C": True}, memory_gib={"a100": 80, "t4": 16})
    assert eff.mem_used_share == pytest.approx((0.5 * 200 + 0.25 * 160) / (200 + 160))
    assert eff.idle_gpu_hours == pytest.approx((0.1 * 200 + 60) / 3600)
    assert math.isnan(efficiency(results, {}, {}).mem_used_share)
    with pytest.raises(ValueError, match="no jobs"):
        summarize([])


def test_compare_orders() -> None:
    sim = simulate([job("A", 0, 4, 100), job("B", 10, 4, 50), job("C", 20, 4, 10)], SimCluster([("a100", 1, 4)]))
    same = compare_orders({"A": (0, 101), "B": (102, 152), "C": (151, 161)}, sim)
    assert (same.jobs, same.missing, same.pairs, same.start_discordant, same.end_discordant) == (3, (), 3, 0, 0)
    assert (same.start_tau, same.end_tau, same.max_start_diff_s, same.max_end_diff_s) == (1, 1, 2, 2)

    swapped = compare_orders({"A": (0, 100), "B": (120, 170), "C": (101, 111), "X": (0, 1)}, sim)
    assert (swapped.jobs, swapped.missing, swapped.start_discordant, swapped.end_discordant) == (3, ("X",), 1, 1)
    assert swapped.start_tau == pytest.approx(1 / 3)
    assert (swapped.max_start_diff_s, swapped.max_end_diff_s) == (49, 49)

    tied = compare_orders({"A": (0, 100), "B": (0, 150), "C": (150, 160)}, sim)  # a tie is no discordance
    assert tied.start_discordant == 0
    assert tied.start_tau == pytest.approx(2 / math.sqrt(2 * 3))
    assert math.isnan(compare_orders({}, sim).start_tau)
    # the simulation ends B (150) before C (160); really C ended 1 s before B: within 1 s that is no order
    near = compare_orders({"A": (0, 101), "B": (102, 151), "C": (151, 150)}, sim)
    assert near.end_discordant == 1
    assert compare_orders({"A": (0, 101), "B": (102, 151), "C": (151, 150)}, sim, resolution_s=1).end_discordant == 0


def test_cluster_from_config(sample_config: Path) -> None:
    cfg = load_config(sample_config)
    assert SimCluster.from_config(cfg).groups == (("a100", 1, 4), ("v100", 1, 4), ("t4", 1, 4),
                                                  ("a100_1g.10gb", 1, 4), ("a100_3g.40gb", 1, 4))
    raw = {"gpu_types": {"a": {"memory_gib": 80}, "b": {"memory_gib": 16}},
           "partitions": {"p": {"gpu_types": ["a", "b"], "gpus_per_node": 8, "nodes": 3},
                          "q": {"gpu_types": ["a"], "gpus_per_node": 4, "nodes": 2}}}
    cluster = SimCluster.from_config(parse_config(raw))
    assert cluster.groups == (("a", 2, 8), ("b", 1, 8), ("a", 2, 4))
    assert cluster.node_gpus("a") == (8, 8, 4, 4)
    assert SimCluster.large().capacity("t4") == 128


@pytest.mark.parametrize(("bad", "message"), [
    (job("A", 0, 1, 10, gpu_type="h100"), "not in the cluster"),
    (job("A", 0, 9, 10), "9 GPUs, the cluster has 8 a100"),
    (job("A", 0, 0, 10), "0 GPUs"),
    (job("A", 0, 1, 10, 0), "time limit > 0"),
])
def test_jobs_that_could_never_run_are_refused(bad: SimJob, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate([bad], SimCluster([("a100", 2, 4)]))
    with pytest.raises(ValueError, match="duplicate"):
        simulate([job("A", 0, 1, 1), job("A", 1, 1, 1)], SimCluster([("a100", 2, 4)]))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SimCluster, list[SimJob]]:
    groups = draw(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 3), st.sampled_from([1, 2, 4, 8])),
                           min_size=1, max_size=3))
    cluster = SimCluster(groups)
    jobs = []
    for k in range(draw(st.integers(1, 30))):
        gpu_type = draw(st.sampled_from(cluster.gpu_types()))
        jobs.append(SimJob(f"j{k}", draw(st.integers(0, 100)), gpu_type,
                           draw(st.integers(1, cluster.capacity(gpu_type))), draw(st.integers(0, 50)),
                           draw(st.integers(1, 60)), draw(st.booleans())))
    return cluster, jobs


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_no_gpu_is_over_allocated(scenario: tuple[SimCluster, list[SimJob]]) -> None:
    cluster, jobs = scenario
    results = simulate(jobs, cluster)
    assert simulate(jobs[::-1], cluster) == results
    # Fed one job at a time with the queue read before each: the same schedule, and each reading
    # holds exactly the jobs submitted before then that had not ended.
    sim = Simulation(cluster)
    by_submit = sorted(jobs, key=lambda j: (j.submit_s, j.job_id))
    ends = {r.job_id: r for r in results}
    for k, j in enumerate(by_submit):
        queue = sim.queue(j.submit_s)
        for t in cluster.gpu_types():  # pending ones in each type's queue order
            assert [q.job.job_id for q in queue if not q.running and q.job.gpu_type == t] == [
                i.job_id for i in by_submit[:k] if i.gpu_type == t and ends[i.job_id].start_s >= j.submit_s]
        assert {q.job.job_id for q in queue} == {i.job_id for i in by_submit[:k] if ends[i.job_id].end_s >= j.submit_s}
        for q in queue:
            r = ends[q.job.job_id]
            assert q.running == (r.start_s < j.submit_s) and r.end_s >= j.submit_s
            assert q.seconds == (r.start_s + q.job.time_limit_s - j.submit_s if q.running else q.job.time_limit_s)
        sim.submit(j)
    assert sim.results() == results
    by_id = {j.job_id: j for j in jobs}
    event_times = {j.submit_s for j in jobs} | {r.end_s for r in results}
    events = []
    for r in results:
        j, cap = by_id[r.job_id], cluster.node_gpus(r.gpu_type)
        assert r.submit_s <= r.start_s <= r.end_s
        assert r.start_s in event_times  # jobs start only when something happens
        ran = min(j.runtime_s, 60) if j.oom else j.runtime_s
        assert r.end_s - r.start_s == min(ran, j.time_limit_s)
        assert len(set(r.nodes)) == len(r.nodes)
        if len(r.nodes) == 1 and cap[r.nodes[0]] >= j.gpus:
            held = [j.gpus]
        else:  # whole nodes, and only when no single node could hold the job
            assert max(cap) < j.gpus <= sum(cap[n] for n in r.nodes)
            held = [cap[n] for n in r.nodes]
        assert r.alloc_gpus == sum(held)
        for n, c in zip(r.nodes, held, strict=True):
            if r.end_s > r.start_s:  # a job of no duration holds nothing
                events += [(r.start_s, 1, r.gpu_type, n, c), (r.end_s, 0, r.gpu_type, n, -c)]
    used: dict[tuple[str, int], int] = {}
    for _, _, gpu_type, n, c in sorted(events):  # ends before starts at the same time
        used[gpu_type, n] = used.get((gpu_type, n), 0) + c
        assert 0 <= used[gpu_type, n] <= cluster.node_gpus(gpu_type)[n]
    for _, alloc in summarize(results).utilisation:
        assert all(alloc[t] <= cluster.capacity(t) for t in alloc)
    # FIFO: whenever a job waits, the first one waiting of its type does not fit in the free GPUs.
    for t in sorted(event_times):
        for gpu_type in cluster.gpu_types():
            waiting = [r for r in results if r.gpu_type == gpu_type and r.submit_s <= t < r.start_s]
            if not waiting:
                continue
            head, cap = waiting[0], cluster.node_gpus(gpu_type)
            free = list(cap)
            for r in results:
                if r.gpu_type == gpu_type and r.start_s <= t < r.end_s:
                    for n in r.nodes:
                        free[n] -= r.gpus if len(r.nodes) == 1 and cap[n] >= r.gpus else cap[n]
            if head.gpus <= max(cap):
                assert head.gpus > max(free)
            else:
                assert head.gpus > sum(c for c, f in zip(cap, free, strict=True) if c == f)


@pytest.mark.skipif(os.environ.get("SLURMGPU_SKIP_SCALE") == "1", reason="SLURMGPU_SKIP_SCALE=1")
def test_scale_smoke() -> None:
    cluster = SimCluster.large()
    jobs = _synthetic_jobs(20_000, cluster, load=1.1, seed=7)
    began = time.perf_counter()
    results = simulate(jobs, cluster)
    summary = summarize(results)
    elapsed = time.perf_counter() - began
    assert summary.jobs == 20_000 and summary.p99_wait_s > 0
    assert all(max(a.values()) <= 128 for _, a in summary.utilisation)
    assert elapsed < 60, f"20,000 jobs took {elapsed:.1f} s"


def _synthetic_jobs(n: int, cluster: SimCluster, *, load: float, seed: int) -> list[SimJob]:
    """Poisson arrivals per type at ``load`` times its capacity, heavy-tailed runtimes, some
    1- to 2-node jobs, limits 1.1-4x the runtime (5% too short: TIMEOUT) and 3% OOM."""
    rng = np.random.default_rng(seed)
    types = cluster.gpu_types()
    caps = np.array([cluster.capacity(t) for t in types], dtype=float)
    jobs = []
    for gpu_type, cap, m in zip(types, caps, rng.multinomial(n, caps / caps.sum()), strict=True):
        per_node = max(cluster.node_gpus(gpu_type))
        sizes = rng.choice([1, 2, 4, per_node, 2 * per_node], size=m, p=[0.5, 0.2, 0.15, 0.1, 0.05])
        runtime = np.clip(rng.lognormal(np.log(1800), 1.2, m), 30, 3 * 86400)
        limit = np.ceil(runtime * rng.uniform(1.1, 4, m) / 60) * 60
        short = rng.random(m) < 0.05
        limit[short] = np.ceil(runtime[short] * rng.uniform(0.5, 1, short.sum()) / 60) * 60
        oom = rng.random(m) < 0.03
        submit = np.cumsum(rng.exponential(float((sizes * runtime).mean()) / (load * cap), m))
        jobs += [SimJob(f"{gpu_type}-{k}", float(submit[k]), gpu_type, int(sizes[k]), float(runtime[k]),
                        float(limit[k]), bool(oom[k])) for k in range(m)]
    return jobs
