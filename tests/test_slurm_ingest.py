"""Ingest on the real local Slurm: real jobs, real sacct, then the store holds exactly them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
BIN = Path(sys.executable).parent
FINAL = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL"}

# name -> (sbatch options, expected state, gpu type, gpus, exit code)
JOBS = {
    "ok-a100": (["--gres=gpu:a100:2", "--wrap", "sleep 2"], "COMPLETED", "a100", 2, 0),
    "fail-v100": (["--gpus=v100:1", "--wrap", "exit 3"], "FAILED", "v100", 1, 3),
    "timeout": (["-t", "1", "--gres=gpu:t4:1", "-p", "gpu-small", "--wrap", "sleep 600"], "TIMEOUT", "t4", 1, 0),
    "cancel": (["--gres=gpu:v100:2", "--wrap", "sleep 600"], "CANCELLED", "v100", 2, 0),
    "cpu-only": (["--wrap", "true"], "COMPLETED", None, 0, 0),
}
ARRAY = (["--array=0-2", "--gpus-per-node=t4:1", "-p", "gpu-small", "--wrap", "sleep 1"], "COMPLETED", "t4", 1)


def sbatch(*args: str, cwd: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd, check=True)
    return out.stdout.strip().split(";")[0]


def states(ids: list[str]) -> dict[str, str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(ids)],
                         capture_output=True, text=True, check=True).stdout
    return {line.split("|")[0]: line.split("|")[1].split()[0] for line in out.splitlines() if line}


def slurmgpu(*args: str, db: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "slurmgpu"), "--db", db, *args], capture_output=True, text=True, check=False,
                          timeout=120)


@pytest.fixture(scope="module")
def finished_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    cwd = tmp_path_factory.mktemp("jobs")
    started = datetime.now(UTC)
    ids = {name: sbatch(*opts, "-J", name, cwd=cwd) for name, (opts, *_rest) in JOBS.items()}
    array_id = sbatch(*ARRAY[0], "-J", "array", cwd=cwd)
    deadline = time.monotonic() + 420
    cancelled = False
    while time.monotonic() < deadline:
        now = states([*ids.values(), array_id])
        if not cancelled and now.get(ids["cancel"]) == "RUNNING":
            subprocess.run(["scancel", ids["cancel"]], check=True)
            cancelled = True
        expected = {*ids.values(), *(f"{array_id}_{i}" for i in range(3))}
        if expected <= now.keys() and all(now[j] in FINAL for j in expected):
            break
        time.sleep(3)
    else:
        pytest.fail(f"jobs did not finish in time: {states([*ids.values(), array_id])}")
    time.sleep(2)  # sacct's record of the last job lags its state a little
    return {"ids": ids, "array": array_id, "started": started}


def test_ingest_holds_exactly_the_submitted_jobs(finished_jobs: dict, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'h.db'}"
    assert slurmgpu("db", "upgrade", db=db).returncode == 0
    since = (finished_jobs["started"] - timedelta(seconds=5)).astimezone().strftime("%Y-%m-%dT%H:%M:%S")
    first = slurmgpu("ingest", "--cluster", "slurmgpu", "--since", since, "--no-spool", db=db)
    assert first.returncode == 0, first.stderr
    rows = json.loads(slurmgpu("jobs", "--json", "--since", since, db=db).stdout)
    by_id = {r["job_id"]: r for r in rows}
    ids, array_id = finished_jobs["ids"], finished_jobs["array"]
    ours = {j for j in by_id if j in ids.values() or j.startswith(f"{array_id}_")}
    assert ours == {*ids.values(), *(f"{array_id}_{i}" for i in range(3))}
    for name, (_opts, state, gtype, count, exit_code) in JOBS.items():
        r = by_id[ids[name]]
        assert (r["state"], r["gpu_type"], r["gpu_count"], r["exit_code"]) == (state, gtype, count, exit_code), name
        assert r["partition"] == ("gpu-small" if name == "timeout" else "gpu")
        submit, start, end = (datetime.fromisoformat(r[k].rstrip("Z")) for k in ("submit_time", "start_time",
                                                                                    "end_time"))
        assert finished_jobs["started"].replace(tzinfo=None) - timedelta(seconds=5) <= submit <= start <= end
        assert abs((end - start).total_seconds() - r["elapsed_s"]) <= 1
    assert by_id[ids["cancel"]]["state_detail"] == "CANCELLED by 0"
    assert by_id[ids["timeout"]]["elapsed_s"] >= 60
    for i in range(3):
        r = by_id[f"{array_id}_{i}"]
        assert (r["state"], r["gpu_type"], r["gpu_count"]) == ("COMPLETED", "t4", 1)
    again = slurmgpu("ingest", "--cluster", "slurmgpu", "--since", since, "--no-spool", db=db)
    assert again.returncode == 0, again.stderr
    assert re.search(r"^0 jobs inserted, 0 updated, \d+ unchanged", again.stdout), again.stdout
    assert json.loads(slurmgpu("jobs", "--json", "--since", since, db=db).stdout) == rows


def _gsbatch_site(tmp_path: Path, config: Path, directives: str, command: str) -> tuple[Path, dict[str, str], Path]:
    """A submission spool, gsbatch's environment writing into it, and a one-line job script."""
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(config), "SLURMGPU_SUBMISSION_SPOOL": str(spool)}
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH {directives}\n{command}\n")
    return spool, env, script


def test_concurrent_gsbatch_submissions_lose_no_record(tmp_path: Path, sample_config: Path) -> None:
    spool, env, script = _gsbatch_site(tmp_path, sample_config, "-p gpu-small --gres=gpu:a100:1 -t 1", "sleep 1")
    procs = [subprocess.Popen([str(BIN / "gsbatch"), "--hold", "--parsable", str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env) for _ in range(20)]
    job_ids = set()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        job_ids.add(out.strip())
    subprocess.run(["scancel", *job_ids], check=False)
    db = f"sqlite:///{tmp_path / 'h.db'}"
    slurmgpu("db", "upgrade", db=db)
    res = subprocess.run([str(BIN / "slurmgpu"), "--db", db, "ingest", "--cluster", "slurmgpu", "--since",
                          datetime.now().strftime("%Y-%m-%dT%H:%M:%S")], capture_output=True, text=True, env=env,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert "20 spool records loaded, 0 rejected" in res.stdout
    assert list(spool.iterdir()) == []
    from sqlalchemy import select

    from slurmgpu.history.db import Submission, make_engine

    with make_engine(db).connect() as conn:
        rows = conn.execute(select(Submission.job_id, Submission.changed, Submission.decision)).all()
    assert {r.job_id for r in rows} == job_ids and len(rows) == 20
    assert all(r.changed and r.decision["changes"][0]["partition"] == "gpu" for r in rows)


def test_submissions_during_ingests_lose_no_record(tmp_path: Path, sample_config: Path) -> None:
    """Issue 27's held attack, kept as a test: 30 gsbatch submissions, 10 at once, while the ingest runs
    again and again over the same spool. A record read while it is being written would be set aside
    as malformed; every one must be stored, none rejected, none half-read."""
    import threading

    spool, env, script = _gsbatch_site(tmp_path, sample_config, "-p gpu-small --gres=gpu:a100:1 -t 1", "sleep 1")
    db = f"sqlite:///{tmp_path / 'h.db'}"
    slurmgpu("db", "upgrade", db=db)
    since = (datetime.now() - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S")
    ingest = [str(BIN / "slurmgpu"), "--db", db, "ingest", "--cluster", "slurmgpu", "--since", since]
    outputs: list[str] = []
    stop = threading.Event()

    def ingest_loop() -> None:
        while not stop.is_set() and len(outputs) < 60:  # bounded: it stops by itself
            res = subprocess.run(ingest, capture_output=True, text=True, env=env, check=False, timeout=120)
            outputs.append(res.stdout + res.stderr)

    loop = threading.Thread(target=ingest_loop)
    loop.start()
    try:
        job_ids = set()
        for _ in range(3):  # three waves of 10, each once another ingest has finished
            ran = len(outputs)
            procs = [subprocess.Popen([str(BIN / "gsbatch"), "--hold", "--parsable", str(script)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                      env=env) for _ in range(10)]
            for p in procs:
                out, err = p.communicate(timeout=180)
                assert p.returncode == 0, err
                job_ids.add(out.strip())
            deadline = time.monotonic() + 120
            while len(outputs) == ran and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        stop.set()
        loop.join(300)
    subprocess.run(["scancel", *job_ids], check=False)
    final = subprocess.run(ingest, capture_output=True, text=True, env=env, check=False, timeout=120)
    assert final.returncode == 0, final.stderr
    assert len(outputs) >= 3, "the ingest did not run while gsbatch submitted"
    assert not [o for o in outputs + [final.stdout] if re.search(r"[1-9]\d* rejected", o)], outputs
    assert list(spool.iterdir()) == []
    from sqlalchemy import select

    from slurmgpu.history.db import Submission, make_engine

    with make_engine(db).connect() as conn:
        rows = conn.execute(select(Submission.job_id)).all()
    assert sorted(r.job_id for r in rows) == sorted(job_ids)


def test_a_held_job_cancelled_before_eligible_gets_its_record(tmp_path: Path, sample_config: Path) -> None:
    """sacct's time window never shows a job cancelled while held (it never became eligible), so its
    record waited for it until given up; the ingest asks sacct for it by id and stores it."""
    spool, env, script = _gsbatch_site(tmp_path, sample_config, "-p gpu --gres=gpu:v100:1 -t 1", "true")
    since = (datetime.now() - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S")
    res = subprocess.run([str(BIN / "gsbatch"), "--hold", "--parsable", str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, check=True)
    job = res.stdout.strip().split(";")[0]
    subprocess.run(["scancel", job], check=True)
    deadline = time.monotonic() + 30  # until slurmdbd has its full row (a stand-in has no partition)
    while time.monotonic() < deadline and subprocess.run(
            ["sacct", "-X", "-n", "-P", "-o", "Partition", "-j", job], capture_output=True, text=True,
            check=False).stdout.strip() != "gpu":
        time.sleep(0.5)
    [record] = spool.iterdir()
    old = time.time() - 20 * 60  # the ingest asks by id only for records 10 minutes old or more
    os.utime(record, (old, old))
    window = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "--allusers", "--starttime", since,
                             "--endtime", "now"], capture_output=True, text=True, check=True).stdout.split()
    assert job not in window  # what the time window misses
    db = f"sqlite:///{tmp_path / 'h.db'}"
    slurmgpu("db", "upgrade", db=db)
    out = subprocess.run([str(BIN / "slurmgpu"), "--db", db, "ingest", "--cluster", "slurmgpu", "--since", since],
                         capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert "1 spool records loaded, 0 rejected" in out.stdout and "waiting" not in out.stdout, out.stdout
    assert list(spool.iterdir()) == []
    rows = json.loads(slurmgpu("jobs", "--json", "--job", job, db=db).stdout)
    assert [(r["job_id"], r["state"]) for r in rows] == [(job, "CANCELLED")], (out.stdout, out.stderr)
