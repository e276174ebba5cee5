"""Admin alerts: each kind on hand-built jobs (expected fixes worked out from the sample config),
and on the demo's generated history, checked against the workload model's own truth."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from slurmgpu.pipeline.config import load_config
from slurmgpu.reporting import alerts, queries

ROOT = Path(__file__).resolve().parent.parent
CONFIG = load_config(str(ROOT / "contrib" / "slurmgpu.toml"))  # a100 80 GiB, v100 32, t4 16 (gpu-small)


def use(**fields: Any) -> queries.JobUse:
    base = {"job_id": "1", "user": "u", "account": "a", "gpu_type": "a100", "gpu_count": 1, "elapsed_s": 7200,
            "state": "COMPLETED", "end_time": datetime(2026, 1, 2), "peak_mib": 30000.0, "max_util": 95.0,
            "gpus_busy": 1, "original": None, "decision": None, "changed": False, "mean_util": 80.0,
            "partition": "gpu"}
    return queries.JobUse(**(base | fields))


def kinds(job: queries.JobUse) -> list[tuple[str, str]]:
    return [(a.kind, a.fix) for a in alerts.job_alerts(job, CONFIG)]


def test_a_busy_job_on_the_right_card_raises_nothing() -> None:
    assert kinds(use()) == []
    assert kinds(use(peak_mib=5000.0, mean_util=90.0)) == []  # small but busy: the card's speed is used


def test_too_powerful_card() -> None:
    # 5 GiB peak + 10% margin fits a 16 GiB t4 (<= half of 80), and the GPU idled along at 20%
    assert kinds(use(peak_mib=5120.0, mean_util=20.0)) == [("oversized_type", "ask for --gres=gpu:t4:1 -p gpu-small")]
    # 20 GiB + 10% needs the 32 GiB v100, in the job's own partition
    assert kinds(use(peak_mib=20480.0, mean_util=20.0)) == [("oversized_type", "ask for --gres=gpu:v100:1")]
    assert kinds(use(peak_mib=40000.0, mean_util=20.0)) == []  # 44 GiB fits no card of <= 40 GiB
    assert kinds(use(gpu_type="t4", partition="gpu-small", peak_mib=1000.0, mean_util=5.0)) == []  # smallest card


def test_idle_gpus_and_jobs_that_never_used_theirs() -> None:
    four = use(gpu_count=4, gpus_busy=1, peak_mib=60000.0)
    [(kind, fix)] = kinds(four)
    assert (kind, fix) == ("idle_gpus", "use 1 GPU(s), not 4 (--gres=gpu:a100:1)")
    assert alerts.job_alerts(four, CONFIG)[0].wasted_gpu_hours == 6.0  # 3 idle GPUs x 2 h
    assert kinds(four._replace(elapsed_s=120)) == []  # a short test run is not flagged
    idle = use(gpu_count=2, gpus_busy=0, max_util=0.0, mean_util=0.0, peak_mib=3.0)
    assert [k for k, _ in kinds(idle)] == ["no_gpu_use"]
    assert alerts.job_alerts(idle, CONFIG)[0].wasted_gpu_hours == 4.0


def test_out_of_memory_gpu_and_host() -> None:
    gpu_oom = use(state="FAILED", gpu_type="v100", peak_mib=32768.0, elapsed_s=90)
    assert kinds(gpu_oom) == [("gpu_oom", "ask for --gres=gpu:a100:1, or a smaller batch / gradient checkpointing")]
    t4 = use(state="FAILED", gpu_type="t4", partition="gpu-small", peak_mib=16300.0)
    assert kinds(t4)[0][1].startswith("ask for --gres=gpu:v100:1 -p gpu,")  # the next card is in another partition
    assert kinds(use(state="FAILED", peak_mib=80000.0))[0][1].startswith("lower per-GPU memory")  # none bigger
    assert kinds(use(state="FAILED", peak_mib=1000.0, mean_util=90.0)) == []  # failed for another reason
    assert [k for k, _ in kinds(use(state="OUT_OF_MEMORY"))] == ["host_oom"]


def test_gpu_oom_against_the_usable_memory_and_the_collectors_record() -> None:
    """A T4's NVML total is 15,360 MiB: a 15,000 MiB peak is 97.7% of it, 91.6% of the nominal 16 GiB."""
    t4 = use(state="FAILED", gpu_type="t4", partition="gpu-small", peak_mib=15000.0, mean_util=90.0)
    assert kinds(t4) == []  # the nominal size alone cannot tell
    assert [k for k, _ in kinds(t4._replace(usable_mib=15360.0))] == ["gpu_oom"]
    said = use(state="TIMEOUT", peak_mib=2000.0, gpu_oom="pytorch")  # another rank hung after one ran out
    assert [a.detail for a in alerts.job_alerts(said, CONFIG)] == [
        "pytorch reported CUDA out of memory; peak 2.0 GiB of the card's 80.0 GiB"]
    assert kinds(said._replace(state="COMPLETED")) == []  # caught it and finished


def test_over_requested_count_from_the_recorded_decision() -> None:
    cands = [{"gpu_type": "a100", "gpus": n, "fits": True, "pred_runtime_s": t, "expected_wait_s": 0.0}
             for n, t in ((4, 1000.0), (2, 1200.0), (1, 2600.0))]
    job = use(gpu_count=4, gpus_busy=4, decision={"changes": [], "per_type": cands})
    [alert] = alerts.job_alerts(job, CONFIG)
    assert alert.kind == "over_requested" and alert.fix.startswith("use 2 GPU(s), not 4 (--gres=gpu:a100:2")
    assert alert.wasted_gpu_hours == 4.0  # 2 GPUs too many x 2 h
    assert alerts.job_alerts(job._replace(changed=True), CONFIG) == []  # slurmgpu already changed it


def test_rows_group_per_user_account_and_kind() -> None:
    jobs = [use(job_id=str(i), user="ann", gpu_count=4, gpus_busy=2, peak_mib=60000.0) for i in range(3)]
    jobs += [use(job_id="9", user="bo", account="b", state="OUT_OF_MEMORY"), use(job_id="10", user="cy")]
    rows = alerts.build(jobs, CONFIG)
    assert [(r.user, r.account, r.kind, r.jobs, r.gpu_hours, r.wasted_gpu_hours) for r in rows] == [
        ("ann", "a", "idle_gpus", 3, 24.0, 12.0), ("bo", "b", "host_oom", 1, 2.0, 2.0)]
    assert rows[0].fix == "use 2 GPU(s), not 4 (--gres=gpu:a100:2)"


@pytest.fixture(scope="module")
def demo_history(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, str]:
    """The demo's generator at a small scale, ingested through the real loaders."""
    from slurmgpu.apps import demo
    from slurmgpu.history import db, ingest
    from slurmgpu.slurm import sacct

    out = tmp_path_factory.mktemp("demo")
    hist = demo.generate_history(out / "history", seed=3, days=6, jobs_per_day=80)
    url = f"sqlite:///{out / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with open(hist.emitted.sacct_path, encoding="utf-8") as fh:
        report = ingest.load_jobs(engine, sacct.parse_lines(fh, sacct.FIELDS, "|", "slurmgpu"))
    ingest.load_gpu_records(engine, hist.emitted.spool_dir, report)
    assert not report.errors
    return hist, engine, url


def test_alerts_on_the_demo_history_match_the_workload_truth(demo_history: tuple[Any, Any, str]) -> None:
    from slurmgpu.simulation.workload import DEFAULT_CLUSTER, fits

    hist, engine, _ = demo_history
    jobs = queries.load_jobs(engine, datetime(2000, 1, 1), hist.cut)
    runs = {r.job.job_id: r for r in hist.emitted.runs}
    assert len(jobs) == len(runs)
    found = {(a.job_id, a.kind) for j in jobs for a in alerts.job_alerts(j, CONFIG)}
    assert {k for _, k in found} >= {"oversized_type", "gpu_oom"}
    gres = {pool.gpu_type: pool.gres for part in DEFAULT_CLUSTER.partitions for pool in part.pools}
    for job_id, kind in found:
        run = runs[job_id]
        if kind == "gpu_oom":  # the workload model says the job did not fit its card
            assert not fits(run.job, run.gpu_type, run.gpus), job_id
        elif kind == "host_oom":
            assert run.state == "OUT_OF_MEMORY"
        elif kind == "oversized_type":
            assert run.state != "FAILED" or fits(run.job, run.gpu_type, run.gpus)
            fix = next(a.fix for j in jobs if j.job_id == job_id for a in alerts.job_alerts(j, CONFIG))
            smaller = fix.split(":")[1]
            card = {g: n for n, g in gres.items()}[smaller]
            assert run.peak_mem_mib <= CONFIG.gpu_types[smaller].memory_gib * 1024, (job_id, fix, card)
        elif kind == "no_gpu_use":
            assert run.gpu_util < 5.0 or run.used_gpus == 0, job_id
    rows = alerts.build(jobs, CONFIG)
    assert sum(r.jobs for r in rows) == len(found)
