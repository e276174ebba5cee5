"""The queue ledger the decider takes its expected waits from."""

from __future__ import annotations

import math

from slurmgpu.pipeline.queue import GpuLedger


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
