"""What Slurm says of jobs right now, and of a user's standing: seff's CPU and host-memory figures,
running jobs, Slurm administrators and account coordinators.

Read when asked, as Slurm's own ``seff`` does: the history database has no TotalCPU, and a job
that is still running (or that the nightly ingest has not loaded yet) is only in Slurm. Every
command is held to a timeout and a failure is None, never an exception: a viewer falls back to
what the history holds and says what is missing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from slurmgpu.slurm.sacct import (
    FIELDS,
    LIVE_DELIMITER,
    JobRecord,
    ParseError,
    parse_duration_exact,
    parse_lines,
    parse_size_mib,
    parse_tres,
    split_fields,
)

Runner = Callable[[Sequence[str]], "str | None"]  # a command's stdout, or None when it failed
TIMEOUT_S = 5.0
LIVE_FIELDS = (*FIELDS[:-1], "TotalCPU", FIELDS[-1])  # Comment stays last: it may hold the delimiter
ADMIN_LEVELS = frozenset({"Administrator", "Operator"})  # sacctmgr AdminLevel that sees every job


def run_command(argv: Sequence[str], timeout_s: float = TIMEOUT_S) -> str | None:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, errors="replace", timeout=timeout_s,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


class HostUse(NamedTuple):
    """A job's CPU and host-memory use, the figures ``seff`` gives. ``live``: a running job's use
    so far (sstat). MaxRSS is the largest task's, so with several tasks on a node it is a floor."""

    cpus: int | None
    elapsed_s: int | None
    total_cpu_s: float | None  # user + system CPU time of all the job's steps
    max_rss_mib: float | None
    req_mem_mib: float | None  # requested host memory per node
    live: bool = False

    @property
    def cpu_efficiency(self) -> float | None:
        """CPU time used over CPU time allocated (CPUs x elapsed), as seff's "CPU Efficiency"."""
        if self.total_cpu_s is None or not self.cpus or not self.elapsed_s:
            return None
        return self.total_cpu_s / (self.cpus * self.elapsed_s)

    @property
    def mem_efficiency(self) -> float | None:
        """Peak resident memory over the memory asked for, as seff's "Memory Efficiency"."""
        if self.max_rss_mib is None or not self.req_mem_mib:
            return None
        return self.max_rss_mib / self.req_mem_mib


class LiveJob(NamedTuple):
    """One job as sacct has it now: the history's ``jobs`` columns, and its CPU/memory use."""

    values: dict[str, Any]
    use: HostUse


def _req_mem_per_node(values: dict[str, Any]) -> float | None:
    mem = parse_tres(values.get("req_tres") or "").get("mem")
    total = parse_size_mib(mem, "ReqMem") if mem else values.get("req_mem_mb")
    return float(total) / max(1, values.get("nodes") or 1) if total else None


def live_jobs(job_ids: Sequence[str], cluster: str | None = None,
              run: Runner = run_command) -> dict[str, LiveJob] | None:
    """The jobs sacct knows among ``job_ids`` (one sacct call), by the id asked for; a running
    one's CPU time and peak memory so far come from sstat (sacct has them only once a step ends).
    None when sacct could not be asked (it failed or did not answer in time): that is not a job
    accounting does not know."""
    if not job_ids:
        return {}
    argv = ["sacct", "--noheader", "--parsable2", f"--delimiter={LIVE_DELIMITER}", "--format=" + ",".join(LIVE_FIELDS),
            "-j", ",".join(job_ids)]
    out = run([*argv, "-M", cluster] if cluster else argv)
    if out is None:
        return None
    lines = out.splitlines()
    total_cpu: dict[str, float | None] = {}
    at = LIVE_FIELDS.index("TotalCPU")
    for line in lines:
        parts = split_fields(line, len(LIVE_FIELDS), LIVE_DELIMITER)
        if parts and "." not in parts[0]:
            try:
                total_cpu[parts[0]] = parse_duration_exact(parts[at])
            except ParseError:
                total_cpu[parts[0]] = None
    found: dict[str, LiveJob] = {}
    wanted = set(job_ids)
    for item in parse_lines(lines, LIVE_FIELDS, LIVE_DELIMITER, cluster):
        if not isinstance(item, JobRecord):
            continue
        v = item.values
        key = v["job_id"] if v["job_id"] in wanted else str(v["job_id_raw"])
        if key not in wanted or key in found:
            continue
        use = HostUse(v["cpus"], v["elapsed_s"], total_cpu.get(v["job_id"]), v["max_rss_mb"], _req_mem_per_node(v))
        if v["state"] == "RUNNING":
            use = _running(v["job_id"], use, run)
        found[key] = LiveJob(v, use)
    return found


def _running(job_id: str, use: HostUse, run: Runner) -> HostUse:
    """A running job's CPU time and peak memory so far, summed and maxed over its steps (sstat)."""
    out = run(["sstat", "--noheader", "--parsable2", "--allsteps", "--format=JobID,MaxRSS,TRESUsageInTot",
               "-j", job_id])
    if out is None:
        return use._replace(total_cpu_s=None, live=True)
    cpu, rss = 0.0, use.max_rss_mib
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) < 3:
            continue
        try:
            step_rss = parse_size_mib(parts[1]) if parts[1] else None
            step_cpu = parse_duration_exact(parse_tres(parts[2]).get("cpu", "")) if "cpu=" in parts[2] else None
        except ParseError:
            continue
        rss = max(rss or 0.0, step_rss) if step_rss is not None else rss
        cpu += step_cpu or 0.0
    return use._replace(total_cpu_s=cpu, max_rss_mib=rss, live=True)


class Standing(NamedTuple):
    """A user's rights in Slurm's accounting: an AdminLevel that sees every job, and the accounts
    they coordinate (whose jobs they may see, as sacct lets them)."""

    admin: bool
    coordinates: frozenset[str]


def standing(user: str, run: Runner = run_command) -> Standing:
    """From ``sacctmgr show user withcoord``; nothing (an ordinary user) when it cannot be read."""
    out = run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "withcoord",
               "format=User,AdminLevel,Coordinators"])
    for line in (out or "").splitlines():
        name, _, rest = line.partition("|")
        level, _, coords = rest.partition("|")
        if name == user:
            return Standing(level in ADMIN_LEVELS, frozenset(a for a in coords.strip().split(",") if a))
    return Standing(False, frozenset())
