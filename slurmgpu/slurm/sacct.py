"""Parse sacct's parsable output into job records, folding steps into their job.

Pure functions over lines of text, so the same code reads a live ``sacct`` pipe, a saved
export and the test fixtures captured from the real cluster. Every value format sacct prints is
handled here (durations, sizes, TRES strings, states, job id forms); a row that cannot be read
becomes a ``RowError`` with its line number instead of stopping the load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, NamedTuple

# What live ingest asks sacct for. Free text (JobName, Comment) may hold the delimiter: the
# live run uses an unprintable delimiter, and Comment is last so extra '|' in an export can
# only belong to it.
FIELDS = (
    "JobID", "JobIDRaw", "Cluster", "User", "Account", "Partition", "QOS", "Submit", "Eligible", "Start",
    "End", "Elapsed", "Timelimit", "State", "ExitCode", "ReqTRES", "AllocTRES", "NNodes", "NCPUS", "ReqMem",
    "MaxRSS", "TRESUsageInMax", "NodeList", "JobName", "Comment",
)
# The live ingest also reads AdminComment, where the hook's decision tag is (users cannot set it);
# an export without it (the FIELDS above) simply has no tags.
LIVE_FIELDS = (*FIELDS[:-1], "AdminComment", "Comment")
REQUIRED = ("JobID", "State")
LIVE_DELIMITER = "\x1f"

_JOBID = re.compile(r"^(\d+)(?:_(\d+|\[[^\]]*\]))?(?:\+(\d+))?(?:\.(\S+))?$")
_DURATION = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)[nc]?$", re.IGNORECASE)
_STATE = re.compile(r"^([A-Z_]+)\+?(?: by (\d+))?$")
_SIZE_MIB = {"": 1 / 1024 / 1024, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2, "P": 1024.0**3}
_NONE = frozenset(("", "Unknown", "None", "None assigned", "INVALID", "N/A"))


class RowError(NamedTuple):
    line: int
    message: str


class JobRecord(NamedTuple):
    """One job's columns for the ``jobs`` table (steps already folded in)."""

    values: dict[str, Any]
    line: int


class ParseError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")


def parse_duration(text: str, field: str = "Elapsed") -> int | None:
    """``[D-][HH:]MM:SS[.mmm]`` to whole seconds; None for UNLIMITED and the like."""
    seconds = parse_duration_exact(text, field)
    return None if seconds is None else int(seconds)


def parse_duration_exact(text: str, field: str = "TotalCPU") -> float | None:
    """``parse_duration`` with the fraction kept (the TotalCPU of a short job is mostly fraction)."""
    if text in _NONE or text in ("UNLIMITED", "Partition_Limit"):
        return None
    m = _DURATION.match(text)
    if not m:
        raise ParseError(field, f"invalid duration {text!r}")
    days, hours, minutes, seconds = m.groups()
    return int(days or 0) * 86400 + int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)


def format_duration(seconds: int) -> str:
    """``[D-]HH:MM:SS``, as sbatch accepts and sacct prints it (parse_duration's inverse)."""
    days, rest = divmod(int(seconds), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def parse_size_mib(text: str, field: str = "MaxRSS") -> float | None:
    """``1104K``, ``1.5G``, ``4000Mc`` (older per-CPU suffix) to MiB; plain numbers are bytes."""
    if text in _NONE or text == "0":
        return None if text in _NONE else 0.0
    if field == "ReqMem" and text.endswith("?"):
        # slurmdbd's row of a job that has just ended, before it is whole (seen on 22.05: "16?" for a
        # 500M request, with QOS and Eligible "Unknown"): no request to read yet, not a bad row.
        return None
    m = _SIZE.match(text)
    if not m:
        raise ParseError(field, f"invalid size {text!r}")
    unit = m.group(2).upper()
    if not unit and field == "ReqMem":
        unit = "M"  # ReqMem without a unit is in MB
    return float(m.group(1)) * _SIZE_MIB[unit]


@lru_cache(maxsize=4096)
def _utc_offset(hour: str) -> timedelta:
    """The local zone's offset for one local hour (it can only change on the hour)."""
    local = datetime.fromisoformat(hour)
    return local - local.astimezone(UTC).replace(tzinfo=None)


def parse_time(text: str, field: str) -> datetime | None:
    """sacct prints local wall-clock time; store naive UTC."""
    if text in _NONE:
        return None
    try:
        local = datetime.fromisoformat(text)
    except ValueError:
        raise ParseError(field, f"invalid time {text!r}") from None
    return local - _utc_offset(text[:13])


def parse_tres(text: str) -> dict[str, str]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def gpus_of(tres: dict[str, str]) -> tuple[str | None, int]:
    """GPU type (when exactly one) and count from a TRES dict such as sacct's AllocTRES."""
    typed = {k[len("gres/gpu:"):]: int(v) for k, v in tres.items() if k.startswith("gres/gpu:") and v.isdigit()}
    total = tres.get("gres/gpu")
    count = int(total) if total and total.isdigit() else sum(typed.values())
    return (next(iter(typed)) if len(typed) == 1 else None), count


def _int(text: str, field: str) -> int | None:
    if text in _NONE:
        return None
    try:
        return int(text)
    except ValueError:
        raise ParseError(field, f"not a whole number: {text!r}") from None


def _job_values(row: dict[str, str], cluster: str | None) -> dict[str, Any]:
    m = _JOBID.match(row["JobID"])
    if not m:
        raise ParseError("JobID", f"invalid job id {row['JobID']!r}")
    state_text = row["State"]
    sm = _STATE.match(state_text)
    if not sm:
        raise ParseError("State", f"invalid state {state_text!r}")
    req, alloc = parse_tres(row.get("ReqTRES", "")), parse_tres(row.get("AllocTRES", ""))
    gpu_type, gpu_count = gpus_of(alloc if alloc else req)
    if gpu_type is None and gpu_count:
        gpu_type = gpus_of(req)[0]
    exit_code, _, exit_signal = row.get("ExitCode", "").partition(":")
    array_task = m.group(2)
    req_mem = parse_size_mib(row["ReqMem"], "ReqMem") if row.get("ReqMem") else None
    return {
        "cluster": row.get("Cluster") or cluster or "default",
        "job_id": row["JobID"],
        "job_id_raw": _int(row.get("JobIDRaw", ""), "JobIDRaw"),
        "array_job_id": int(m.group(1)) if array_task is not None else None,
        "array_task_id": int(array_task) if array_task and array_task.isdigit() else None,
        "het_job_id": int(m.group(1)) if m.group(3) is not None else None,
        "het_offset": int(m.group(3)) if m.group(3) is not None else None,
        "name": row.get("JobName") or None,
        "user": row.get("User") or None,
        "account": row.get("Account") or None,
        "partition": row.get("Partition") or None,
        "qos": row.get("QOS") or None,
        "submit_time": parse_time(row.get("Submit", ""), "Submit"),
        "eligible_time": parse_time(row.get("Eligible", ""), "Eligible"),
        "start_time": parse_time(row.get("Start", ""), "Start"),
        "end_time": parse_time(row.get("End", ""), "End"),
        "elapsed_s": parse_duration(row.get("Elapsed", ""), "Elapsed"),
        "time_limit_s": parse_duration(row.get("Timelimit", ""), "Timelimit"),
        "state": sm.group(1),
        "state_detail": state_text if state_text != sm.group(1) else None,
        "exit_code": _int(exit_code, "ExitCode"),
        "exit_signal": _int(exit_signal, "ExitCode"),
        "req_tres": row.get("ReqTRES") or None,
        "alloc_tres": row.get("AllocTRES") or None,
        "gpu_type": gpu_type,
        "gpu_count": gpu_count,
        "nodes": _int(row.get("NNodes", ""), "NNodes"),
        "cpus": _int(row.get("NCPUS", ""), "NCPUS"),
        "req_mem_mb": int(req_mem) if req_mem is not None else None,
        "max_rss_mb": parse_size_mib(row.get("MaxRSS", ""), "MaxRSS"),
        "node_list": None if row.get("NodeList", "") in _NONE else row["NodeList"],
        "comment": row.get("Comment") or None,
        "admin_comment": row.get("AdminComment") or None,  # the decision tag's place: users cannot set it
        "sacct_gpu_mem_mib": None,
        "sacct_gpu_util": None,
    }


def gpu_usage_is_summed(version: str) -> bool:
    """From Slurm 24.05.1 a step's ``gres/gpumem`` and ``gres/gpuutil`` add up the GPUs its task
    used; before, they were one GPU's figures."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    return numbers >= (24, 5, 1)


def _fold_step(job: dict[str, Any], row: dict[str, str], summed: bool = False) -> None:
    """Take a step's usage maxima into its job (GPU memory/utilisation, RSS).

    Where the figures are sums (``summed``), the batch step's are divided by the GPUs of the
    job's first node, which its one task holds: the per-GPU mean. Other steps' tasks may each
    hold one GPU, so their sums are kept as they are: an upper bound, never an under-estimate."""
    usage = parse_tres(row.get("TRESUsageInMax", ""))
    share = 1.0
    if summed and row.get("JobID", "").endswith(".batch") and job.get("gpu_count"):
        share = max(1.0, job["gpu_count"] / max(1, job.get("nodes") or 1))
    if "gres/gpumem" in usage:
        mem = parse_size_mib(usage["gres/gpumem"], "TRESUsageInMax")
        if mem is not None:
            job["sacct_gpu_mem_mib"] = max(job["sacct_gpu_mem_mib"] or 0.0, mem / share)
    if "gres/gpuutil" in usage and usage["gres/gpuutil"].replace(".", "", 1).isdigit():
        job["sacct_gpu_util"] = max(job["sacct_gpu_util"] or 0.0, float(usage["gres/gpuutil"]) / share)
    rss = parse_size_mib(row.get("MaxRSS", ""), "MaxRSS")
    if rss is not None:
        job["max_rss_mb"] = max(job["max_rss_mb"] or 0.0, rss)


def split_fields(line: str, nfields: int, delimiter: str) -> list[str] | None:
    """Split one line; tolerate --parsable's trailing delimiter and delimiters inside the last field."""
    parts = line.split(delimiter)
    if len(parts) > nfields and parts[-1] == "":
        parts.pop()  # --parsable ends every line with the delimiter
    if len(parts) > nfields:
        parts[nfields - 1:] = [delimiter.join(parts[nfields - 1:])]
    return parts if len(parts) == nfields else None


def parse_lines(lines: Iterable[str], fields: tuple[str, ...] | None = None, delimiter: str = "|",
                cluster: str | None = None, summed_gpu_usage: bool = False) -> Iterator[JobRecord | RowError]:
    """Yield one JobRecord per job (after its steps) or a RowError per unreadable row.

    A first line that names the fields is a header: it is skipped, and it gives the field
    order when none was passed. ``summed_gpu_usage``: the text comes from a Slurm that sums GPU
    usage over a step's GPUs (see gpu_usage_is_summed).
    """
    current: dict[str, Any] | None = None
    current_line = 0
    current_key = ""
    orphan_steps: dict[str, list[dict[str, str]]] = {}
    lineno = 0
    for lineno, raw in enumerate(lines, 1):
        line = raw.rstrip("\n")
        if not line:
            continue
        if lineno == 1 and _is_header(line, delimiter, fields):
            if fields is None:
                fields = tuple(f for f in line.split(delimiter) if f)
            continue
        if fields is None:
            fields = FIELDS
            _check_fields(fields)
        parts = split_fields(line, len(fields), delimiter)
        if parts is None:
            yield RowError(lineno, f"expected {len(fields)} fields, found {len(line.split(delimiter))}")
            continue
        row = dict(zip(fields, parts, strict=True))
        job_id = row.get("JobID", "")
        key, dot, _ = job_id.partition(".")
        try:
            if dot:
                if current is not None and key == current_key:
                    _fold_step(current, row, summed_gpu_usage)
                else:
                    _fold_step({"sacct_gpu_mem_mib": None, "sacct_gpu_util": None, "max_rss_mb": None}, row)
                    orphan_steps.setdefault(key, []).append(row)
                continue
            values = _job_values(row, cluster)
        except ParseError as exc:
            yield RowError(lineno, str(exc))
            continue
        if current is not None:
            yield JobRecord(current, current_line)
        current, current_key, current_line = values, key, lineno
        for step in orphan_steps.pop(key, ()):
            _fold_step(current, step, summed_gpu_usage)
    if current is not None:
        yield JobRecord(current, current_line)


def _is_header(line: str, delimiter: str, fields: tuple[str, ...] | None) -> bool:
    names = [f for f in line.split(delimiter) if f]
    if fields is not None and names == list(fields):
        return True
    return bool(names) and names[0] in ("JobID", "JobIDRaw")


def _check_fields(fields: tuple[str, ...]) -> None:
    missing = [f for f in REQUIRED if f not in fields]
    if missing:
        raise ValueError(f"--format must include {', '.join(missing)}")


def format_fields(spec: str) -> tuple[str, ...]:
    """A user-given --format list: sacct's names in any case and order, widths (``%20``)
    dropped; fields slurmgpu does not use are read past."""
    known = {f.lower(): f for f in LIVE_FIELDS}
    out = []
    for name in spec.split(","):
        base = name.split("%")[0].strip()
        if not re.fullmatch(r"[A-Za-z]+", base):
            raise ValueError(f"--format: invalid field name {name!r}")
        out.append(known.get(base.lower(), base))
    fields = tuple(out)
    _check_fields(fields)
    return fields
