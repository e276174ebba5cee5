"""A generated workload replayed on the real local Slurm through gsbatch (about two minutes): every job
lands in the store with the GPUs it asked for, its collector record and its submission record, and the
simulator, given the same jobs, schedules them as Slurm did within ``replay.TOLERANCE``."""

from __future__ import annotations

import os

import pytest

from slurmgpu.simulation import replay
from slurmgpu.simulation.workload import fits


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> replay.Replay:
    return replay.replay(str(tmp_path_factory.mktemp("replay")))


def test_the_workload_is_one_where_fifo_decides() -> None:
    seed, jobs = replay.select_workload()
    assert replay.JOBS[0] <= len(jobs) <= replay.JOBS[1]
    assert replay.suitable(jobs) and (seed, jobs) == replay.select_workload(seed)
    assert all(replay.RUN_S[0] <= r.run_s <= replay.RUN_S[1] and r.limit_s % 60 == 0 for r in jobs)
    assert jobs[-1].submit_s < 120  # compressed: the whole replay fits the test's time budget


@pytest.mark.slurm
def test_every_job_is_ingested_as_it_ran(replayed: replay.Replay) -> None:
    rows = {row["job_id"]: row for row in replayed.rows}
    assert len(rows) == len(replayed.jobs) == len(replayed.slurm_ids)
    for r in replayed.jobs:
        row = rows[replayed.slurm_ids[r.job.job_id]]
        assert (row["gpu_type"], row["gpu_count"], row["partition"]) == (r.gres, r.job.req_gpus, r.job.partition)
        fitted = fits(r.job, r.job.req_gpu_type, r.job.req_gpus)
        assert row["state"] == ("COMPLETED" if fitted else "FAILED") and row["time_limit_s"] == r.limit_s
        assert row["gpu_usage_source"] == "collector" and row["peak_gpu_mem_mib"] > 0
        if fitted:  # the planned sleep, its overhead, whole seconds
            assert abs(row["elapsed_s"] - r.run_s) <= replay.PAYLOAD_OVERHEAD_S + 1
    loaded = len(replayed.jobs)
    assert replayed.ingest.startswith(f"{loaded} jobs inserted")
    assert f"{2 * loaded} spool records loaded, 0 rejected" in replayed.ingest  # collector + gsbatch records


@pytest.mark.slurm
def test_the_simulator_schedules_as_slurm_did(replayed: replay.Replay) -> None:
    found = replay.problems(replayed.report, len(replayed.jobs))
    if found and replayed.foreign and os.environ.get("CI") != "true":
        pytest.skip(f"{len(replayed.foreign)} other jobs shared the cluster during the replay: {found}")
    assert not found, replay.describe(replayed)
    assert sum(r.wait_s > replay.SCHED_LATENCY_S for r in replayed.simulated) >= replay.MIN_WAITING

