"""`slurmgpu retry`: a GPU-OOM job is requeued once onto a card that holds it, never twice, never
one that asked not to be requeued. Unit level with scripted scontrol answers; live on the local Slurm."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, inspect, select
from sqlalchemy.exc import IntegrityError

from slurmgpu.apps import retry
from slurmgpu.history import db, ingest
from slurmgpu.pipeline.config import load_config
from slurmgpu.slurm.sacct import JobRecord

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = Path(sys.executable).parent
OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


def store(url: str, job_id: str, state: str, gpu_type: str, oom: str | None, end: datetime,
          retry_of: str | None = None) -> None:
    """A job as the ingest stores it: sacct's row and the collector's GPU record with its finding."""
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(db.Job.__table__.insert().values(
            cluster="slurmgpu", job_id=job_id, job_id_raw=int(job_id), user=ME, state=state, retry_of=retry_of,
            gpu_type=gpu_type, gpu_count=1, submit_time=end - timedelta(minutes=5), end_time=end))
        conn.execute(db.GpuUsage.__table__.insert().values(
            cluster="slurmgpu", job_id=job_id, hostname="gpu2", source="nvml", gpus=1, peak_mem_mib=16000.0,
            samples=3, gpu_oom=oom, gpu_oom_line=OOM_LINE if oom else None, detail=[]))


ME = pwd.getpwuid(os.getuid()).pw_name  # a user this host knows: retry submits as the job's owner
SCRIPT = "#!/bin/sh\n#SBATCH -t 5\npython train.py\n"


class Slurm:
    """Slurm as seen by retry: ``show job`` answers per job id (a new job's from ``held``, then
    ``released``), ``write batch_script`` gives SCRIPT, sbatch gives job ids from 100 on; every call
    but ``show job`` is recorded with its stdin."""

    def __init__(self, jobs: dict[str, str], fail: str | None = None, held: str | None = None,
                 released: str = "PENDING Priority", on_sbatch: Any = None) -> None:
        self.jobs, self.fail, self.calls = dict(jobs), fail, []  # type: ignore[var-annotated]
        self.held, self.released, self.on_sbatch, self.next_id = held, released, on_sbatch, 100

    def __call__(self, argv: Any, input: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        if argv[1:3] == ["show", "job"]:
            line = self.jobs.get(argv[-1])
            return subprocess.CompletedProcess(argv, 0 if line else 1, line or "", "" if line else "Invalid job id")
        self.calls.append((argv, input))
        out = ""
        if argv[:1] == ["runuser"] and self.fail != "sbatch":
            new, self.next_id = str(self.next_id), self.next_id + 1
            words = dict(w[2:].split("=", 1) for w in argv if w.startswith("--") and "=" in w)
            gres = words.get("gres", "gpu:t4:1")
            self.jobs[new] = self.held or (
                f"JobId={new} JobName=train UserId={ME}({os.getuid()}) JobState=PENDING Reason=JobHeldUser Requeue=1 "
                f"Partition={words.get('partition')} TRES=cpu=1,gres/gpu=1,gres/{gres.replace(':', '/', 1)[:-2]}=1 "
                f"TresPerNode=gres:{gres}")
            if self.on_sbatch:
                self.on_sbatch(new)
            out = new + "\n"
        elif argv[1:2] == ["release"]:
            state, reason = self.released.split()
            self.jobs[argv[2]] = self.jobs[argv[2]].replace("JobState=PENDING Reason=JobHeldUser",
                                                            f"JobState={state} Reason={reason}")
        elif argv[1:3] == ["write", "batch_script"]:
            out = SCRIPT
        failed = self.fail is not None and self.fail in argv[:2]
        return subprocess.CompletedProcess(argv, 1 if failed else 0, out, "Access/permission denied" if failed else "")

    def submitted(self) -> list[tuple[list[str], str | None]]:
        return [(argv, stdin) for argv, stdin in self.calls if argv[0] == "runuser"]


def job_line(job_id: str, *, requeue: int = 1, state: str = "FAILED", comment: str = "",
             user: str = f"{ME}({os.getuid()})") -> str:
    return (f"JobId={job_id} JobName=train UserId={user} GroupId=g(1) JobState={state} "
            f"Reason=NonZeroExitCode Requeue={requeue} Restarts=0 TimeLimit=01:00:00 Partition=gpu-small "
            f"Account=ml QOS=normal NumNodes=1 NumTasks=1 CPUs/Task=2 MinMemoryNode=4G WorkDir=/home/x "
            f"StdOut=/home/x/slurm-{job_id}.out StdErr=/home/x/slurm-{job_id}.out StdIn=/dev/null "
            f"Comment={comment} TresPerNode=gres:gpu:t4:1")


@pytest.fixture
def url(tmp_path: Path) -> str:
    u = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(u)
    return u


def retry_links(url: str) -> dict[str, str]:
    with db.make_engine(url).connect() as conn:
        return dict(conn.execute(select(db.Job.retry_of, db.Job.job_id).where(db.Job.retry_of.is_not(None))).all())


def test_each_rule(url: str) -> None:
    """A new job as the owner, held, from the job's own script with the decided GPUs, linked in the
    history; never requeued in place (22.05 keeps the old gres beside the new)."""
    config = load_config(SAMPLE)
    now = datetime(2026, 12, 3, 12, 0)
    for job_id, oom in (("1", "pytorch"), ("2", "jax"), ("3", "pytorch"), ("4", "pytorch"), ("5", None),
                        ("6", "pytorch"), ("8", "pytorch")):
        store(url, job_id, "FAILED", "t4", oom, now - timedelta(hours=1))
    store(url, "7", "FAILED", "t4", "pytorch", now - timedelta(days=3))  # ended before the window
    store(url, "30", "COMPLETED", "v100", None, now - timedelta(hours=1), retry_of="3")  # 3 was retried before
    store(url, "9", "FAILED", "t4", "pytorch", now - timedelta(hours=1), retry_of="90")  # 9 is a retry itself
    tag = "slurmgpu:d=0123456789ab;m=model"
    slurm = Slurm({"1": job_line("1"), "2": job_line("2", requeue=0), "3": job_line("3"),
                   "4": job_line("4", comment=tag), "5": job_line("5"), "7": job_line("7"),
                   "8": job_line("8", user="nobody(65534)"), "9": job_line("9")})
    actions = {a.job_id: a for a in retry.retry(db.make_engine(url), config, "slurmgpu", 24, run=slurm, now=now)}
    assert set(actions) == {"1", "2", "3", "4", "6", "8", "9"}  # 5: no OOM; 7: too old
    assert actions["1"].done and actions["1"].message == (
        "GPU out of memory (pytorch) on t4 (16 GiB); retried once as job 100 on 1 x v100 (32 GiB) in partition gpu "
        "(PENDING, Priority)")
    assert not actions["2"].done and "--no-requeue" in actions["2"].message
    assert actions["3"].message == "already retried as job 30: never retried twice"
    assert actions["4"].done and "as job 101 " in actions["4"].message
    assert not actions["6"].done and "no longer known" in actions["6"].message
    assert actions["8"].message == f"owner nobody(65534) is not the stored user {ME} here: not retried"
    assert actions["9"].message == "a retry of job 90 itself: never retried twice"
    assert not any(argv[1] in ("requeue", "requeuehold", "update") for argv, _ in slurm.calls)
    (first, script), (second, _) = slurm.submitted()[:2]
    assert first[:4] == ["runuser", "-u", ME, "--"] and first[first.index("--parsable") + 1] == "--hold"
    assert {"--gres=gpu:v100:1", "--partition=gpu", "--job-name=train", "--chdir=/home/x", "--account=ml",
            "--qos=normal", "--nodes=1", "--ntasks=1", "--cpus-per-task=2", "--mem=4G", "--time=01:00:00",
            "--comment=slurmgpu: retry of job 1 after a GPU out of memory (pytorch) on t4 (16 GiB), on 1 x v100 "
            "(32 GiB) in partition gpu"} <= set(first)
    assert not any(w.startswith(("--output", "--error", "--input", "--open-mode")) or "gpu:t4" in w for w in first)
    assert script is not None and script.startswith("#!/bin/sh\n# slurmgpu: GPU request rewritten by the retry")
    assert script.endswith("#SBATCH -t 5\npython train.py\n")  # the job's own script, below the provenance
    assert f"--comment={tag}" in second  # the user's Comment as they wrote it (a tag there is only their text)
    assert ["scontrol", "release", "100"] in [argv for argv, _ in slurm.calls]
    assert retry_links(url) == {"1": "100", "3": "30", "4": "101", "90": "9"}
    again = {a.job_id: a for a in retry.retry(db.make_engine(url), config, "slurmgpu", 24, run=slurm, now=now)}
    assert again["1"].message == "already retried as job 100: never retried twice" and len(slurm.submitted()) == 2


def test_the_model_and_the_partitions_choose_the_card(url: str) -> None:
    config = load_config(SAMPLE)
    store(url, "1", "FAILED", "t4", "pytorch", datetime(2026, 12, 3, 11, 0))
    now = datetime(2026, 12, 3, 12, 0)
    engine = db.make_engine(url)
    nowhere = retry.retry(engine, config, "slurmgpu", run=Slurm({"1": job_line("1")}), now=now,
                          partition_ok=lambda name, info: False)
    assert not nowhere[0].done and "no partition with v100 admits the job" in nowhere[0].message
    refused = Slurm({"1": job_line("1")}, fail="runuser")
    failed = retry.retry(engine, config, "slurmgpu", run=refused, now=now)
    assert not failed[0].done and "sbatch failed (Access/permission denied)" in failed[0].message
    assert retry_links(url) == {}
    big_only = retry.retry(engine, config, "slurmgpu", run=Slurm({"1": job_line("1")}), now=now,
                           fits_for=lambda c: lambda card: card.memory_gib >= 80)  # the model: only an a100 holds it
    assert big_only[0].done and "1 x a100 (80 GiB)" in big_only[0].message


def test_a_retry_not_as_decided_is_cancelled(url: str) -> None:
    """Held with the old card still in its TRES, or released into BadConstraints, or raced by another
    run: the new job is cancelled, said so, and (but for the race's winner) nothing is linked."""
    config = load_config(SAMPLE)
    now = datetime(2026, 12, 3, 12, 0)
    store(url, "1", "FAILED", "t4", "pytorch", now - timedelta(hours=1))
    engine = db.make_engine(url)
    both = Slurm({"1": job_line("1")}, held=f"JobId=100 UserId={ME}({os.getuid()}) JobState=PENDING Reason=JobHeldUser "
                 "Partition=gpu TRES=cpu=1,gres/gpu=1,gres/gpu:t4=1,gres/gpu:v100=1 TresPerNode=gres:gpu:v100:1")
    [kept_t4] = retry.retry(engine, config, "slurmgpu", run=both, now=now)
    assert not kept_t4.done and kept_t4.message == ("sbatch failed to ask for 1 x v100 (32 GiB) in partition gpu "
                                                    "(job 100: GPUs cpu=1,gres/gpu=1,gres/gpu:t4=1,gres/gpu:v100=1): "
                                                    "job 100 cancelled")
    assert (["scancel", "100"], None) in both.calls and retry_links(url) == {}
    stuck = Slurm({"1": job_line("1")}, released="PENDING BadConstraints")
    [never] = retry.retry(engine, config, "slurmgpu", run=stuck, now=now)
    assert not never.done and "failed to become eligible (PENDING, BadConstraints): cancelled" in never.message
    assert (["scancel", "100"], None) in stuck.calls


def test_two_runs_at_once_submit_one_retry(url: str) -> None:
    config = load_config(SAMPLE)
    now = datetime(2026, 12, 3, 12, 0)
    store(url, "1", "FAILED", "t4", "pytorch", now - timedelta(hours=1))
    engine = db.make_engine(url)

    def other_run_wins(new: str) -> None:  # between this run's check and its sbatch
        with engine.begin() as conn:
            conn.execute(insert(db.Job).values(cluster="slurmgpu", job_id="99", state="PENDING", retry_of="1"))

    slurm = Slurm({"1": job_line("1")}, on_sbatch=other_run_wins)
    [lost] = retry.retry(engine, config, "slurmgpu", run=slurm, now=now)
    assert lost.message == "retried by another run meanwhile: job 100 cancelled"
    assert (["scancel", "100"], None) in slurm.calls
    assert ["scontrol", "release", "100"] not in [argv for argv, _ in slurm.calls]
    assert retry_links(url) == {"1": "99"}


def test_the_link_on_every_database(db_url: str) -> None:
    """Migration 0004 on SQLite, PostgreSQL and MariaDB: one retry per job (unique), an ingest of the
    retry's sacct row keeps the link, and 0004 goes down and up again."""
    engine = db.make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(insert(db.Job).values(cluster="c1", job_id="11", state="PENDING", retry_of="10"))
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(insert(db.Job).values(cluster="c1", job_id="12", state="PENDING", retry_of="10"))
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(cluster="c1", job_id="11", state="COMPLETED", gpu_type="v100", gpu_count=1, user="alice")
    assert ingest.load_jobs(engine, [JobRecord(values, 1)]).updated == 1
    with engine.connect() as conn:
        assert conn.execute(select(db.Job.state, db.Job.retry_of).where(db.Job.job_id == "11")).one() == (
            "COMPLETED", "10")
    engine.dispose()
    db.downgrade(db_url, "0003")
    assert "retry_of" not in {c["name"] for c in inspect(db.make_engine(db_url)).get_columns("jobs")}
    db.upgrade(db_url)
    assert db.current_revision(db_url) == "0004"


def test_off_unless_the_site_opts_in(url: str, tmp_path: Path) -> None:
    res = subprocess.run([str(BIN / "slurmgpu"), "--config", str(SAMPLE), "--db", url, "retry"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "oom_retry is off" in res.stderr


def _state(job_id: str) -> dict[str, str]:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          check=False).stdout
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def _wait(job_ids: list[str], states: tuple[str, ...], seconds: float) -> dict[str, dict[str, str]]:
    deadline = time.monotonic() + seconds
    while True:
        shown = {j: _state(j) for j in job_ids}
        if all(s.get("JobState") in states for s in shown.values()):
            return shown
        assert time.monotonic() < deadline, {j: (s.get("JobState"), s.get("Reason")) for j, s in shown.items()}
        time.sleep(0.5)


@pytest.mark.slurm
def test_live_oom_job_runs_again_on_the_decided_card(tmp_path: Path) -> None:
    """sguser's jobs print PyTorch's OOM and exit 1 the first time: one on t4 in gpu-small, one on v100
    in gpu, one --no-requeue. `slurmgpu retry` (as root) submits each of the first two again as a new
    job of sguser's, on v100 in gpu and on a100 in gpu, which runs there, holding that card alone,
    and completes; the failed jobs are linked; a second run submits nothing; the --no-requeue job stays.
    (Before: requeued in place, the t4 job pended for good with BadConstraints, TRES t4 and v100.)"""
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace("[policy]\n", "[policy]\noom_retry = true\n", 1))
    work = Path(tempfile.mkdtemp(prefix="sgpu-retry-", dir="/tmp"))
    shutil.chown(work, "sguser")
    (work / "job.sh").write_text(f"#!/bin/sh\n#SBATCH -t 5\nif [ ! -e {work}/ran.$SLURM_JOB_NAME ]; then\n"
                                 f"  touch {work}/ran.$SLURM_JOB_NAME\n  echo '{OOM_LINE}' >&2\n  exit 1\nfi\n")
    name = f"sgpu-retry-{os.getpid()}"
    started = datetime.now(UTC) - timedelta(seconds=5)
    ids = [subprocess.run(["runuser", "-u", "sguser", "--", "sbatch", "--parsable", "-J", f"{name}-{n}", *extra,
                           f"--chdir={work}", "-o", "/dev/null", str(work / "job.sh")], capture_output=True, text=True,
                          check=True).stdout.strip()
           for n, extra in enumerate((["--gres=gpu:t4:1", "-p", "gpu-small"], ["--gres=gpu:v100:1", "-p", "gpu"],
                                      ["--gres=gpu:t4:1", "-p", "gpu-small", "--no-requeue"]))]
    try:
        _wait(ids, ("FAILED",), 60)
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
        assert first.returncode == 0, first.stdout + first.stderr
        links = retry_links(url)
        assert set(links) == set(ids[:2]), first.stdout
        for job_id, was, card, mem in ((ids[0], "t4 (16", "v100", 32), (ids[1], "v100 (32", "a100", 80)):
            assert f"job {job_id}: GPU out of memory (pytorch) on {was} GiB); retried once as job {links[job_id]} " \
                   f"on 1 x {card} ({mem} GiB) in partition gpu (" in first.stdout
        assert f"job {ids[2]}: asked not to be requeued (--no-requeue): not retried" in first.stdout
        done = _wait([links[ids[0]], links[ids[1]]], ("COMPLETED",), 90)
        for job_id, card, old in ((ids[0], "v100", "t4"), (ids[1], "a100", "v100")):
            new = done[links[job_id]]
            assert new["UserId"].startswith("sguser(") and new["Partition"] == "gpu" and new["NodeList"] == "gpu1"
            assert f"gres/gpu:{card}=1" in new["TRES"] and f"gpu:{old}" not in new["TRES"], new["TRES"]
            assert new["TresPerNode"] == f"gres:gpu:{card}:1" and new["Restarts"] == "0"
        comment = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "Comment", "-j", links[ids[0]]], capture_output=True,
                                 text=True, check=False).stdout.strip()
        assert comment in ("", f"slurmgpu: retry of job {ids[0]} after a GPU out of memory (pytorch) on t4 (16 GiB), "
                               "on 1 x v100 (32 GiB) in partition gpu")  # "" while sacct has not caught up
        second = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert f"job {ids[0]}: already retried as job {links[ids[0]]}: never retried twice" in second.stdout
        assert retry_links(url) == links and _state(ids[2])["JobState"] == "FAILED"
    finally:
        subprocess.run(["scancel", *ids, *retry_links(url).values()] if "url" in locals() else ["scancel", *ids],
                       check=False)
        shutil.rmtree(work, ignore_errors=True)
