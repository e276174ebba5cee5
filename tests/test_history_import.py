"""Generic history import from CSV and Parquet: good rows land, bad rows are named by row number,
a second load changes nothing, and the CLI reports both. Expectations are read off the fixture
table by hand (tests/fixtures/workload/history.csv)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from sqlalchemy import select

from slurmgpu.cli.history import history_group
from slurmgpu.history import db
from slurmgpu.history.imports import import_history
from slurmgpu.history.queries import job_rows

CSV = Path(__file__).resolve().parent / "fixtures" / "workload" / "history.csv"
GOOD = ["5001", "5002", "5003", "5007_3", "5011", "5013"]
BAD = {4: "submit_time", 5: "state", 6: "gpu_count", 8: "end_time", 9: "elapsed_s", 10: "user", 12: "mean_gpu_util"}


def _parquet(tmp_path: Path) -> Path:
    """The fixture as Parquet with native column types: zoned timestamps, numbers, nulls."""
    table = pd.read_csv(CSV, dtype=str, keep_default_na=False)
    good = table[table["job_id"].isin(["5001", "5002", "5007_3", "5011"])].copy()
    for col in ("submit_time", "start_time", "end_time"):
        good[col] = pd.to_datetime(good[col].replace("", None), utc=True, format="ISO8601")
    for col in ("gpu_count", "elapsed_s"):
        good[col] = good[col].astype("int64")
    for col in ("peak_gpu_mem_mib", "mean_gpu_util"):
        good[col] = pd.to_numeric(good[col].replace("", None))
    bad = pd.DataFrame({"job_id": ["6001"], "user": ["zed"], "submit_time": [pd.NaT], "gpu_type": ["a100"],
                        "gpu_count": [1], "elapsed_s": [5], "state": ["COMPLETED"]})
    path = tmp_path / "history.parquet"
    pd.concat([good, bad], ignore_index=True).to_parquet(path)
    return path


def _jobs(url: str) -> dict[str, db.Job]:
    engine = db.make_engine(url)
    with engine.connect() as conn:
        return {row.job_id: row for row in conn.execute(select(db.Job))}


def test_csv_good_rows_land_bad_rows_named(db_url: str) -> None:
    engine = db.make_engine(db_url)
    report = import_history(engine, str(CSV), "old")
    assert report.rows == 13
    assert {e.line: e.message.split(":")[0] for e in report.jobs.errors} == BAD
    assert (report.jobs.inserted, report.usage_rows, report.util_without_peak) == (6, 3, 1)
    assert report.ignored_columns == ("site_note",) and report.summary().endswith("columns ignored: site_note")
    jobs = _jobs(db_url)
    assert sorted(jobs) == sorted(GOOD)
    j = jobs["5002"]  # +01:00 submit to UTC; end = start + elapsed; command kept
    assert (j.submit_time, j.start_time, j.end_time) == (
        datetime(2025, 3, 1, 9, 0), datetime(2025, 3, 1, 9, 1), datetime(2025, 3, 1, 9, 3))
    assert j.comment == "command:python train.py --batch-size 64" and j.state == "FAILED" and j.cluster == "old"
    assert jobs["5001"].comment.startswith("script:#!/bin/bash\n#SBATCH --gres=gpu:a100:2\n")
    cpu_only = jobs["5003"]
    assert (cpu_only.gpu_count, cpu_only.gpu_type, cpu_only.submit_time) == (0, None, datetime(2025, 3, 1, 11))
    c = jobs["5007_3"]
    assert (c.state, c.state_detail, c.array_job_id, c.array_task_id, c.job_id_raw) == (
        "CANCELLED", "CANCELLED by 1002", 5007, 3, None)
    assert jobs["5011"].state == "COMPLETED"
    rows = {r["job_id"]: r for r in job_rows(engine)}
    assert (rows["5001"]["peak_gpu_mem_mib"], rows["5001"]["gpu_count"]) == (30500.5, 2)
    assert rows["5013"]["peak_gpu_mem_mib"] is None
    with engine.connect() as conn:
        usage = {u.job_id: u for u in conn.execute(select(db.GpuUsage))}
    assert {u.source for u in usage.values()} == {"import"}
    assert (usage["5001"].mean_util, usage["5007_3"].mean_util, usage["5011"].mean_util) == (87.5, None, 55.0)


def test_import_is_idempotent(db_url: str) -> None:
    engine = db.make_engine(db_url)
    import_history(engine, str(CSV), "old")
    again = import_history(engine, str(CSV), "old")
    assert (again.jobs.inserted, again.jobs.updated, again.jobs.unchanged) == (0, 0, 6)
    with engine.connect() as conn:
        assert len(conn.execute(select(db.GpuUsage.id)).all()) == 3


def test_parquet_with_native_types(db_url: str, tmp_path: Path) -> None:
    engine = db.make_engine(db_url)
    report = import_history(engine, str(_parquet(tmp_path)), "old")
    assert [(e.line, e.message) for e in report.jobs.errors] == [(5, "submit_time: missing")]
    jobs = _jobs(db_url)
    assert sorted(jobs) == ["5001", "5002", "5007_3", "5011"]
    assert jobs["5002"].submit_time == datetime(2025, 3, 1, 9, 0) and jobs["5002"].elapsed_s == 120
    assert report.usage_rows == 3


def test_missing_required_column_refuses_the_file(db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "short.csv"
    path.write_text("job_id,user,submit_time\n1,a,2025-01-01T00:00:00Z\n")
    with pytest.raises(ValueError, match="missing required columns: gpu_type, gpu_count, elapsed_s, state"):
        import_history(db.make_engine(db_url), str(path), "old")


def test_cli_reports_rows_and_exits_1(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    obj = {"config_path": None, "db_url": url}
    result = CliRunner().invoke(history_group, ["import", str(CSV), "--cluster", "old"], obj=obj)
    assert result.exit_code == 1
    assert f"rejected {CSV}: row 4: submit_time: not an ISO 8601 time: 'yesterday'" in result.stderr
    assert result.stdout.startswith("13 rows: 6 jobs inserted, 0 updated, 0 unchanged, 7 rows rejected; 3 GPU usage")
    clean = tmp_path / "clean.csv"
    pd.read_csv(CSV, dtype=str, keep_default_na=False).iloc[[0, 1, 2]].to_csv(clean, index=False)
    result = CliRunner().invoke(history_group, ["import", str(clean), "--cluster", "old"], obj=obj)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("3 rows: 0 jobs inserted, 0 updated, 3 unchanged")
