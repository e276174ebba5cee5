"""The queue ledger the decider takes its expected waits from."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from slurmgpu.pipeline.queue import GpuLedger
from slurmgpu.pipeline.request import array_tasks
from slurmgpu.slurm.backend import NodeInfo, parse_squeue

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_wait_is_when_one_node_first_has_enough_gpus() -> None:
    ledger = GpuLedger({"a100": [4, 4], "t4": [8]})
    assert ledger.wait("a100", 4) == 0.0
    assert ledger.reserve("a100", 3, now=0.0, duration=100.0) == 0.0  # node 1: 3 busy until 100
    assert ledger.wait("a100", 4) == 0.0  # node 2 is idle
    assert ledger.reserve("a100", 4, now=0.0, duration=50.0) == 0.0  # node 2 busy until 50
    assert ledger.wait("a100", 1) == 0.0  # node 1 still has one idle GPU
    assert ledger.wait("a100", 2) == 50.0  # node 2 frees first
    assert ledger.wait("a100", 2, now=30.0) == 20.0
    assert ledger.wait("a100", 4, now=120.0) == 0.0


def test_queued_demand_stacks_behind_running_jobs() -> None:
    ledger = GpuLedger({"v100": [2]})
    ledger.reserve("v100", 2, now=0.0, duration=60.0)  # running
    assert ledger.reserve("v100", 2, now=10.0, duration=60.0) == 60.0  # pending: starts when they free
    assert ledger.wait("v100", 1, now=10.0) == 110.0  # a new job waits for both


def test_no_node_large_enough_is_an_infinite_wait() -> None:
    ledger = GpuLedger({"a100": [4]})
    assert math.isinf(ledger.wait("a100", 8)) and math.isinf(ledger.wait("h100", 1))
    assert math.isinf(ledger.reserve("a100", 8, now=0.0, duration=1.0))
    assert ledger.wait("a100", 4) == 0.0  # nothing was booked


LOCAL = [NodeInfo("gpu1", ("gpu", "debug"), {"a100": 4, "v100": 4}),
         NodeInfo("gpu2", ("gpu-small", "debug"), {"t4": 4})]


def test_ledger_from_a_captured_queue() -> None:
    """squeue on the local cluster (Slurm 22.05): a100 2+2 running (30 and 60 min limits), a100x4
    pending (20 min), t4x3 pending behind other jobs (10 min), an untyped 2-GPU job pending in
    partition gpu (15 min), and a held v100x4 job."""
    jobs = parse_squeue((FIXTURES / "squeue_gpu_22.05.txt").read_text())
    assert [(j.job_id, j.running, j.nodes, dict(j.gpus)) for j in jobs] == [
        ("1394", True, ("gpu1",), {"a100": 2}), ("1395", True, ("gpu1",), {"a100": 2}),
        ("1396", False, (), {"a100": 4}), ("1397", False, (), {"t4": 3}), ("1398", False, (), {"": 2})]
    ledger = GpuLedger.from_queue(LOCAL, jobs)
    left = {j.job_id: j.seconds for j in jobs}
    # a100: the pending 4-GPU job waits for both running ones, then holds the node for its limit
    assert ledger.wait("a100", 1) == left["1395"] + left["1396"]
    # the untyped pending job takes the type of its partition that frees first: v100, now (the held
    # v100 job counts for nothing)
    assert ledger.wait("v100", 2) == 0.0 and ledger.wait("v100", 4) == left["1398"]
    assert ledger.wait("t4", 1) == 0.0 and ledger.wait("t4", 2) == left["1397"]


def test_squeue_lines_without_gpus_or_unreadable_are_skipped() -> None:
    text = ("7|R|gpu1|1:00|2:00|cpu=1,mem=500M,node=1,billing=1|1|gpu|None|\n"
            "8|R|gpu1|UNLIMITED|UNLIMITED|cpu=1,gres/gpu=1,gres/gpu:a100=1|1|gpu|None|\n"
            "9|PD||bad|bad|cpu=1,gres/gpu=1,gres/gpu:a100=1|1|gpu|Priority|\n"
            "short|line\n")
    [job] = parse_squeue(text)
    assert job.job_id == "8" and math.isinf(job.seconds)


def booked_in_turn(ledger: GpuLedger, gpu_type: str, gpus: int, tasks: int, runtime_s: float) -> float:
    """The mean start of TASKS jobs reserved one after another on a copy (the ledger's own booking)."""
    copy = GpuLedger({})
    copy.free = {t: [list(n) for n in nodes] for t, nodes in ledger.free.items()}
    return sum(copy.reserve(gpu_type, gpus, 0.0, runtime_s) for _ in range(tasks)) / tasks


@pytest.mark.parametrize("tasks", [2, 7, 16, 40])
@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_an_arrays_wait_is_its_tasks_mean_start_booked_in_turn(tasks: int, gpus: int) -> None:
    ledger = GpuLedger({"a100": [4, 4, 8]})
    ledger.reserve("a100", 3, now=0.0, duration=500.0)
    ledger.reserve("a100", 8, now=0.0, duration=90.0)
    expected = booked_in_turn(ledger, "a100", gpus, tasks, 60.0)
    assert ledger.wait("a100", gpus, tasks=tasks, runtime_s=60.0) == pytest.approx(expected)
    assert ledger.wait("a100", gpus, tasks=tasks, runtime_s=60.0) >= ledger.wait("a100", gpus)
    assert booked_in_turn(ledger, "a100", gpus, 1, 60.0) == ledger.wait("a100", gpus)  # nothing booked for real


def test_an_arrays_concurrency_limit_and_a_huge_array() -> None:
    ledger = GpuLedger({"t4": [8]})
    # 8 tasks, 2 at a time, 10 s each: starts 0, 0, 10, 10, 20, 20, 30, 30
    assert ledger.wait("t4", 1, tasks=8, runtime_s=10.0, at_once=2) == 15.0
    # 100,000 tasks on 8 GPUs: task k starts at (k // 8) * 10; the ones past MAX_TASKS keep that pace
    exact = sum((k // 8) * 10.0 for k in range(100_000)) / 100_000
    assert ledger.wait("t4", 1, tasks=100_000, runtime_s=10.0) == pytest.approx(exact, rel=0.01)
    assert math.isinf(ledger.wait("t4", 9, tasks=4, runtime_s=10.0))


@pytest.mark.parametrize(("spec", "tasks"), [("0-15", (16, 0)), ("1,3,8-9", (4, 0)), ("0-15:4", (4, 0)),
                                             ("0-31%4", (32, 4)), ("7", (1, 0))])
def test_array_tasks_count_as_slurm_expands_them(spec: str, tasks: tuple[int, int], submitted: list[str]) -> None:
    assert array_tasks(spec) == tasks
    if shutil.which("sbatch") is None:
        return
    job = subprocess.run(["sbatch", "--hold", "--parsable", f"--array={spec}", "-p", "debug", "-o", "/dev/null",
                          "--wrap", "true"], capture_output=True, text=True, check=True).stdout.strip()
    submitted.append(job)
    shown = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%i"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert len(shown) == tasks[0]


@pytest.mark.parametrize("spec", [None, "", "x", "5-2", "0-4:0", "1-"])
def test_an_unreadable_array_is_one_task(spec: str | None) -> None:
    assert array_tasks(spec) == (1, 0)
