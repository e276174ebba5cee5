"""The queue ledger the decider takes its expected waits from."""

from __future__ import annotations

import math
from pathlib import Path

from slurmgpu.pipeline.queue import GpuLedger
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
