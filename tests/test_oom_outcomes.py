"""GPU-OOM outcomes (collector -> record v2 -> store -> learner) and decision tags (plan -> comment ->
ingest link): unit level here, live on the local Slurm in the tests marked ``slurm``."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from slurmgpu.collector import monitor, records
from slurmgpu.collector.records import read_record
from slurmgpu.history import db, ingest
from slurmgpu.learning import train
from slurmgpu.pipeline import spool
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.decision_tag import decision_tag, make_tag, parse_tag
from slurmgpu.slurm.sacct import JobRecord

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "fixtures" / "nvml_trace_2xa100.json"
TORCH = ROOT / "tests" / "fixtures" / "oom" / "gpu-torch-2.2.txt"
BIN = Path(sys.executable).parent


def torch_oom_text() -> str:
    return "".join(ln for ln in TORCH.read_text().splitlines(keepends=True) if not ln.startswith("# source:"))


def run_collector(spool_dir: Path, job_id: str, *extra: str) -> records.JobRecord:
    assert monitor.main(["run", "--job-id", job_id, "--cluster", "c1", "--spool", str(spool_dir),
                         "--recorded", str(TRACE), "--interval", "0.001", "--duration", "5", *extra]) == 0
    [name] = [n for n in os.listdir(spool_dir) if n.startswith(f"c1_{job_id}_")]
    return read_record(str(spool_dir / name))


# ---- the record -------------------------------------------------------------------------------

def test_collector_records_the_oom_found_in_the_named_stderr(tmp_path: Path) -> None:
    err = tmp_path / "job.err"
    err.write_text("epoch 1\n" + torch_oom_text())
    (tmp_path / "spool").mkdir()
    rec = run_collector(tmp_path / "spool", "77", "--stderr", str(err))
    assert rec.version == 2 and rec.gpu_oom is not None and rec.gpu_oom.framework == "pytorch"
    assert rec.gpu_oom.line.startswith("torch.cuda.OutOfMemoryError: CUDA out of memory.")
    assert len(rec.gpu_oom.line) <= records.MAX_STR


def test_no_oom_clean_stderr_missing_stderr_or_scan_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = tmp_path / "job.err"
    err.write_text("Traceback ...\nValueError: bad input\n")
    for n, extra in enumerate((["--stderr", str(err)], ["--stderr", str(tmp_path / "missing")], ["--no-oom-scan"])):
        (tmp_path / f"s{n}").mkdir()
        assert run_collector(tmp_path / f"s{n}", "78", *extra).gpu_oom is None
    assert capsys.readouterr().err == ""


def test_looked_up_stderr_is_read_only_when_the_jobs_user_owns_it(tmp_path: Path) -> None:
    err = tmp_path / "job.err"
    err.write_text(torch_oom_text())
    me = os.getuid()
    found = monitor.gpu_oom_outcome("5", None, {"SLURM_JOB_UID": str(me)}, lookup=lambda j: str(err))
    assert found is not None and found.framework == "pytorch"
    # a job of another user naming this file (e.g. --error pointing at it) gets nothing from it
    assert monitor.gpu_oom_outcome("5", None, {"SLURM_JOB_UID": str(me + 1)}, lookup=lambda j: str(err)) is None
    assert monitor.gpu_oom_outcome("5", None, {"SLURM_JOB_UID": str(me)}, lookup=lambda j: None) is None


def test_stderr_path_parsed_from_scontrol_with_spaces(monkeypatch: pytest.MonkeyPatch) -> None:
    line = ("JobId=5 JobName=x UserId=u(1) Comment=(null) WorkDir=/w StdErr=/home/a b/x.err StdIn=/dev/null "
            "StdOut=/home/a b/x.out Power=\n")
    monkeypatch.setattr(monitor.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=line, stderr=""))
    assert monitor.job_stderr("5") == "/home/a b/x.err"
    monkeypatch.setattr(monitor.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="", stderr="Invalid job id"))
    assert monitor.job_stderr("5") is None


def test_version_1_records_still_load_and_version_2_needs_the_field(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    rec = run_collector(tmp_path / "s", "79", "--no-oom-scan")
    data = records.record_to_json(rec)
    v1 = {k: v for k, v in data.items() if k != "gpu_oom"} | {"version": 1}
    assert records.parse_record(json.dumps(v1).encode(), "w").gpu_oom is None
    with pytest.raises(ValueError, match="^w: gpu_oom: missing"):
        records.parse_record(json.dumps({k: v for k, v in data.items() if k != "gpu_oom"}).encode(), "w")
    for bad, msg in (({"framework": "pytorch"}, "gpu_oom.line: missing"),
                     ({"framework": "Py Torch", "line": "x"}, "gpu_oom.framework: expected a short lower-case"),
                     ({"framework": "cuda", "line": "x" * 300}, "gpu_oom.line: expected string of at most 256"),
                     ("pytorch", "gpu_oom: expected an object")):
        with pytest.raises(ValueError, match=f"^w: {msg}"):
            records.parse_record(json.dumps({**data, "gpu_oom": bad}).encode(), "w")


# ---- the store and the learner ----------------------------------------------------------------

def sacct_job(job_id: str, state: str, comment: str | None = None, user: str = "alice",
              admin_comment: str | None = None) -> JobRecord:
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(cluster="c1", job_id=job_id, job_id_raw=int(job_id), state=state, gpu_count=1, gpu_type="t4",
                  user=user, submit_time=datetime(2026, 12, 1, 10), elapsed_s=40, comment=comment,
                  admin_comment=admin_comment)
    values.pop("decision_id")  # sacct's rows do not have it: the ingest reads it from the AdminComment
    return JobRecord(values, 1)


def test_ingest_stores_the_outcome_and_gpu_oom_marks_it_whatever_the_state(db_url: str, tmp_path: Path) -> None:
    engine = db.make_engine(db_url)
    spool_dir = tmp_path / "gpu"
    spool_dir.mkdir()
    err = tmp_path / "job.err"
    err.write_text(torch_oom_text())
    recs = {job_id: run_collector(spool_dir, job_id, *(["--stderr", str(err)] if job_id != "4" else ["--no-oom-scan"]))
            for job_id in ("1", "2", "3", "4")}
    ingest.load_jobs(engine, [sacct_job("1", "FAILED", "script:python train.py --model resnet50 --batch-size 64"),
                              sacct_job("2", "TIMEOUT", "script:python train.py --model resnet50 --batch-size 64"),
                              sacct_job("3", "COMPLETED", "script:python train.py --model resnet50 --batch-size 64"),
                              sacct_job("4", "FAILED", "script:python train.py --model resnet50 --batch-size 64")])
    report = ingest.load_gpu_records(engine, str(spool_dir))
    assert report.files_loaded == 4 and not report.files_rejected
    with engine.connect() as conn:
        stored = dict(conn.execute(select(db.GpuUsage.job_id, db.GpuUsage.gpu_oom)).all())
        line = conn.execute(select(db.GpuUsage.gpu_oom_line).where(db.GpuUsage.job_id == "1")).scalar()
    assert stored == {"1": "pytorch", "2": "pytorch", "3": "pytorch", "4": None}
    assert line.startswith("torch.cuda.OutOfMemoryError")
    config = load_config(str(ROOT / "contrib" / "slurmgpu.toml"))
    rows = {r["job_id"]: r for r in train.history_rows(engine)}
    # the trace's peak (61952 MiB) is far above a T4's 16 GiB... so make the peak say nothing: only the message
    marked = {j: train.gpu_oom({**r, "peak": None}, config) for j, r in rows.items()}
    assert marked == {"1": True, "2": True, "3": False, "4": False}
    # The GPUs each job kept busy, as the collector saw them per GPU (the decider trims on these).
    busy = {j: sum(g.max_util >= 5.0 or g.peak_mem_mib >= 256 for g in rec.gpus) for j, rec in recs.items()}
    assert {j: r["gpus_used"] for j, r in rows.items()} == busy and 0 < busy["3"] <= len(recs["3"].gpus)


# ---- decision tags ----------------------------------------------------------------------------

def test_tag_format_round_trip_and_retry_mark() -> None:
    tag = make_tag("0123456789ab", "model", 13.26, 41.6)
    assert tag == "slurmgpu:d=0123456789ab;m=model;p=13.3;t=42" and " " not in tag
    assert parse_tag(tag) == {"d": "0123456789ab", "m": "model", "p": "13.3", "t": "42"}
    for other in (None, "", "script:python x.py", "my own words", tag + " and more", "slurmgpu:d=XYZ"):
        assert parse_tag(other) is None
    decision = {"decider": "model", "changes": [{"index": 0, "gpu_type": "t4", "gpus_total": 1}],
                "per_type": [{"gpu_type": "a100", "gpus": 1, "pred_peak_mem_mib": 9000.0, "pred_runtime_s": 600.0},
                             {"gpu_type": "t4", "gpus": 1, "pred_peak_mem_mib": 9216.0, "pred_runtime_s": 1800.0}]}
    assert decision_tag(decision, "0123456789ab", "a100", 1) == "slurmgpu:d=0123456789ab;m=model;p=9.0;t=30"
    kept = {**decision, "changes": []}
    assert decision_tag(kept, "0123456789ab", "a100", 1) == "slurmgpu:d=0123456789ab;m=model;p=8.8;t=10"


def test_ingest_links_a_job_to_its_decision_only_for_the_same_user(db_url: str, tmp_path: Path) -> None:
    engine = db.make_engine(db_url)
    me = pwd.getpwuid(os.getuid()).pw_name
    spool_dir = tmp_path / "sub"
    spool_dir.mkdir()
    tag = make_tag("00000000abcd", "model", 3.0, 5)
    spool.write_record(str(spool_dir), spool.new_record(
        cluster="c1", job_id="10", script_sha256=None, sbatch_exit=0, features={}, original_request={},
        decision={"decider": "model", "changed": False, "id": "00000000abcd"}, changed=False))
    ingest.load_jobs(engine, [sacct_job("10", "COMPLETED", "my own words", user=me, admin_comment=tag),
                              sacct_job("11", "COMPLETED", user="mallory", admin_comment=tag),  # not the user's
                              sacct_job("12", "COMPLETED", "script:python x.py", user=me),
                              sacct_job("13", "COMPLETED", tag, user=me)])  # a tag the user wrote: not believed
    assert ingest.load_submissions(engine, str(spool_dir)).files_loaded == 1
    with engine.connect() as conn:
        ids = dict(conn.execute(select(db.Job.job_id, db.Job.decision_id)).all())
        assert ids == {"10": "00000000abcd", "11": "00000000abcd", "12": None, "13": None}
        linked = ingest.decision_of_job(conn, "c1", "10")
        assert linked is not None and linked["decision_id"] == "00000000abcd" and linked["job_id"] == "10"
        assert conn.execute(select(db.Job.comment).where(db.Job.job_id == "10")).scalar() == "my own words"
        for other in ("11", "12", "13"):
            assert ingest.decision_of_job(conn, "c1", other) is None
        assert conn.execute(select(db.Job.comment).where(db.Job.job_id == "12")).scalar() == "script:python x.py"


# ---- live, on the local Slurm -----------------------------------------------------------------

def _wait_final(job_id: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True,
                             text=True, check=False).stdout.split()
        if out and out[0] in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY"):
            return out[0]
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish")


def _ingest(url: str, since: datetime, **spools: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **spools}
    return subprocess.run([str(BIN / "slurmgpu"), "--db", url, "ingest", "--cluster", "slurmgpu", "--since",
                           since.astimezone().strftime("%Y-%m-%dT%H:%M:%S")], capture_output=True, text=True,
                          env=env, timeout=120, check=False)


@pytest.mark.slurm
def test_live_oom_job_is_recorded_stored_and_marked(tmp_path: Path) -> None:
    """A real job prints PyTorch's OOM to stderr and exits 1; the collector runs as the Prolog starts
    it and stops as the Epilog does (after the job ended, while slurmctld still knows it)."""
    started = datetime.now(UTC) - timedelta(seconds=5)
    (tmp_path / "oom.txt").write_text(torch_oom_text())
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\necho 'epoch 1 loss 0.9'\ncat {tmp_path / 'oom.txt'} >&2\nexit 1\n")
    name = f"sgpu-oomA-{os.getpid()}"
    spool_dir, run_dir = tmp_path / "gpu", tmp_path / "run"
    spool_dir.mkdir()
    run_dir.mkdir()
    job_id = subprocess.run(["sbatch", "--parsable", "--hold", "-J", name, "--gres=gpu:t4:1", "-p", "gpu-small",
                             "-o", str(tmp_path / "out-%j.txt"), "-e", str(tmp_path / "err-%j.txt"),
                             "--comment=script:python train.py --model resnet50 --batch-size 64", str(script)],
                            capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOB_UID": str(os.getuid()), "SLURM_CLUSTER_NAME": "slurmgpu",
           "SLURM_JOB_GPUS": "0", "SLURMD_NODENAME": "gpu2"}
    collector = subprocess.Popen([str(BIN / "slurmgpu-monitor"), "run", "--spool", str(spool_dir), "--run-dir",
                                  str(run_dir), "--recorded", str(TRACE), "--interval", "5"], env=env)  # lasts 30 s
    try:
        deadline = time.monotonic() + 10
        while not (run_dir / f"{job_id}.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["scontrol", "release", job_id], check=True)
        assert _wait_final(job_id) == "FAILED"
        stop = subprocess.run([str(BIN / "slurmgpu-monitor"), "stop", "--run-dir", str(run_dir), "--job-id", job_id],
                              env=env, capture_output=True, text=True, timeout=30, check=False)
        assert stop.returncode == 0 and stop.stderr == ""
        assert collector.wait(timeout=10) == 0
    finally:
        if collector.poll() is None:
            collector.kill()
        subprocess.run(["scancel", "-n", name], check=False)
    rec = read_record(str(spool_dir / f"slurmgpu_{job_id}_gpu2.json"))
    assert rec.gpu_oom is not None and rec.gpu_oom.framework == "pytorch"
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    deadline = time.monotonic() + 60
    while True:  # sacct may show a just-finished job a moment late; the ingest is idempotent
        res = _ingest(url, started, SLURMGPU_GPU_SPOOL=str(spool_dir), SLURMGPU_SUBMISSION_SPOOL=str(tmp_path / "none"))
        assert res.returncode == 0, res.stdout + res.stderr
        if any(r["job_id"] == job_id for r in train.history_rows(engine)) or time.monotonic() > deadline:
            break
        time.sleep(1)
    with engine.connect() as conn:
        stored = conn.execute(select(db.GpuUsage.gpu_oom, db.GpuUsage.gpu_oom_line)
                              .where(db.GpuUsage.job_id == job_id)).one()
    assert stored[0] == "pytorch" and stored[1].startswith("torch.cuda.OutOfMemoryError: CUDA out of memory.")
    [row] = [r for r in train.history_rows(engine) if r["job_id"] == job_id]
    assert row["state"] == "FAILED" and row["gpu_oom"] == "pytorch"
    config = load_config(str(ROOT / "contrib" / "slurmgpu.toml"))
    assert train.gpu_oom({**row, "peak": None}, config)  # the message alone marks it, without a peak


@pytest.mark.slurm
def test_live_gsbatch_job_carries_its_decision_tag_into_sacct_and_the_store(tmp_path: Path, capfd) -> None:
    from slurmgpu.apps import gsbatch
    from slurmgpu.pipeline.policy import Candidate, Decision
    from slurmgpu.slurm.backend import CliBackend

    class Model:  # a decision as the model decider makes them, without training one here
        name = "model"

        def decide(self, request) -> Decision:  # type: ignore[no-untyped-def]
            return Decision((), ("model: kept",), decider="model",
                            per_type=(Candidate("t4", 1, True, 5120.0, 90.0, 0.0),))

    started = datetime.now(UTC) - timedelta(seconds=5)
    name = f"sgpu-tagB-{os.getpid()}"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\n#SBATCH -J {name}\n#SBATCH --gres=gpu:t4:1\n#SBATCH -p gpu-small\n"
                      f"#SBATCH -o {tmp_path}/out-%j.txt\nsleep 1\n")
    spool_dir = tmp_path / "subs"
    spool_dir.mkdir()
    env = {"PATH": "/usr/bin:/bin", "SLURMGPU_SUBMISSION_SPOOL": str(spool_dir)}
    try:
        assert gsbatch.main(["--parsable", str(script)], env=env, backend=CliBackend(), decider=Model()) == 0
        job_id = capfd.readouterr().out.strip()
        assert _wait_final(job_id) == "COMPLETED"
    finally:
        subprocess.run(["scancel", "-n", name], check=False)
    time.sleep(2)
    comment = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "Comment", "-j", job_id], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert comment == ""  # the Comment is the user's: gsbatch's record names the job instead
    record = json.loads(next(spool_dir.iterdir()).read_text())
    fields = {"d": record["decision"]["id"]}
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    res = _ingest(url, started, SLURMGPU_SUBMISSION_SPOOL=str(spool_dir), SLURMGPU_GPU_SPOOL=str(tmp_path / "none"))
    assert res.returncode == 0, res.stdout + res.stderr
    with db.make_engine(url).connect() as conn:
        linked = ingest.decision_of_job(conn, "slurmgpu", job_id)
    assert linked is not None and linked["decision_id"] == fields["d"] and linked["job_id"] == job_id
    assert linked["decision"]["decider"] == "model"
