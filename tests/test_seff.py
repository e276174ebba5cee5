"""``slurmgpu seff``: figures worked out by hand on a built history, what it says is missing, the
per-user restriction (a real unprivileged process), the demo's generated history, and real jobs
on the local Slurm."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_alerts import demo_history  # noqa: F401 - the demo generator's history, ingested
from test_report import SAMPLE_CONFIG, _as_unprivileged, add_job, insert, shared_db, submission, usage  # noqa: F401

from slurmgpu.cli.main import main
from slurmgpu.history import db


def seff(url: str, *args: str) -> Any:
    return CliRunner().invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", url, "seff", *args])


@pytest.fixture
def history(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    jobs: list[dict[str, Any]] = []
    add_job(jobs, "201", "alice", "ml", "a100", 4, 7200, datetime(2026, 1, 10, 12), partition="gpu",
            time_limit_s=14400, node_list="gpu1", exit_code=0)
    add_job(jobs, "202", "bob", "phys", "v100", 2, 3600, datetime(2026, 1, 11))  # nothing recorded
    add_job(jobs, "203", "bob", "phys", "t4", 1, 20, datetime(2026, 1, 11))  # too short
    rec = usage("201", 40960.0, 90.0, [90.0, 80.0, 1.0, 0.0], host="gpu1")
    rec["detail"] = [{"index": i, "peak_mem_mib": p, "mean_util": m, "max_util": x}
                     for i, (p, m, x) in enumerate([(40960.0, 70.0, 90.0), (20480.0, 50.0, 80.0), (100.0, 0.5, 1.0),
                                                    (50.0, 0.0, 0.0)])]
    short = usage("203", 900.0, 40.0, [40.0])
    short["samples"] = 2
    sub = submission("201", "alice", {"gpu_type": "a100", "gpus_total": 4, "partition": "gpu"}, [])
    sub["decision"]["reasons"] = ["model: best choice gains 3% (< 10%); request kept"]
    insert(url, jobs, [rec, short], [sub])
    return url


def test_figures_by_hand(history: str) -> None:
    res = seff(history, "201", "--json")
    assert res.exit_code == 0, res.output
    [s] = json.loads(res.output)
    assert (s["user"], s["gpu_type"], s["gpu_count"], s["card_gib"], s["source"]) == ("alice", "a100", 4, 80.0,
                                                                                       "collector")
    assert [(g["gpu"], g["mem_share"], g["idle"]) for g in s["gpus"]] == [
        (0, 0.5, False), (1, 0.25, False), (2, round(100 / 81920, 4), True), (3, round(50 / 81920, 4), True)]
    assert s["mean_util"] == pytest.approx((70 + 50 + 0.5 + 0) / 4)
    assert (s["idle_gpus"], s["gpu_hours"], s["wasted_gpu_hours"]) == (2, 8.0, 4.0)  # 4 GPUs x 2 h; 2 idle x 2 h
    assert s["asked"] == "4 x a100 GPUs in partition gpu"
    assert s["decision"] == "kept the request (model decider; model: best choice gains 3% (< 10%); request kept)"
    assert [(a["kind"], a["fix"]) for a in s["alerts"]] == [("idle_gpus", "use 2 GPU(s), not 4 (--gres=gpu:a100:2)")]
    assert s["missing"] == ["CPU and host memory: Slurm's accounting has no record of this job now"]  # a made-up job
    text = seff(history, "201").output
    for line in ("Job ID: 201", "GPUs: 4 x a100 (80 GiB each)", "Elapsed: 02:00:00 (time limit 04:00:00)",
                 "GPU-hours used: 8.00", "GPU-hours wasted: 4.00 (2 idle GPU(s) x 02:00:00)",
                 "GPU memory (peak per GPU): 40.00 GiB of 80 GiB (50.0%)",
                 "  gpu1 GPU 3: peak 0.05 GiB (0%), utilisation mean 0.0% max 0.0%  IDLE",
                 "Advice: idle GPUs in multi-GPU jobs: 2 of 4 GPUs idle; use 2 GPU(s), not 4 (--gres=gpu:a100:2)"):
        assert line in text.splitlines(), text


def test_says_what_is_missing(history: str) -> None:
    [nothing, short] = json.loads(seff(history, "202", "203", "--json").output)
    assert nothing["source"] is None and nothing["wasted_gpu_hours"] is None and nothing["gpu_hours"] == 2.0
    assert any(m.startswith("GPU memory and utilisation: no collector record") for m in nothing["missing"])
    assert any(m.startswith("decision: no submission record") for m in nothing["missing"])
    assert any("too short for reliable figures" in m for m in short["missing"])
    text = seff(history, "202").output
    assert "GPU-hours wasted: - (no per-GPU figures)" in text and "Missing: decision: no submission record" in text
    res = seff(history, "99999999")  # neither stored nor in Slurm's accounting (a real 999 is answered from sacct)
    assert res.exit_code == 1 and "job 99999999 is not in the history database" in res.output


def test_a_user_sees_only_their_own_jobs(shared_db: str) -> None:  # noqa: F811
    base = ("--config", str(SAMPLE_CONFIG), "--db", shared_db, "seff")
    code, out, err = _as_unprivileged(*base, "900", "--json")
    assert code == 0, err
    assert json.loads(out)[0]["job_id"] == "900"
    code, out, err = _as_unprivileged(*base, "101")
    assert (code, out) == (1, "")
    assert err.splitlines() == ["slurmgpu: error: job 101 belongs to another user: you may only see your own jobs"]


def test_seff_on_the_demo_history(demo_history: tuple[Any, Any, str]) -> None:  # noqa: F811
    hist, _, url = demo_history
    runs = sorted(hist.emitted.runs, key=lambda r: -r.gpus * r.elapsed_s)
    for run in (runs[0], next(r for r in runs if r.state == "FAILED" and r.peak_mem_mib >= 16384)):
        [s] = json.loads(seff(url, run.job.job_id, "--json").output)
        assert (s["gpu_count"], s["elapsed_s"], s["state"]) == (run.gpus, run.elapsed_s, run.state)
        assert s["gpu_hours"] == pytest.approx(run.gpus * run.elapsed_s / 3600, abs=1e-3)
        busy = [g for g in s["gpus"] if not g["idle"]]
        assert len(s["gpus"]) == run.gpus and s["idle_gpus"] == run.gpus - len(busy)
        assert s["peak_mib"] == pytest.approx(run.peak_mem_mib, rel=1e-5)
        assert any(m.startswith("decision: no submission record") for m in s["missing"])  # no spool loaded here


# --- real jobs on the local Slurm ------------------------------------------------------------------

@pytest.mark.slurm
def test_seff_on_real_jobs(tmp_path: Path, sample_config: Path) -> None:
    from test_slurm_ingest import BIN, FINAL, sbatch, slurmgpu, states

    spool = tmp_path / "spool"
    spool.mkdir()
    started = datetime.now(UTC)
    plain = sbatch("--gres=gpu:t4:2", "-p", "gpu-small", "-t", "1", "--wrap", "sleep 3", cwd=tmp_path)
    script = tmp_path / "g.sh"
    script.write_text("#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1 -t 1\nsleep 2\n")
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(sample_config),
           "SLURMGPU_SUBMISSION_SPOOL": str(spool)}
    out = subprocess.run([str(BIN / "gsbatch"), "--parsable", str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, check=True)
    decided = out.stdout.strip().split(";")[0]
    advise = tmp_path / "advise.toml"  # the same policy in advise mode: decided and recorded, run as written
    advise.write_text(sample_config.read_text().replace('mode = "rewrite"', 'mode = "advise"', 1))
    constrained = tmp_path / "c.sh"  # the rules write the type the constraint names into --gres
    constrained.write_text("#!/bin/bash\n#SBATCH -p gpu --gres=gpu:1 --constraint=v100 -t 1\nsleep 2\n")
    out = subprocess.run([str(BIN / "gsbatch"), "--parsable", str(constrained)], capture_output=True, text=True,
                         cwd=tmp_path, env={**env, "SLURMGPU_CONFIG": str(advise)}, check=True)
    advised = out.stdout.strip().split(";")[0]
    ids = [plain, decided, advised]
    deadline = time.monotonic() + 240
    while not all(states(ids).get(j) in FINAL for j in ids):
        assert time.monotonic() < deadline, states(ids)
        time.sleep(2)
    time.sleep(2)  # sacct's record of the last job lags its state a little
    url = f"sqlite:///{tmp_path / 'h.db'}"
    assert slurmgpu("db", "upgrade", db=url).returncode == 0
    since = (started - timedelta(seconds=5)).astimezone().strftime("%Y-%m-%dT%H:%M:%S")
    res = subprocess.run([str(BIN / "slurmgpu"), "--db", url, "ingest", "--cluster", "slurmgpu", "--since", since],
                         capture_output=True, text=True, env={**os.environ, **env}, check=False, timeout=120)
    assert res.returncode == 0, res.stderr
    res = slurmgpu("--config", str(sample_config), "seff", plain, decided, advised, "--json", db=url)
    assert res.returncode == 0, res.stderr
    first, second, third = json.loads(res.stdout)
    assert (first["job_id"], first["gpu_type"], first["gpu_count"], first["state"]) == (plain, "t4", 2, "COMPLETED")
    assert first["gpu_hours"] == pytest.approx(2 * first["elapsed_s"] / 3600, abs=1e-4) and first["elapsed_s"] >= 3
    assert first["source"] is None and first["asked"] is None  # no collector here; plain sbatch: no record
    assert any("no collector record" in m for m in first["missing"])
    assert (second["gpu_type"], second["partition"]) == ("a100", "gpu")
    assert second["asked"] == "1 x a100 GPU in partition gpu-small"
    assert second["decision"].startswith("changed it: partition gpu-small -> gpu")
    text = slurmgpu("--config", str(sample_config), "seff", decided, db=url).stdout
    assert f"Job ID: {decided}" in text and "slurmgpu: changed it: partition gpu-small -> gpu" in text
    assert third["decision"].startswith("advised, not applied (advise mode): would have changed "), third["decision"]
    assert "; the job ran as written (rules decider" in third["decision"]
    assert "slurmgpu: changed it" not in slurmgpu("--config", str(sample_config), "seff", advised, db=url).stdout


# --- what seff says must be true of the job it describes ---------------------------------------

@pytest.fixture
def odd_history(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    jobs: list[dict[str, Any]] = []
    day = datetime(2026, 1, 10, 12)
    add_job(jobs, "401", "alice", "ml", "a100", 1, 600, day, partition="gpu-small")  # advised, ran as written
    add_job(jobs, "402", "alice", "ml", "t4", 2, 0, day, state="PENDING", partition="gpu-small")  # requeued
    jobs[-1].update(start_time=None, end_time=None)
    add_job(jobs, "403", "alice", "ml", "t4", 2, 300, day, partition="gpu-small")  # 5 min, second GPU idle
    sub = submission("401", "alice", {"gpu_type": "a100", "gpus_total": 1, "partition": "gpu-small"},
                     [{"index": 0, "gpu_type": None, "gpus_total": None, "partition": "gpu"}])
    sub["decision"].update(mode="advise", advised=True, reasons=["rules: a100 is not in gpu-small"])
    sub["changed"] = False
    earlier = usage("402", 9000.0, 80.0, [80.0, 70.0])
    earlier.update(samples=17, start_time=day - timedelta(hours=3), end_time=day - timedelta(hours=2))
    idle = usage("403", 9000.0, 80.0, [80.0, 0.0])
    idle["detail"][1]["peak_mem_mib"] = 3.0
    insert(url, jobs, [earlier, idle, usage("401", 9000.0, 80.0, [80.0])], [sub])
    return url


def test_advice_is_not_called_a_change(odd_history: str) -> None:
    [s] = json.loads(seff(odd_history, "401", "--json").output)
    assert s["partition"] == "gpu-small"
    assert s["decision"] == ("advised, not applied (advise mode): would have changed partition gpu-small -> gpu; "
                             "the job ran as written (model decider; rules: a100 is not in gpu-small)")
    assert "slurmgpu: changed it" not in seff(odd_history, "401").output


def test_a_requeued_job_is_not_mixed_with_its_earlier_attempt(odd_history: str) -> None:
    [s] = json.loads(seff(odd_history, "402", "--json").output)
    assert (s["state"], s["elapsed_s"], s["source"], s["gpus"], s["peak_mib"]) == ("PENDING", 0, None, [], None)
    assert any(m.startswith("collector figures of an earlier attempt: the job was requeued") and "not started" in m
               for m in s["missing"]), s["missing"]


def test_an_idle_gpu_is_never_called_a_fit(odd_history: str) -> None:
    [s] = json.loads(seff(odd_history, "403", "--json").output)
    assert (s["idle_gpus"], s["alerts"]) == (1, [])
    assert s["advice"] == ["none: 1 of 2 GPU(s) sat idle, but the job ran 00:05:00, under the 10-minute floor below "
                           "which idle GPUs are not flagged (test runs, crashes at start-up)"]
    assert "the GPUs fit the job" not in seff(odd_history, "403").output
