"""Accounting through pyslurm reads as sacct's on the live cluster: the same jobs, parsed into the same
rows field by field (TRES, times, states, exit codes, comments, step usage), by time window and by job id,
and an ingest through either backend stores the same table (skipped where pyslurm is not importable)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from slurmgpu.slurm import sacct
from slurmgpu.slurm.backend import CliBackend, SlurmBackend, select_backend

pyslurm = pytest.importorskip("pyslurm", reason="pyslurm is not importable here (make pyslurm installs it)")
pytestmark = pytest.mark.slurm

FINAL = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL")
# name -> sbatch options; "cancel" is cancelled once running, "held" while still held (it never starts).
JOBS = {
    "ok-a100": ["--gres=gpu:a100:2", "--comment=parity ok", "--wrap", "sleep 1"],
    "fail-t4": ["--gpus=t4:1", "-p", "gpu-small", "--mem-per-cpu=300", "-c", "2", "--wrap", "exit 3"],
    "cancel": ["--gres=gpu:v100:1", "--wrap", "sleep 300"],
    "held": ["--hold", "--gres=gpu:a100:1", "--wrap", "true"],
    "array": ["--array=0-1", "--gpus-per-node=t4:1", "-p", "gpu-small", "--wrap", "sleep 1"],
    "cpu-only": ["--wrap", "true"],
    "exit-143": ["--wrap", "exit 143"],  # sacct prints 143 - 128: 15:0
    "killed": ["--wrap", "kill -9 $$"],
}


def _sbatch(name: str, opts: list[str], cwd: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-J", f"sg-acct-{name}", "-o", "/dev/null", *opts],
                         capture_output=True, text=True, cwd=cwd, check=True)
    return out.stdout.strip().split(";")[0]


def _states(ids: list[str]) -> dict[str, str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(ids)],
                         capture_output=True, text=True, check=True).stdout
    return {line.split("|")[0]: line.split("|")[1].split()[0] for line in out.splitlines() if line}


@pytest.fixture(scope="module")
def backends() -> tuple[SlurmBackend, CliBackend]:
    backend = select_backend({"SLURMGPU_BACKEND": "auto"})
    if backend.name != "pyslurm":
        pytest.skip("the installed pyslurm does not match the running Slurm")
    return backend, CliBackend()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The jobs above, all in a final state; the held one carries an AdminComment as the Lua hook's tag."""
    cwd = tmp_path_factory.mktemp("acct")
    started = datetime.now(UTC).replace(tzinfo=None)
    ids = {name: _sbatch(name, opts, cwd) for name, opts in JOBS.items()}
    try:
        subprocess.run(["scontrol", "update", f"job={ids['held']}", "AdminComment=slurmgpu:parity"], check=True)
        subprocess.run(["scancel", ids["held"]], check=True)
        expected = [*(j for n, j in ids.items() if n != "array"), *(f"{ids['array']}_{i}" for i in range(2))]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            now = _states(list(ids.values()))
            if now.get(ids["cancel"]) == "RUNNING":
                subprocess.run(["scancel", ids["cancel"]], check=True)
            if set(expected) <= now.keys() and all(now[j] in FINAL for j in expected):
                break
            time.sleep(2)
        else:
            pytest.fail(f"jobs did not finish in time: {_states(list(ids.values()))}")
        time.sleep(2)  # the accounting of the last step lags the job's state a little
        # A job cancelled while held never became eligible: only asking by id shows it, not a time window.
        window = [j for j in expected if j != ids["held"]]
        yield {"ids": ids, "expected": expected, "window": window, "since": started - timedelta(seconds=5)}
    finally:
        subprocess.run(["scancel", *ids.values()], check=False)


def _rows(lines: Iterator[str]) -> dict[str, dict[str, Any]]:
    """Parsed as the ingest parses them (steps folded into their job), by job id; no row may be rejected."""
    out = {}
    for item in sacct.parse_lines(lines, sacct.LIVE_FIELDS, sacct.LIVE_DELIMITER, "slurmgpu"):
        assert isinstance(item, sacct.JobRecord), item
        out[item.values["job_id"]] = item.values
    return out


SETTLE = timedelta(seconds=30)


def _finished_only(rows: dict[str, dict[str, Any]], until: datetime) -> dict[str, dict[str, Any]]:
    """Other tests' jobs still running change between two reads (elapsed time), and one that ended in the
    last seconds may have ended for one read and not the other, or still be the row slurmdbd holds before
    its request is filled in (ReqMem '16?'): only jobs ended at least SETTLE before the reads are compared."""
    return {k: v for k, v in rows.items()
            if v["state"] in FINAL and v["end_time"] is not None and v["end_time"] <= until - SETTLE}


def test_window_rows_equal_sacct_field_by_field(backends, finished) -> None:
    py, cli = backends
    until = datetime.now(UTC).replace(tzinfo=None)
    ours, theirs = _rows(py.accounting(finished["since"], until)), _rows(cli.accounting(finished["since"], until))
    assert set(finished["window"]) <= set(theirs)
    for job in finished["window"]:
        assert ours[job] == theirs[job], job
    assert _finished_only(ours, until) == _finished_only(theirs, until)
    ids = finished["ids"]
    a100, t4, cancel = (theirs[ids[n]] for n in ("ok-a100", "fail-t4", "cancel"))
    assert (a100["gpu_type"], a100["gpu_count"], a100["comment"]) == ("a100", 2, "parity ok")
    assert "gres/gpu:a100=2" in a100["alloc_tres"]
    assert (t4["state"], t4["exit_code"], t4["gpu_type"], t4["cpus"], t4["req_mem_mb"]) == ("FAILED", 3, "t4", 2, 600)
    assert (cancel["state"], cancel["state_detail"], cancel["gpu_type"]) == ("CANCELLED", "CANCELLED by 0", "v100")
    exits = [(theirs[ids[n]]["exit_code"], theirs[ids[n]]["exit_signal"]) for n in ("exit-143", "killed")]
    assert exits == [(15, 0), (0, 9)]


def test_rows_by_job_id_equal_sacct(backends, finished) -> None:
    py, cli = backends
    ids = [*finished["ids"].values(), f"{finished['ids']['array']}_1"]
    ours, theirs = _rows(py.accounting(job_ids=ids)), _rows(cli.accounting(job_ids=ids))
    assert ours == theirs and set(finished["expected"]) <= set(theirs)
    held = theirs[finished["ids"]["held"]]
    assert (held["state"], held["gpu_type"], held["admin_comment"]) == ("CANCELLED", "a100", "slurmgpu:parity")


def test_the_whole_days_accounting_equals_sacct(backends, finished) -> None:
    """The day's rows, of the jobs ended at least SETTLE before the reads: the fixture's among them
    (their steps report MaxRSS; on a cluster just started they may be the day's only such jobs, and
    read at once they had ended too recently to count)."""
    py, cli = backends
    ends = [r["end_time"] for r in _rows(cli.accounting(job_ids=finished["window"])).values() if r["end_time"]]
    if ends:
        time.sleep(max((max(ends) + SETTLE - datetime.now(UTC).replace(tzinfo=None)).total_seconds() + 1, 0))
    until = datetime.now(UTC).replace(tzinfo=None)
    since = until - timedelta(days=1)
    ours, theirs = (_finished_only(_rows(b.accounting(since, until)), until) for b in (py, cli))
    assert ours == theirs and theirs
    assert any(r["max_rss_mb"] for r in theirs.values())  # steps' usage was read, and folded alike


def test_ingest_through_either_backend_stores_the_same_jobs(backends, finished, tmp_path: Path) -> None:
    from sqlalchemy import select

    from slurmgpu.history import db, ingest

    py, cli = backends
    tables = []
    for backend in (py, cli):
        url = f"sqlite:///{tmp_path / backend.name}.db"
        db.upgrade(url)
        engine = db.make_engine(url)
        report = ingest.ingest_sacct(engine, "slurmgpu", since=finished["since"], backend=backend)
        assert not report.errors
        with engine.connect() as conn:
            rows = conn.execute(select(*(ingest.JOBS.c[c] for c in ingest.JOB_COLUMNS))).mappings().all()
        tables.append({r["job_id"]: dict(r) for r in rows if r["job_id"] in finished["window"]})
    assert tables[0] == tables[1] and len(tables[0]) == len(finished["window"])
