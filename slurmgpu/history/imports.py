"""Load job history that did not come from this cluster's sacct: a CSV or Parquet table.

Sites often hold years of history in other shapes (an old scheduler's exports, a data
warehouse, a public trace). One generic table format brings it into the same ``jobs`` and
``gpu_usage`` tables the sacct ingest fills, so the learner sees one history. Required columns:
``job_id, user, submit_time, gpu_type, gpu_count, elapsed_s, state``; optional: ``start_time,
end_time, partition, account, peak_gpu_mem_mib, mean_gpu_util, script, command``; other columns
are ignored. Times are ISO 8601; those without a zone are taken as UTC. States are Slurm's
(``CANCELLED by 1000`` is read as sacct prints it). A bad row is reported with its row number
(1 = first data row) while the good rows load; loading the same file again changes nothing.
``script`` (or else ``command``) is kept in ``jobs.comment`` prefixed ``script:``/``command:``
until the schema has a place for script text.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import pandas as pd
from sqlalchemy.engine import Engine

from slurmgpu.history import ingest
from slurmgpu.history.db import GpuUsage
from slurmgpu.slurm.sacct import JobRecord, RowError

REQUIRED = ("job_id", "user", "submit_time", "gpu_type", "gpu_count", "elapsed_s", "state")
OPTIONAL = ("start_time", "end_time", "partition", "account", "peak_gpu_mem_mib", "mean_gpu_util", "script", "command")
# Slurm's job states (squeue(1) JOB STATE CODES that end up in accounting).
STATES = frozenset((
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PENDING",
    "PREEMPTED", "RUNNING", "REQUEUED", "RESIZING", "REVOKED", "SUSPENDED", "TIMEOUT",
))
SOURCE = "import"
_STATE = re.compile(r"^([A-Za-z_]+)(?: by (\d+))?$")
_ARRAY = re.compile(r"^(\d+)_(\d+)$")
_LIMITS = {"job_id": 64, "user": 64, "gpu_type": 64, "partition": 128, "account": 64}


class ImportReport(NamedTuple):
    rows: int
    jobs: ingest.Report  # inserted/updated/unchanged, and the rejected rows as (row number, message)
    usage_rows: int  # gpu_usage rows written
    util_without_peak: int  # rows whose mean_gpu_util had no peak memory to go with (not stored)
    ignored_columns: tuple[str, ...]

    def summary(self) -> str:
        text = f"{self.rows} rows: {self.jobs.summary()}; {self.usage_rows} GPU usage rows loaded"
        if self.util_without_peak:
            text += f"; mean_gpu_util ignored on {self.util_without_peak} rows without peak_gpu_mem_mib"
        if self.ignored_columns:
            text += f"; columns ignored: {', '.join(self.ignored_columns)}"
        return text


def read_table(path: str) -> pd.DataFrame:
    """A pandas DataFrame of the file: Parquet by its extension, else CSV (every cell as text)."""
    if path.lower().endswith((".parquet", ".pq")):
        try:
            return pd.read_parquet(path)
        except ImportError as exc:
            raise ValueError(f"reading Parquet needs pyarrow (pip install 'slurmgpu[train]'): {exc}") from None
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def _missing(value: Any) -> bool:
    """Empty text, None, NaN or NaT (how CSV and Parquet say 'no value')."""
    return not value.strip() if isinstance(value, str) else value is None or bool(pd.isna(value))


def _text(row: dict[str, Any], col: str, required: bool = False) -> str | None:
    value = row.get(col)
    if _missing(value):
        if required:
            raise ValueError(f"{col}: missing")
        return None
    text = str(value).strip()
    if col in _LIMITS and len(text) > _LIMITS[col]:
        raise ValueError(f"{col}: longer than {_LIMITS[col]} characters")
    return text


def _number(row: dict[str, Any], col: str, required: bool = False, high: float | None = None) -> float | None:
    value = row.get(col)
    if _missing(value):
        if required:
            raise ValueError(f"{col}: missing")
        return None
    assert value is not None  # _missing() holds for None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{col}: not a number: {value!r}") from None
    if not math.isfinite(number) or number < 0 or (high is not None and number > high):
        raise ValueError(f"{col}: out of range: {value!r}")
    return number


def _count(row: dict[str, Any], col: str) -> int:
    number = _number(row, col, required=True)
    assert number is not None
    if number != int(number):
        raise ValueError(f"{col}: not a whole number: {row[col]!r}")
    return int(number)


def _time(row: dict[str, Any], col: str, required: bool = False) -> datetime | None:
    value = row.get(col)
    if _missing(value):
        if required:
            raise ValueError(f"{col}: missing")
        return None
    if isinstance(value, datetime):  # Parquet timestamps arrive as pandas Timestamps
        t = value.to_pydatetime() if hasattr(value, "to_pydatetime") else value
    else:
        try:
            t = datetime.fromisoformat(str(value).strip())
        except ValueError:
            raise ValueError(f"{col}: not an ISO 8601 time: {value!r}") from None
    return t.astimezone(UTC).replace(tzinfo=None) if t.tzinfo else t


def _job_values(row: dict[str, Any], cluster: str) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
    """The ``jobs`` row, the ``gpu_usage`` row (None without peak memory), and whether a util was dropped."""
    job_id = _text(row, "job_id", required=True)
    assert job_id is not None
    gpu_count = _count(row, "gpu_count")
    gpu_type = _text(row, "gpu_type")
    if gpu_count and gpu_type is None:
        raise ValueError("gpu_type: missing for a job with GPUs")
    state_text = _text(row, "state", required=True)
    m = _STATE.match(state_text or "")
    if not m or m.group(1).upper() not in STATES:
        raise ValueError(f"state: not a Slurm job state: {state_text!r}")
    elapsed = _number(row, "elapsed_s", required=True)
    assert elapsed is not None
    submit = _time(row, "submit_time", required=True)
    start, end = _time(row, "start_time"), _time(row, "end_time")
    if start is not None and end is None:
        end = start + timedelta(seconds=elapsed)
    if start is not None and end is not None and end < start:
        raise ValueError("end_time: before start_time")
    peak = _number(row, "peak_gpu_mem_mib")
    util = _number(row, "mean_gpu_util", high=100.0)
    script, command = _text(row, "script"), _text(row, "command")
    array = _ARRAY.match(job_id)
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(
        cluster=cluster, job_id=job_id, user=_text(row, "user", required=True),
        job_id_raw=int(job_id) if job_id.isdigit() else None,
        array_job_id=int(array.group(1)) if array else None, array_task_id=int(array.group(2)) if array else None,
        account=_text(row, "account"), partition=_text(row, "partition"),
        submit_time=submit, start_time=start, end_time=end, elapsed_s=round(elapsed),
        state=m.group(1).upper(), state_detail=state_text if m.group(2) else None,
        gpu_type=gpu_type, gpu_count=gpu_count,
        comment=f"script:{script}" if script else f"command:{command}" if command else None,
    )
    usage = None if peak is None else {
        "cluster": cluster, "job_id": job_id, "hostname": "", "source": SOURCE, "gpus": gpu_count,
        "peak_mem_mib": peak, "peak_proc_mem_mib": None, "mean_util": util, "max_util": None, "samples": 0,
        "start_time": start, "end_time": end, "detail": [],
    }
    return values, usage, util is not None and peak is None


def import_history(engine: Engine, path: str, cluster: str) -> ImportReport:
    """Load ``path`` (CSV, or Parquet by extension) into the history store for ``cluster``.

    A file that cannot be read, or lacks a required column, raises ValueError or OSError.
    """
    table = read_table(path)
    missing = [c for c in REQUIRED if c not in table.columns]
    if missing:
        raise ValueError(f"missing required columns: {', '.join(missing)}")
    items: list[JobRecord | RowError] = []
    usage: dict[tuple[str, str], dict[str, Any]] = {}  # one row per job: a later line for a job wins
    dropped = 0
    for number, row in enumerate(table.to_dict("records"), 1):
        try:
            values, use, util_dropped = _job_values(row, cluster)
        except ValueError as exc:
            items.append(RowError(number, str(exc)))
            continue
        items.append(JobRecord(values, number))
        dropped += util_dropped
        if use is not None:
            usage[(cluster, values["job_id"])] = use
    report = ingest.load_jobs(engine, items)
    with engine.begin() as conn:
        ingest.upsert(conn, GpuUsage.__table__, list(usage.values()),  # type: ignore[arg-type]
                      ("cluster", "job_id", "hostname", "source"))
    ignored = tuple(str(c) for c in table.columns if c not in REQUIRED + OPTIONAL)
    return ImportReport(len(table), report, len(usage), dropped, ignored)
