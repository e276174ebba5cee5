"""The Slurm queries through pyslurm (libslurm in-process): no fork and exec of sinfo, squeue,
scontrol or sacct per question (what that saves, and where pyslurm's own cost is higher:
docs/admins/pyslurm.md, measured by benchmarks/bench_backends.py).

Same answers as the CLI backend (tests/test_pyslurm_backend.py and tests/test_pyslurm_accounting.py
check them on the live cluster):
nodes, free GPUs, partitions with their access rules, the queue, and accounting rows, the last
rendered as sacct's own ``LIVE_FIELDS`` lines so that one parser (slurm/sacct.py) reads both.
Submission stays with sbatch (CliBackend.submit).

pyslurm 22.5 to 24.11 share the typed ``Nodes``/``Partitions`` API used here; jobs' TRES strings
are only in the older dict API (``job().get()``, ``slurmdb_jobs().get()``), which both keep, and
AdminComment only in the typed ``db.Jobs``: accounting reads both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from slurmgpu.slurm.backend import (
    SHARD_ITEM,
    CliBackend,
    NodeInfo,
    QueuedJob,
    SlurmError,
    local_time,
    parse_gres,
    queued_job,
)
from slurmgpu.slurm.partitions import PartitionRules, expand_hostlist
from slurmgpu.slurm.sacct import LIVE_DELIMITER, LIVE_FIELDS, format_duration

_NO_VAL = 0xFFFFFFFE
_INFINITE = 0xFFFFFFFF
_NO_VAL64 = 0xFFFFFFFFFFFFFFFE
_STEP_NAMES = {0xFFFFFFFB: "batch", 0xFFFFFFFC: "extern", 0xFFFFFFFD: "interactive"}
_UNITS = "MGTP"


class PyslurmBackend(CliBackend):
    """Queries through pyslurm; submission (and the version, which picked this backend) through the CLI."""

    name = "pyslurm"

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.pyslurm = module

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - pyslurm raises its own errors and ValueError alike
            raise SlurmError(f"pyslurm {what}: {exc}") from None

    def nodes(self) -> list[NodeInfo]:
        # Node.configured_gres is a dict such as {"gpu:a100": 4, "shard:x": 4}.
        out = []
        for n in self._call("nodes", self.pyslurm.Nodes.load).values():
            gres = _gres_text(n.configured_gres)
            out.append(NodeInfo(n.name, tuple(n.partitions or ()), parse_gres(gres), _sinfo_state(str(n.state)),
                                tuple(n.available_features or ()), parse_gres(gres, SHARD_ITEM)))
        return out

    def free_gpus(self) -> dict[str, int]:
        """Idle GPUs per type (as CliBackend.free_gpus: down, drained, failed and maintained nodes left out)."""
        free: dict[str, int] = {}
        for n in self._call("nodes", self.pyslurm.Nodes.load).values():
            state = str(n.state).lower()
            if any(s in state for s in ("down", "drain", "fail", "maint")):
                continue
            busy = parse_gres(_gres_text(n.allocated_gres))
            for gtype, count in parse_gres(_gres_text(n.configured_gres)).items():
                free[gtype] = free.get(gtype, 0) + count - busy.get(gtype, 0)
        return free

    def default_partition(self) -> str | None:
        for p in self._call("partitions", self.pyslurm.Partitions.load).values():
            if p.is_default:
                return str(p.name)
        return None

    def cluster_name(self) -> str | None:
        name = self._call("config", lambda: self.pyslurm.config().get().get("cluster_name"))
        return str(name) if name else None

    def partitions(self) -> dict[str, PartitionRules]:
        """Every partition's access rules, as partitions.parse_partitions reads them from scontrol."""
        # Partition.allow_root_jobs reads False on pyslurm 22.5.3 whatever DisableRootJobs says: the dict API's flag.
        flags = self._call("partitions", lambda: self.pyslurm.partition().get())
        return {str(p.name): _rules(p, bool((flags.get(p.name) or {}).get("flags", {}).get("DisableRootJobs")))
                for p in self._call("partitions", self.pyslurm.Partitions.load).values()}

    def queue(self) -> list[QueuedJob]:
        """Running and pending GPU jobs, highest priority first (squeue --sort=-p,i); held jobs left out."""
        jobs = self._call("jobs", lambda: self.pyslurm.job().get())
        out = []
        for job_id, j in sorted(jobs.items(), key=lambda kv: (-int(kv[1].get("priority") or 0), int(kv[0]))):
            state = j.get("job_state")
            if state not in ("RUNNING", "PENDING") or str(j.get("state_reason") or "").startswith("JobHeld"):
                continue
            running = state == "RUNNING"
            limit = j.get("time_limit")
            limit_s = float("inf") if not isinstance(limit, int) else limit * 60.0
            seconds = max(0.0, limit_s - float(j.get("run_time") or 0)) if running else limit_s
            tres = j.get("tres_alloc_str") or j.get("tres_req_str") or ""
            try:
                nodes = tuple(expand_hostlist(j.get("nodes") or "")) if running else ()
            except ValueError:
                continue
            q = queued_job(str(job_id), running, nodes, seconds, tres, int(j.get("num_nodes") or 1),
                           str(j.get("partition") or ""))
            if q is not None:
                out.append(q)
        return out

    def accounting(self, since: datetime | None = None, until: datetime | None = None,
                   job_ids: Sequence[str] = ()) -> Iterator[str]:
        """The lines ``CliBackend.accounting`` reads from sacct, for the same jobs: all users' jobs of
        this cluster active in [since, until] (naive UTC), or JOB_IDS (``123``, ``123_4``, ``123+1``)."""
        clusters = [str(self.pyslurm.settings.LOCAL_CLUSTER)]
        typed_filter: dict[str, Any] = {}
        if job_ids:
            window: dict[str, Any] = {"jobids": list(job_ids)}
        elif since is None or until is None:
            raise ValueError("accounting: a time window or job ids")
        else:
            window = {"starttime": local_time(since).encode(), "endtime": local_time(until).encode()}
            typed_filter = {"start_time": _epoch(since), "end_time": _epoch(until)}
        # NO_TRUNC, as sacct without --truncate: times as they were, not cut to the window.
        raw = self._call("accounting", lambda: self.pyslurm.slurmdb_jobs().get(
            clusters=clusters, flags=self.pyslurm.JOBCOND_FLAG_NO_TRUNC, **window))
        if not raw:
            return
        if job_ids:  # the jobs found, by their raw ids
            typed_filter = {"ids": sorted(int(i) for i in raw)}
        # AdminComment (the decision tag's place) is only in the typed API: asked for the same jobs, on one
        # connection with the TRES names. Its jobs carry their QOS names too.
        db = self.pyslurm.db
        conn = self._call("accounting", db.Connection.open)
        try:
            typed = self._call("accounting", db.Jobs.load, db.JobFilter(clusters=clusters, **typed_filter), conn)
            tres = {int(t.id): str(name) for name, t in self._call("TRES", db.TrackableResources.load, conn).items()}
        finally:
            conn.close()
        for job_id in sorted(raw):
            j = raw[job_id]
            row = _job_row(j, typed.get(int(job_id)), tres)
            yield LIVE_DELIMITER.join(row[f] for f in LIVE_FIELDS)
            for step_id in sorted(j.get("steps") or {}, key=_step_order):
                row = _step_row(j, step_id, j["steps"][step_id], tres)
                yield LIVE_DELIMITER.join(row.get(f, "") for f in LIVE_FIELDS)


def _gres_text(gres: Mapping[str, int] | None) -> str:
    return ",".join(f"{k}:{v}" for k, v in (gres or {}).items())


def _sinfo_state(state: str) -> str:
    """pyslurm's ``IDLE+DRAIN`` as sinfo's %T prints it (``drained``; ``idle*`` for a node that does
    not respond)."""
    base, _, flags = state.lower().partition("+")
    lost = "*" if "not_responding" in flags else ""
    if "drain" in flags:
        return ("drained" if base == "idle" else "draining") + lost
    return base + lost


def _allowed(names: list[str] | None) -> frozenset[str] | None:
    return None if not names or "ALL" in names else frozenset(names)


def _denied(names: list[str] | None) -> frozenset[str]:
    # pyslurm reports an unset deny list as ['ALL'] (a deny list of ALL cannot be configured).
    return frozenset() if not names or "ALL" in names else frozenset(names)


def _limit(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def _rules(p: Any, disable_root_jobs: bool) -> PartitionRules:
    nodes_text = str(p.nodes or "")
    try:
        nodes: frozenset[str] | None = None if nodes_text.upper() == "ALL" else frozenset(expand_hostlist(nodes_text))
    except ValueError:
        nodes = None
    return PartitionRules(
        name=str(p.name), state=str(p.state).upper(),
        allow_groups=_allowed(p.allowed_groups), allow_accounts=_allowed(p.allowed_accounts),
        deny_accounts=_denied(p.denied_accounts), allow_qos=_allowed(p.allowed_qos), deny_qos=_denied(p.denied_qos),
        max_time_min=_limit(p.max_time), max_nodes=_limit(p.max_nodes), nodes=nodes,
        root_only=bool(p.is_root_only), disable_root_jobs=disable_root_jobs)


def _epoch(t: datetime) -> int:
    """Naive UTC to seconds since the epoch."""
    return int(t.replace(tzinfo=UTC).timestamp())


def _time(epoch: int | None) -> str:
    """sacct's local wall-clock time; ``Unknown`` when unset, ``None`` when Slurm marks it NO_VAL (a job
    cancelled before it started)."""
    if epoch == _NO_VAL:
        return "None"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch)) if epoch and epoch != _INFINITE else "Unknown"


def _size_mb(mb: int) -> str:
    """A MB count as sacct prints it in a TRES string: 500M, 16000M, 2G (exact units only)."""
    unit = 0
    while mb and mb % 1024 == 0 and unit < len(_UNITS) - 1:
        mb //= 1024
        unit += 1
    return f"{mb}{_UNITS[unit]}"


def _tres_values(ids: str | None, names: Mapping[int, str]) -> dict[str, str]:
    """``1=1,2=500,1001=1`` by TRES name (``{'cpu': '1', 'mem': '500', 'gres/gpu': '1'}``), unset (NO_VAL) ones left
    out; memory as given: MB in a request or allocation, bytes in usage (which sacct.parse_size_mib reads as such)."""
    out = {}
    for item in (ids or "").split(","):
        key, _, value = item.partition("=")
        if key.isdigit() and value.isdigit() and int(value) < _NO_VAL64 and int(key) in names:
            out[names[int(key)]] = value
    return out


def _tres_text(values: Mapping[str, str]) -> str:
    """A job's TRES as sacct prints them: ``billing=1,cpu=1,gres/gpu:a100=1,gres/gpu=1,mem=500M,node=1``
    (memory in MB to its exact unit, items sorted as whole ``name=value`` strings)."""
    return ",".join(sorted(f"{k}={_size_mb(int(v)) if k == 'mem' else v}" for k, v in values.items()))


def _exit_code(status: int | None) -> str:
    """A wait status as sacct's ``exit:signal``: sacct takes 128 off an exit status of 128 or more (a shell's
    128+signal), so a batch script killed by scancel's SIGTERM through its shell reads ``15:0``, not ``143:0``."""
    status = int(status or 0)
    if os.WIFSIGNALED(status):
        return f"0:{os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return f"{code - 128 if code >= 128 else code}:0"


def _job_id(j: Mapping[str, Any]) -> str:
    array, task = int(j.get("array_job_id") or 0), j.get("array_task_id")
    if not array:
        return str(j["jobid"])
    if j.get("array_task_str"):
        return f"{array}_[{j['array_task_str']}]"
    return f"{array}_{task}" if task is not None and int(task) < _NO_VAL else str(j["jobid"])


def _state(j: Mapping[str, Any]) -> str:
    state = str(j.get("state_str") or "")
    requid = j.get("requid")
    if state == "CANCELLED" and requid is not None and int(requid) < _NO_VAL:
        return f"CANCELLED by {requid}"
    return state


def _time_limit(minutes: int | None) -> str:
    if minutes is None or minutes == _INFINITE:
        return "UNLIMITED"
    if minutes == _NO_VAL:
        return "Partition_Limit"
    return format_duration(int(minutes) * 60)


def _job_row(j: Mapping[str, Any], typed: Any, tres: Mapping[int, str]) -> dict[str, str]:
    alloc, req = (_tres_values(j.get(key), tres) for key in ("tres_alloc_str", "tres_req_str"))
    # NNodes and NCPUS: from the allocation once it has any TRES string (none while pending), else the request.
    counts = alloc if j.get("tres_alloc_str") else req
    # ReqMem: the job's whole request (its TRES), not the per-CPU figure.
    req_mem = int(req.get("mem") or j.get("req_mem") or 0)
    return {
        "JobID": _job_id(j), "JobIDRaw": str(j["jobid"]), "Cluster": str(j.get("cluster") or ""),
        "User": str(j.get("user") or ""), "Account": str(j.get("account") or ""),
        "Partition": str(j.get("partition") or ""), "QOS": str(getattr(typed, "qos", None) or ""),
        "Submit": _time(j.get("submit")), "Eligible": _time(j.get("eligible")), "Start": _time(j.get("start")),
        "End": _time(j.get("end")), "Elapsed": format_duration(int(j.get("elapsed") or 0)),
        "Timelimit": _time_limit(j.get("timelimit")), "State": _state(j), "ExitCode": _exit_code(j.get("exitcode")),
        "ReqTRES": _tres_text(req), "AllocTRES": _tres_text(alloc), "NNodes": counts.get("node", "0"),
        "NCPUS": counts.get("cpu", "0"), "ReqMem": _size_mb(req_mem) if req_mem else "0",
        "MaxRSS": "", "TRESUsageInMax": "", "NodeList": str(j.get("nodes") or "None assigned"),
        "JobName": str(j.get("jobname") or ""),
        "AdminComment": str(getattr(typed, "admin_comment", None) or ""),
        "Comment": str(getattr(typed, "comment", None) or ""),
    }


def _step_order(step_id: int) -> tuple[int, int]:
    return (0 if step_id in _STEP_NAMES else 1, step_id)


def _step_row(j: Mapping[str, Any], step_id: int, step: Mapping[str, Any], tres: Mapping[int, str]) -> dict[str, str]:
    """The step fields the parser folds into its job: JobID, MaxRSS and TRESUsageInMax."""
    usage = _tres_values((step.get("stats") or {}).get("tres_usage_in_max"), tres)
    return {"JobID": f"{_job_id(j)}.{_STEP_NAMES.get(step_id, step_id)}", "State": str(step.get("state_str") or ""),
            "MaxRSS": usage.get("mem", ""),
            "TRESUsageInMax": ",".join(f"{k}={v}" for k, v in sorted(usage.items()))}
