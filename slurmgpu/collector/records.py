"""Per-job GPU records: what the collector writes into the spool and the ingest reads back, strictly typed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, get_args, get_type_hints

from slurmgpu.pipeline.spool import atomic_write

SCHEMA_VERSION = 2  # 2 added gpu_oom; version-1 records (without it) are still read
VERSIONS = (1, 2)


JOB_ID = re.compile(r"\d+(?:[_+]\d+)?")  # as Slurm prints it: 123, 123_4 (array), 123+1 (hetjob)


class GpuRecord(NamedTuple):
    index: int  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema
    uuid: str
    name: str
    memory_total_mib: float
    peak_mem_mib: float
    peak_proc_mem_mib: float | None
    mean_util: float
    max_util: float
    samples: int



class Collected(NamedTuple):
    samples: int
    gpus: tuple[GpuRecord, ...]
    peak_gpu_mem_mib: float
    mean_gpu_util: float
    max_gpu_util: float



class GpuOomRecord(NamedTuple):
    """A GPU out-of-memory message found in the job's stderr when it ended (``collector.oom``)."""

    framework: str  # pytorch, cuda, tensorflow, jax
    line: str  # the matching line, at most 300 characters


class JobRecord(NamedTuple):
    """One job on one node: the spool file's content (schema version 2; version 1 lacks gpu_oom)."""

    version: int
    source: str
    cluster: str
    job_id: str
    hostname: str
    user: str | None
    start: datetime
    end: datetime
    interval_s: float
    samples: int
    gpus: tuple[GpuRecord, ...]
    peak_gpu_mem_mib: float
    mean_gpu_util: float
    max_gpu_util: float
    gpu_oom: GpuOomRecord | None = None  # None: no GPU OOM message found (or stderr not readable)



def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")



def record_to_json(record: JobRecord) -> dict[str, Any]:
    out = record._asdict()
    out.update(start=_iso(record.start), end=_iso(record.end), gpus=[g._asdict() for g in record.gpus],
               gpu_oom=record.gpu_oom._asdict() if record.gpu_oom is not None else None)
    return out



def record_filename(record: JobRecord) -> str:
    return f"{record.cluster}_{record.job_id}_{record.hostname}.json"



def write_record(record: JobRecord, spool: str) -> str:
    """Write ``record`` into ``spool`` as ``<cluster>_<jobid>_<hostname>.json``, mode 0640; return its path."""
    path = os.path.join(spool, record_filename(record))
    atomic_write(path, (json.dumps(record_to_json(record), indent=2) + "\n").encode(), 0o640)
    return path



_KINDS = {int: "int", float: "number", str: "string", datetime: "ISO-8601 UTC time"}
INT_LIMIT = 2**31  # every int field lands in a 32-bit SQL column
OOM_FRAMEWORK = re.compile(r"[a-z][a-z0-9_]{0,15}")  # the store's gpu_oom column holds 16 characters
STR_LIMITS = {"source": 16, "cluster": 64, "job_id": 64, "hostname": 128, "user": 64}  # the store's column widths
MAX_STR = 256  # any other string (GPU names, UUIDs)
MAX_GPUS = 256



def _check(kind: Any, value: object) -> object:
    """``value`` as a record field of type ``kind``; ValueError says what was expected."""
    optional = type(None) in get_args(kind)
    if optional:
        if value is None:
            return None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if kind is int and type(value) is int:
        if -INT_LIMIT < value < INT_LIMIT:
            return value
        raise ValueError(f"expected int of at most 31 bits, got {_show(value)}")
    if kind is float and type(value) in (int, float):
        if math.isfinite(value):  # type: ignore[arg-type]
            return float(value)  # type: ignore[arg-type]
        raise ValueError(f"expected a finite number, got {_show(value)}")
    if kind is str and isinstance(value, str):
        if len(value) <= MAX_STR and _storable(value):
            return value
        raise ValueError(f"expected string of at most {MAX_STR} characters, no NUL, valid UTF-8, got {_show(value)}")
    if kind is datetime and isinstance(value, str):
        with contextlib.suppress(ValueError):
            t = datetime.fromisoformat(value)
            if t.utcoffset() == timedelta(0):
                return t
    raise ValueError(f"expected {_KINDS[kind]}{' or null' if optional else ''}, got {_show(value)}")


def _storable(text: str) -> bool:
    """No NUL (PostgreSQL text refuses it) and no lone surrogate (no database encodes one)."""
    if "\0" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _show(value: object) -> str:
    try:
        return json.dumps(value)[:60]
    except ValueError:  # a float json cannot write
        return repr(value)[:60]



def _fields(cls: type[Any], obj: object, where: str, absent: Any = ()) -> dict[str, Any]:
    """The fields of ``cls`` read from ``obj``, each checked against its type hint (so typed Any here:
    the values are as heterogeneous as the NamedTuple's fields, and were checked at run time)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where or 'record'}: expected an object")
    out: dict[str, Any] = {}
    for field, kind in get_type_hints(cls).items():
        name = f"{where}.{field}" if where else field
        if field in absent:
            continue
        if field not in obj:
            raise ValueError(f"{name}: missing")
        if field == "gpu_oom":
            out[field] = None if obj[field] is None else GpuOomRecord(**_fields(GpuOomRecord, obj[field], name))
            if out[field] is not None and not OOM_FRAMEWORK.fullmatch(out[field].framework):
                raise ValueError(f"{name}.framework: expected a short lower-case name, got {out[field].framework!r}")
            continue
        if field == "gpus":
            if not isinstance(obj[field], list) or not 1 <= len(obj[field]) <= MAX_GPUS:
                raise ValueError(f"{name}: expected a non-empty list of at most {MAX_GPUS} GPUs")
            out[field] = tuple(GpuRecord(**_fields(GpuRecord, g, f"gpus[{i}]")) for i, g in enumerate(obj[field]))
            continue
        try:
            out[field] = _check(kind, obj[field])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        limit = STR_LIMITS.get(field) if not where else None
        if isinstance(out[field], str) and limit is not None and not 0 < len(out[field]) <= limit:
            raise ValueError(f"{name}: expected 1 to {limit} characters, got {len(out[field])}")
    return out



def read_record(path: str) -> JobRecord:
    """Read and validate one spool file; ValueError names the file and the offending field.

    Unknown keys are ignored, so adding a field does not need a new version. (The ingest opens
    spool files itself, refusing anything but a small regular file, and calls parse_record.)
    """
    with open(path, "rb") as f:
        raw = f.read()
    return parse_record(raw, path)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a record may hold")


def parse_record(raw: bytes, where: str) -> JobRecord:
    """Validate a record's bytes; ValueError names ``where`` and the offending field."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{where}: not JSON: {exc}") from None
    try:
        version = data.get("version") if isinstance(data, dict) else None
        if isinstance(data, dict) and (type(version) is not int or version not in VERSIONS):
            raise ValueError(f"version: expected one of {', '.join(map(str, VERSIONS))}, got {_show(version)}")
        # Version 1 has no gpu_oom (None: nothing known); from version 2 on it must be there, object or null.
        record = JobRecord(**_fields(JobRecord, data, "", absent=("gpu_oom",) if version == 1 else ()))
        if not JOB_ID.fullmatch(record.job_id):
            raise ValueError(f"job_id: expected a Slurm job id such as 123, 123_4 or 123+0, got {record.job_id!r}")
        if record.end < record.start:
            raise ValueError("end: before start")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return record
