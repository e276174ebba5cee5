"""Schema, migrations and loading on SQLite, PostgreSQL and MariaDB (real servers in CI)."""

from __future__ import annotations

import json
import os
import pwd
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select
from sqlalchemy.exc import IntegrityError

from slurmgpu.history import db, ingest
from slurmgpu.pipeline import spool
from slurmgpu.slurm.sacct import JobRecord, RowError

TABLES = {"jobs", "gpu_usage", "submissions", "model_versions", "ingest_state"}


def job(job_id: str, state: str = "COMPLETED", **extra) -> JobRecord:
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(cluster="c1", job_id=job_id, state=state, gpu_count=2, gpu_type="a100", user="alice",
                  submit_time=datetime(2026, 12, 1, 10, 0, 0), elapsed_s=60, **extra)
    return JobRecord(values, 1)


def test_migrations_down_and_up(db_url: str) -> None:
    engine = db.make_engine(db_url)
    assert TABLES <= set(inspect(engine).get_table_names())
    assert db.current_revision(db_url) == db.head_revision()
    engine.dispose()
    db.downgrade(db_url, "base")
    engine = db.make_engine(db_url)
    assert not TABLES & set(inspect(engine).get_table_names())
    assert db.current_revision(db_url) is None
    db.upgrade(db_url)
    assert TABLES <= set(inspect(db.make_engine(db_url)).get_table_names())


def test_unique_job_per_cluster(db_url: str) -> None:
    engine = db.make_engine(db_url)
    row = {k: v for k, v in job("7").values.items()}
    with engine.begin() as conn:
        conn.execute(db.Job.__table__.insert(), [row])
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(db.Job.__table__.insert(), [row])


def test_load_is_idempotent_and_updates_changed_state(db_url: str) -> None:
    engine = db.make_engine(db_url)
    first = ingest.load_jobs(engine, [job("1", "RUNNING"), job("2"), job("3_1"), job("4+0")])
    assert (first.inserted, first.updated, first.unchanged) == (4, 0, 0)
    again = ingest.load_jobs(engine, [job("1", "RUNNING"), job("2")])
    assert (again.inserted, again.updated, again.unchanged) == (0, 0, 2)
    later = ingest.load_jobs(engine, [job("1", "COMPLETED", end_time=datetime(2026, 12, 1, 11))], chunk_size=1)
    assert (later.inserted, later.updated) == (0, 1)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(db.Job)).scalar() == 4
        assert conn.execute(select(db.Job.state).where(db.Job.job_id == "1")).scalar() == "COMPLETED"


def test_bad_rows_reported_good_rows_land(db_url: str) -> None:
    engine = db.make_engine(db_url)
    report = ingest.load_jobs(engine, [job("1"), RowError(2, "State: invalid state 'X'"), job("3")], chunk_size=1)
    assert report.inserted == 2 and [e.line for e in report.errors] == [2]


def test_submission_spool_takes_user_from_file_owner(db_url: str, tmp_path: Path) -> None:
    engine = db.make_engine(db_url)
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    rec = spool.new_record(cluster="c1", job_id="42", script_sha256="ab" * 32, sbatch_exit=0, features={},
                           original_request={"gpus_total": 4}, decision={"changed": False}, changed=False)
    rec["user"] = "mallory"  # content is never trusted for the user
    spool.write_record(str(spool_dir), rec)
    (spool_dir / "sub-broken.json").write_text("{not json")
    report = ingest.load_submissions(engine, str(spool_dir))
    assert report.files_loaded == 1 and len(report.files_rejected) == 1
    assert sorted(os.listdir(spool_dir)) == ["sub-broken.json.rejected"]
    with engine.connect() as conn:
        row = conn.execute(select(db.Submission.user, db.Submission.job_id, db.Submission.original_request)).one()
    assert row.user == pwd.getpwuid(os.getuid()).pw_name and row.job_id == "42"
    assert row.original_request == {"gpus_total": 4}
    spool.write_record(str(spool_dir), rec)  # the same record again: loaded once only
    ingest.load_submissions(engine, str(spool_dir))
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(db.Submission)).scalar() == 1


def test_sqlite_file_is_private_and_wal(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'h.db'}"
    db.upgrade(url)
    assert oct((tmp_path / "new" / "h.db").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "new").stat().st_mode & 0o777) == "0o700"
    with db.make_engine(url).connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_spool_record_is_written_atomically_and_private(tmp_path: Path) -> None:
    path = spool.write_record(str(tmp_path), spool.new_record(a=1))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]
    assert json.loads(Path(path).read_text())["a"] == 1


def test_collector_record_matches_array_task_by_raw_id(db_url: str) -> None:
    from slurmgpu.history.queries import job_rows

    engine = db.make_engine(db_url)
    ingest.load_jobs(engine, [job("5_1", job_id_raw=6, array_job_id=5, array_task_id=1), job("7", job_id_raw=7)])
    with engine.begin() as conn:
        conn.execute(db.GpuUsage.__table__.insert(), [
            {"cluster": "c1", "job_id": "6", "hostname": "n1", "source": "nvml", "gpus": 2, "peak_mem_mib": 5000.0,
             "samples": 3, "detail": [], "max_util": 90.0},
            {"cluster": "c1", "job_id": "7", "hostname": "n1", "source": "nvml", "gpus": 2, "peak_mem_mib": 700.0,
             "samples": 3, "detail": [], "max_util": 10.0}])
    rows = {r["job_id"]: r for r in job_rows(engine)}
    assert (rows["5_1"]["peak_gpu_mem_mib"], rows["5_1"]["max_gpu_util"]) == (5000.0, 90.0)
    assert rows["7"]["peak_gpu_mem_mib"] == 700.0 and rows["7"]["gpu_usage_source"] == "collector"


def test_a_record_the_database_refuses_keeps_no_other_out(db_url: str, tmp_path: Path) -> None:
    """When the store refuses a batch (here: a record another ingest stored meanwhile, which the
    admission check did not see), each record is retried alone: the others land, that one is a
    duplicate, and no transaction is left aborted."""
    engine = db.make_engine(db_url)
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    recs = [spool.new_record(cluster="c1", job_id=None, script_sha256=None, sbatch_exit=1, features={"i": i},
                             original_request=None, decision={}, changed=False) for i in range(3)]
    for rec in recs:
        spool.write_record(str(spool_dir), rec)
    opened = ingest.open_spool_file(str(spool_dir / f"sub-{recs[1]['record_id']}.json"))
    assert opened is not None
    first = ingest.parse_submission(opened)
    with engine.begin() as conn:  # the concurrent ingest
        conn.execute(db.Submission.__table__.insert(), [first])
    blind = ingest.SUBMISSIONS._replace(
        admit=lambda conn, items, trusted, now: [ingest._Verdict(ingest.STORE)] * len(items))
    report = ingest.drain_spool(engine, str(spool_dir), blind)
    assert (report.files_loaded, report.files_duplicate, report.files_rejected) == (2, 1, [])
    assert os.listdir(spool_dir) == []
    with engine.connect() as conn:
        assert sorted(conn.execute(select(db.Submission.record_id)).scalars()) == sorted(r["record_id"] for r in recs)


def test_migration_0002_down_and_up_keeps_the_data(db_url: str) -> None:
    """0002 (GPU-OOM outcome, decision ids) goes down to 0001 and up again on every backend, and the
    rows stored before keep their values."""
    engine = db.make_engine(db_url)
    ingest.load_jobs(engine, [job("1", comment="mine", admin_comment="slurmgpu:d=0123456789ab;m=model")])
    engine.dispose()
    db.downgrade(db_url, "0001")
    assert db.current_revision(db_url) == "0001"
    engine = db.make_engine(db_url)
    cols = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in ("jobs", "gpu_usage", "submissions")}
    assert "decision_id" not in cols["jobs"] | cols["submissions"] and "gpu_oom" not in cols["gpu_usage"]
    engine.dispose()
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    cols = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in ("jobs", "gpu_usage", "submissions")}
    assert {"gpu_oom", "gpu_oom_line"} <= cols["gpu_usage"] and "decision_id" in cols["jobs"] & cols["submissions"]
    with engine.connect() as conn:
        assert conn.execute(select(db.Job.comment, db.Job.decision_id)).one() == ("mine", None)
    again = ingest.load_jobs(engine, [job("1", comment="mine", admin_comment="slurmgpu:d=0123456789ab;m=model")])
    assert again.updated == 1  # the next ingest fills the id in
    with engine.connect() as conn:
        assert conn.execute(select(db.Job.decision_id)).scalar() == "0123456789ab"
