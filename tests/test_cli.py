"""The installed commands, run as a user runs them: one-line errors, exit codes, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def sh(*argv: str, env_config: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin"}
    if env_config:
        env["SLURMGPU_CONFIG"] = str(env_config)
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=60, check=False)


def test_parse_json_fields(tmp_path: Path) -> None:
    p = tmp_path / "j.sh"
    p.write_text("#!/bin/bash\n#SBATCH -N 2 --gpus-per-node=v100:2 -p gpu\n#SBATCH hetjob\n#SBATCH -G 1\n"
                 "srun x\n#SBATCH --gres=gpu:9\n")
    res = sh(str(BIN / "slurmgpu"), "parse", str(p), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["gpu_type"], data["gpus_total"], data["gpus_per_node"], data["nodes"], data["partition"]) == \
           (None, 5, 2, 2, "gpu")
    assert [c["gpus_total"] for c in data["components"]] == [4, 1]
    assert data["ignored_directives"][0]["line"] == 6


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "cannot read: No such file or directory"),
    (b"\x7fELF\x02\x01\x00\x00binary", "NULL character"),
    (b"#!/bin/bash\n#SBATCH --gres=gpu:a100:two\n", ":2: --gres: malformed count 'two'"),
    (b"#!/bin/bash\n#SBATCH --gpus=-4\n", ":2: --gpus: negative GPU count '-4'"),
    (b"#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n#SBATCH --gpus=1\n", ":3: --gpus: Invalid GRES specification"),
    (b"#!/bin/bash\r\n", "DOS line breaks"),
])
@pytest.mark.parametrize("command", [("slurmgpu", "parse"), ("gsbatch", "--dry-run")])
def test_bad_input_one_line_no_traceback(tmp_path: Path, content: bytes | None, fragment: str,
                                         command: tuple[str, str], sample_config: Path) -> None:
    p = tmp_path / "bad.sh"
    if content is not None:
        p.write_bytes(content)
    res = sh(str(BIN / command[0]), command[1], str(p), env_config=sample_config)
    assert res.returncode == 1
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert str(p) in lines[0] and fragment in lines[0]


def test_config_check_offline_and_bad(tmp_path: Path, sample_config: Path) -> None:
    res = sh(str(BIN / "slurmgpu"), "--config", str(sample_config), "config", "check", "--offline")
    assert res.returncode == 0 and "valid (5 GPU types, 3 partitions)" in res.stdout
    bad = tmp_path / "c.toml"
    bad.write_text("[gpu_types.a100]\nmemory_gib = 0\n")
    res = sh(str(BIN / "slurmgpu"), "--config", str(bad), "config", "check", "--offline")
    assert res.returncode == 1 and res.stderr.strip().endswith("gpu_types.a100.memory_gib: must be > 0, got 0")


def test_db_commands(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    current = sh(str(BIN / "slurmgpu"), "--db", url, "db", "current")
    assert current.returncode == 1 and "at revision none" in current.stdout
    assert sh(str(BIN / "slurmgpu"), "--db", url, "db", "upgrade").stdout.strip().endswith("at revision 0004")
    assert sh(str(BIN / "slurmgpu"), "--db", url, "db", "current").returncode == 0
    assert sh(str(BIN / "slurmgpu"), "--db", url, "db", "downgrade").stdout.strip().endswith("at revision base")
    jobs = sh(str(BIN / "slurmgpu"), "--db", url, "jobs", "--json")
    assert jobs.returncode == 1 and "run `slurmgpu db upgrade`" in jobs.stderr and "Traceback" not in jobs.stderr


def test_jobs_lists_the_newest_first_and_says_what_the_limit_left_out(tmp_path: Path) -> None:
    from slurmgpu.history import db, ingest
    from slurmgpu.slurm import sacct

    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    lines = ["JobID|User|State|Partition|Submit\n"] + [
        f"{100 + i}|root|COMPLETED|gpu|2026-11-{1 + i:02d}T10:00:00\n" for i in range(5)]
    ingest.load_jobs(db.make_engine(url), sacct.parse_lines(lines, None, "|", "slurmgpu"))
    res = sh(str(BIN / "slurmgpu"), "--db", url, "jobs", "--json", "--limit", "2")
    assert [r["job_id"] for r in json.loads(res.stdout)] == ["104", "103"]
    assert res.stderr.strip() == "slurmgpu: showing the newest 2 jobs; 3 older ones not shown (--limit N, --since TIME)"
    res = sh(str(BIN / "slurmgpu"), "--db", url, "jobs", "--json", "--limit", "5")
    assert len(json.loads(res.stdout)) == 5 and res.stderr == ""


def test_render_nightly_uses_the_given_config_and_the_installed_command(tmp_path: Path, sample_config: Path) -> None:
    """Started as `python -c ...` (argv[0] is "-c"), with --config: the unit runs the installed
    command on that config, never a temporary path or "-c"."""
    program = "from slurmgpu.cli.main import main; main()"
    res = subprocess.run([sys.executable, "-c", program, "--config", str(sample_config), "render", "nightly",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert res.returncode == 0, res.stderr
    unit = (tmp_path / "slurmgpu-nightly.service").read_text()
    assert f"Environment=SLURMGPU_CONFIG={sample_config.resolve()}\n" in unit
    assert f"ExecStart={Path(sys.executable).parent / 'slurmgpu'} nightly\n" in unit
    assert f"SLURMGPU_CONFIG={sample_config.resolve()}" in (tmp_path / "slurmgpu.cron").read_text()


def test_jobs_table_fits_80_columns_and_wide_shows_every_column(tmp_path: Path) -> None:
    from slurmgpu.history import db, ingest
    from slurmgpu.slurm import sacct

    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    lines = ["JobID|User|State|Partition|Submit|Elapsed|AllocTRES\n",
             "7|root|COMPLETED|gpu-small|2026-11-01T10:00:00|1-02:03:04|cpu=1,gres/gpu=2,gres/gpu:a100=2\n"]
    ingest.load_jobs(db.make_engine(url), sacct.parse_lines(lines, None, "|", "slurmgpu"))
    env = {**os.environ, "COLUMNS": "80"}
    narrow = subprocess.run([str(BIN / "slurmgpu"), "--db", url, "jobs"], capture_output=True, text=True, env=env,
                            check=False)
    assert narrow.returncode == 0 and max(len(line) for line in narrow.stdout.splitlines()) <= 80
    assert "1-02:03:04" in narrow.stdout and "2 x a100" in narrow.stdout and "--wide" in narrow.stdout
    wide = subprocess.run([str(BIN / "slurmgpu"), "--db", url, "jobs", "--wide"], capture_output=True, text=True,
                          env=env, check=False)
    assert "gpu-small" in wide.stdout and "max util %" in wide.stdout


def test_evaluate_refuses_a_version_that_is_not_registered(tmp_path: Path) -> None:
    """`evaluate --version N` scores that version or says it has none: never the installed model."""
    config = Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml"
    url = f"sqlite:///{tmp_path / 'h.db'}"
    assert sh(str(BIN / "slurmgpu"), "--db", url, "db", "upgrade").returncode == 0
    missing = sh(str(BIN / "slurmgpu"), "--config", str(config), "--db", url, "evaluate", "--version", "99")
    assert missing.returncode == 1 and "--version 99: no such registered model version" in missing.stderr
    assert "Traceback" not in missing.stderr and missing.stderr.count("\n") == 1
    both = sh(str(BIN / "slurmgpu"), "--config", str(config), "--db", url, "evaluate", "--version", "1",
              "--model", str(tmp_path / "m.json"))
    assert both.returncode == 1 and "give one" in both.stderr
