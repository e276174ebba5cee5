"""`slurmgpu retry`: a GPU-OOM job is requeued once onto a card that holds it, never twice, never
one that asked not to be requeued. Unit level with scripted scontrol answers; live on the local Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from slurmgpu.apps import retry
from slurmgpu.history import db, ingest
from slurmgpu.pipeline.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = Path(sys.executable).parent
OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


def store(url: str, job_id: str, state: str, gpu_type: str, oom: str | None, end: datetime) -> None:
    """A job as the ingest stores it: sacct's row and the collector's GPU record with its finding."""
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(db.Job.__table__.insert().values(
            cluster="slurmgpu", job_id=job_id, job_id_raw=int(job_id), user="alice", state=state,
            gpu_type=gpu_type, gpu_count=1, submit_time=end - timedelta(minutes=5), end_time=end))
        conn.execute(db.GpuUsage.__table__.insert().values(
            cluster="slurmgpu", job_id=job_id, hostname="gpu2", source="nvml", gpus=1, peak_mem_mib=16000.0,
            samples=3, gpu_oom=oom, gpu_oom_line=OOM_LINE if oom else None, detail=[]))


class Scontrol:
    """scontrol as seen by retry: ``show job`` answers per job id, the other calls recorded."""

    def __init__(self, jobs: dict[str, str], fail: str | None = None) -> None:
        self.jobs, self.fail, self.calls = jobs, fail, []  # type: ignore[var-annotated]

    def __call__(self, argv: Any) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        if argv[1:3] == ["show", "job"]:
            line = self.jobs.get(argv[-1])
            return subprocess.CompletedProcess(argv, 0 if line else 1, line or "", "" if line else "Invalid job id")
        self.calls.append(argv)
        failed = self.fail is not None and argv[1] == self.fail
        return subprocess.CompletedProcess(argv, 1 if failed else 0, "", "Access/permission denied" if failed else "")


def job_line(job_id: str, *, requeue: int = 1, restarts: int = 0, state: str = "FAILED", comment: str = "") -> str:
    return (f"JobId={job_id} JobName=train UserId=alice(1001) GroupId=alice(1001) JobState={state} "
            f"Reason=NonZeroExitCode Requeue={requeue} Restarts={restarts} TimeLimit=01:00:00 Partition=gpu-small "
            f"Account=ml QOS=normal Comment={comment} TresPerNode=gres:gpu:t4:1")


@pytest.fixture
def url(tmp_path: Path) -> str:
    u = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(u)
    return u


def test_each_rule(url: str) -> None:
    config = load_config(SAMPLE)
    now = datetime(2026, 12, 3, 12, 0)
    for job_id, oom in (("1", "pytorch"), ("2", "jax"), ("3", "pytorch"), ("4", "pytorch"), ("5", None),
                        ("6", "pytorch")):
        store(url, job_id, "FAILED", "t4", oom, now - timedelta(hours=1))
    store(url, "7", "FAILED", "t4", "pytorch", now - timedelta(days=3))  # ended before the window
    tag = "slurmgpu:d=0123456789ab;m=model"
    scontrol = Scontrol({"1": job_line("1"), "2": job_line("2", requeue=0), "3": job_line("3", restarts=1),
                         "4": job_line("4", comment=tag), "5": job_line("5"), "7": job_line("7")})
    actions = {a.job_id: a for a in retry.retry(db.make_engine(url), config, "slurmgpu", 24, run=scontrol, now=now)}
    assert set(actions) == {"1", "2", "3", "4", "6"}  # 5: no OOM; 7: too old
    assert actions["1"].done and actions["1"].message == (
        "GPU out of memory (pytorch) on t4 (16 GiB); requeued once on 1 x v100 (32 GiB) in partition gpu")
    assert not actions["2"].done and "--no-requeue" in actions["2"].message
    assert not actions["3"].done and "never retried twice" in actions["3"].message
    assert actions["4"].done
    assert not actions["6"].done and "no longer known" in actions["6"].message
    assert scontrol.calls[:3] == [
        ["scontrol", "requeuehold", "1"],
        ["scontrol", "update", "JobId=1", "TresPerNode=gres:gpu:v100:1", "Partition=gpu",
         f"Comment=slurmgpu: {actions['1'].message}"],
        ["scontrol", "release", "1"]]
    assert scontrol.calls[4] == ["scontrol", "update", "JobId=4", "TresPerNode=gres:gpu:v100:1", "Partition=gpu",
                                 f"Comment={tag};r=1"]  # a decision tag keeps its form, marked retried


def test_the_model_and_the_partitions_choose_the_card(url: str) -> None:
    config = load_config(SAMPLE)
    store(url, "1", "FAILED", "t4", "pytorch", datetime(2026, 12, 3, 11, 0))
    now = datetime(2026, 12, 3, 12, 0)
    engine = db.make_engine(url)
    big_only = retry.retry(engine, config, "slurmgpu", run=Scontrol({"1": job_line("1")}), now=now,
                           fits_for=lambda c: lambda card: card.memory_gib >= 80)  # the model: only an a100 holds it
    assert big_only[0].done and "1 x a100 (80 GiB)" in big_only[0].message
    nowhere = retry.retry(engine, config, "slurmgpu", run=Scontrol({"1": job_line("1")}), now=now,
                          partition_ok=lambda name, info: False)
    assert not nowhere[0].done and "no partition with v100 admits the job" in nowhere[0].message
    refused = Scontrol({"1": job_line("1")}, fail="update")
    failed = retry.retry(engine, config, "slurmgpu", run=refused, now=now)
    assert not failed[0].done and "scontrol update failed (Access/permission denied)" in failed[0].message
    assert ["scontrol", "release", "1"] not in refused.calls  # never released onto the card it ran out on


def test_off_unless_the_site_opts_in(url: str, tmp_path: Path) -> None:
    res = subprocess.run([str(BIN / "slurmgpu"), "--config", str(SAMPLE), "--db", url, "retry"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "oom_retry is off" in res.stderr


def _state(job_id: str) -> dict[str, str]:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          check=False).stdout
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


@pytest.mark.slurm
def test_live_oom_job_is_requeued_once_onto_a_larger_card(tmp_path: Path) -> None:
    """Real jobs on t4 print PyTorch's OOM and exit 1; the stored outcome (as the collector and ingest
    leave it, tested in test_oom_outcomes.py) makes `slurmgpu retry` requeue the first once onto a
    v100 in partition gpu; a second run does not requeue it again; a --no-requeue job stays."""
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace("[policy]\n", "[policy]\noom_retry = true\n", 1))
    (tmp_path / "oom.txt").write_text(OOM_LINE + "\n")
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'oom.txt'} >&2\nsleep 2\nexit 1\n")
    name = f"sgpu-retry-{os.getpid()}"
    started = datetime.now(UTC) - timedelta(seconds=5)
    ids = [subprocess.run(["sbatch", "--parsable", "-J", name, "--gres=gpu:t4:1", "-p", "gpu-small", "-t", "5",
                           "-o", "/dev/null", *extra, str(script)], capture_output=True, text=True,
                          check=True).stdout.strip() for extra in ([], ["--no-requeue"])]
    try:
        deadline = time.monotonic() + 60
        while any(_state(j).get("JobState") != "FAILED" for j in ids):
            assert time.monotonic() < deadline, [_state(j).get("JobState") for j in ids]
            time.sleep(0.5)
        url = f"sqlite:///{tmp_path / 'h.db'}"
        db.upgrade(url)
        engine = db.make_engine(url)
        deadline = time.monotonic() + 60
        while True:  # sacct may show a just-finished job a moment late; the ingest is idempotent
            ingest.ingest_sacct(engine, "slurmgpu", since=started.replace(tzinfo=None))
            with engine.connect() as conn:  # ended, and with the GPUs it had (retry needs both)
                states = dict(conn.execute(select(db.Job.job_id, db.Job.state).where(
                    db.Job.job_id.in_(ids), db.Job.gpu_type.is_not(None))).all())
            if all(states.get(j) == "FAILED" for j in ids) or time.monotonic() > deadline:
                break
            time.sleep(1)
        with engine.begin() as conn:
            for job_id in ids:
                conn.execute(db.GpuUsage.__table__.insert().values(
                    cluster="slurmgpu", job_id=job_id, hostname="gpu2", source="nvml", gpus=1, peak_mem_mib=15000.0,
                    samples=3, gpu_oom="pytorch", gpu_oom_line=OOM_LINE, detail=[]))
        cmd = [str(BIN / "slurmgpu"), "--config", str(config), "--db", url, "retry"]
        first = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert first.returncode == 0, first.stderr
        assert f"job {ids[0]}: GPU out of memory (pytorch) on t4 (16 GiB); requeued once on 1 x v100 (32 GiB) " \
               "in partition gpu" in first.stdout
        assert f"job {ids[1]}: asked not to be requeued (--no-requeue): not retried" in first.stdout
        after = _state(ids[0])
        assert (after["Restarts"], after["Partition"], after["TresPerNode"]) == ("1", "gpu", "gres:gpu:v100:1")
        assert _state(ids[1])["Restarts"] == "0"
        second = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert f"job {ids[0]}: already requeued (1x): never retried twice" in second.stdout
        assert _state(ids[0])["Restarts"] == "1"
    finally:
        subprocess.run(["scancel", "-n", name], check=False)
