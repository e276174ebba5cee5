"""slurmgpu-monitor: what each job really used of its GPUs, one JSON record per job and node.

The learner needs peak memory and utilisation per job; accounting does not keep them. A collector
runs beside each job (started by the Slurm Prolog, or by the job itself), samples NVML every few
seconds and, when the job ends, writes one record atomically into a spool directory for the ingest.
It must never make a job fail, so every failure is one warning line on stderr and exit status 0.
Only the standard library is imported up front; pynvml is imported when the real GPUs are asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

from slurmgpu.collector.devices import (
    MIB,
    DeviceError,
    DeviceInfo,
    GpuDevices,
    NvmlDevices,
    RecordedDevices,
    Sample,
    TraceEnded,
    select_gpus,
)
from slurmgpu.collector.oom import scan_stderr
from slurmgpu.collector.records import (
    JOB_ID,
    MAX_STR,
    SCHEMA_VERSION,
    Collected,
    GpuOomRecord,
    GpuRecord,
    JobRecord,
    write_record,
)
from slurmgpu.pipeline.spool import atomic_write

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_WARNING = "slurmgpu-monitor: warning:"


class _GpuStats:
    """Running peak, sum and max for one GPU, so memory does not grow with the job's length."""

    __slots__ = ("info", "n", "peak_mem", "peak_proc", "util_max", "util_sum")

    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self.n = self.peak_mem = 0
        self.peak_proc: int | None = None
        self.util_sum = self.util_max = 0.0

    def add(self, s: Sample) -> None:
        self.n += 1
        self.peak_mem = max(self.peak_mem, s.memory_used)
        if s.proc_memory is not None:
            self.peak_proc = max(self.peak_proc or 0, s.proc_memory)
        self.util_sum += s.util
        self.util_max = max(self.util_max, s.util)

    def record(self) -> GpuRecord:
        i = self.info
        return GpuRecord(i.index, i.uuid, i.name, i.memory_total / MIB, self.peak_mem / MIB,
                         None if self.peak_proc is None else self.peak_proc / MIB,
                         self.util_sum / self.n if self.n else 0.0, self.util_max, self.n)


class Collector:
    """Samples the job's GPUs every ``interval`` seconds until ``stop`` is set, ``pid`` exits,
    ``duration`` has passed, or a replayed trace ends. Clock and sleep are injectable for tests;
    the default sleep waits on ``stop`` so a signal ends it at once."""

    def __init__(self, devices: GpuDevices, gpus: Sequence[DeviceInfo], interval: float = 5.0, *,
                 duration: float | None = None, pid: int | None = None, stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] | None = None) -> None:
        self.devices, self.interval, self.duration, self.pid = devices, interval, duration, pid
        self.stop = stop or threading.Event()
        self._clock = clock
        self._sleep = sleep or self.stop.wait
        self._stats = [_GpuStats(g) for g in gpus]
        self._samples = 0
        self._start = 0.0

    def run(self) -> Collected:
        self._start = self._clock()
        try:
            self._tick()
            while True:
                self._sleep(self._wait())
                if self._done():
                    break
                self._tick()
        except TraceEnded:
            pass
        return self._collected()

    def _tick(self) -> None:
        pids = _process_tree(self.pid) if self.pid is not None else None
        taken = [self.devices.sample(s.info.index, pids) for s in self._stats]  # all or none, per tick
        for stats, sample in zip(self._stats, taken, strict=True):
            stats.add(sample)
        self._samples += 1

    def _wait(self) -> float:
        if self.duration is None:
            return self.interval
        return max(0.0, min(self.interval, self._start + self.duration - self._clock()))

    def _done(self) -> bool:
        return (self.stop.is_set()
                or (self.duration is not None and self._clock() - self._start >= self.duration)
                or (self.pid is not None and not _alive(self.pid)))

    def _collected(self) -> Collected:
        gpus = tuple(s.record() for s in self._stats)
        n = sum(s.n for s in self._stats)
        return Collected(self._samples, gpus, max((g.peak_mem_mib for g in gpus), default=0.0),
                         sum(s.util_sum for s in self._stats) / n if n else 0.0,
                         max((g.max_util for g in gpus), default=0.0))


def _stat(pid: int | str) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...); None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs; a zombie (exited, not yet reaped by its parent) does not."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def _process_tree(root: int) -> frozenset[int]:
    """``root`` and its descendants (NVML reports GPU memory per PID; the job's are below its PID)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return frozenset(tree)


# ---- the job's outcome: a GPU OOM in its stderr -----------------------------------------------

SCONTROL_TIMEOUT_S = 5.0
# `scontrol show job -o` prints "... StdErr=<path> StdIn=<path> ..."; the path may hold spaces.
_STDERR = re.compile(r" StdErr=(.*?) StdIn=")


def job_stderr(job_id: str, timeout: float = SCONTROL_TIMEOUT_S) -> str | None:
    """The job's stderr path as slurmctld holds it (it still knows the job in the Epilog), or None.

    A user's comment or job name could spell " StdErr=" too: the path is only a hint, and the file
    is read only when the job's own user owns it (``scan_stderr(owner=...)``)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             errors="surrogateescape", timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    found = _STDERR.findall(out.stdout) if out.returncode == 0 else []
    return found[-1] if found and found[-1].startswith("/") else None


def _job_uid(env: Mapping[str, str]) -> int | None:
    """Whose the job is: SLURM_JOB_UID (slurmd sets it for the Prolog and Epilog), else this process's
    user when it is not root (a collector started inside the job)."""
    uid = env.get("SLURM_JOB_UID", "")
    if uid.isdigit():
        return int(uid)
    return os.getuid() if os.getuid() != 0 else None


def gpu_oom_outcome(job_id: str, stderr: str | None, env: Mapping[str, str],
                    lookup: Callable[[str], str | None] = job_stderr) -> GpuOomRecord | None:
    """A GPU OOM message at the end of the job's stderr, for its record; None when there is none or
    the file cannot be found or read (never an error: the record goes without it).

    ``stderr`` given on the command line is the admin's word and read as it is; a path looked up
    from slurmctld is read only if the job's user owns the file."""
    owner = None
    if stderr is None:
        owner = _job_uid(env)
        stderr = lookup(job_id) if owner is not None else None
        if stderr is None:
            return None
    found = scan_stderr(stderr, owner=owner)
    return GpuOomRecord(found.framework, found.line.replace("\0", "")[:MAX_STR]) if found else None



# ---- command line ----------------------------------------------------------------------------

def _warn(message: str) -> int:
    print(f"{_WARNING} {' '.join(message.split())}", file=sys.stderr)
    return 0


def _job_id_from_env(env: Mapping[str, str]) -> str | None:
    """As Slurm prints it: ``<array job>_<task>`` for an array task, else SLURMJOB_ID.

    The node Prolog may lack the array variables (slurm.conf(5) of 22.05 offers them only to
    PrologSlurmctld); there an array task is recorded under its own id, sacct's JobIDRaw.
    """
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slurmgpu-monitor", description="Per-job GPU usage collector for Slurm.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="sample the job's GPUs until it ends, then write its record")
    run.add_argument("--job-id", help="default: SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID or SLURM_JOB_ID")
    run.add_argument("--spool", required=True, help="directory the record is written into")
    run.add_argument("--interval", type=_positive, default=5.0, help="seconds between samples (default 5)")
    run.add_argument("--duration", type=_positive, help="stop after this many seconds")
    run.add_argument("--pid", type=int, help="stop when this PID exits; count GPU memory of its process tree")
    run.add_argument("--cluster", help="default: SLURM_CLUSTER_NAME")
    run.add_argument("--run-dir", help="write <job id>.pid here, for `slurmgpu-monitor stop`")
    run.add_argument("--recorded", metavar="TRACE.json", help="replay a recorded trace instead of NVML")
    run.add_argument("--stderr", metavar="PATH", help="the job's stderr, scanned for a GPU OOM when it ends "
                                                      "(default: from `scontrol show job`)")
    run.add_argument("--no-oom-scan", action="store_true", help="do not look for a GPU OOM in the job's stderr")
    stop = sub.add_parser("stop", help="stop the job's collector (from an Epilog) and wait for its record")
    stop.add_argument("--job-id", help="default: as for run")
    stop.add_argument("--run-dir", required=True)
    stop.add_argument("--wait", type=float, default=10.0, help="seconds to wait for it to finish (default 10)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.job_id = args.job_id or _job_id_from_env(os.environ)
    if not args.job_id:
        parser.error("--job-id is required outside a Slurm job")
    if not JOB_ID.fullmatch(args.job_id):
        parser.error(f"--job-id: not a Slurm job id: {args.job_id!r}")
    if args.command == "stop":
        return _stop(args.run_dir, args.job_id, args.wait)
    args.cluster = args.cluster or os.environ.get("SLURM_CLUSTER_NAME")
    if not args.cluster or not _NAME.fullmatch(args.cluster):
        parser.error(f"--cluster: need a cluster name (or SLURM_CLUSTER_NAME), got {args.cluster!r}")
    return _run(args)


def _pidfile(run_dir: str, job_id: str) -> str:
    return os.path.join(run_dir, f"{job_id}.pid")


def _run(args: argparse.Namespace) -> int:
    spool = args.spool
    if not os.path.isdir(spool) or not os.access(spool, os.W_OK | os.X_OK):
        return _warn(f"job {args.job_id}: spool directory {spool} is missing or not writable; not collecting")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    pidfile = None
    try:
        if args.run_dir:
            path = _pidfile(args.run_dir, args.job_id)
            try:
                atomic_write(path, f"{os.getpid()}\n".encode(), 0o644)
            except OSError as exc:  # nothing could stop a collector without it
                return _warn(f"job {args.job_id}: cannot write {path}: {exc.strerror or exc}; not collecting")
            pidfile = path
        record = _collect(args, stop)
        if record is not None:
            try:
                write_record(record, spool)
            except OSError as exc:
                return _warn(f"job {args.job_id}: cannot write its record into {spool}: {exc.strerror or exc}")
    except DeviceError as exc:
        return _warn(f"job {args.job_id}: {exc}; no record written")
    except Exception as exc:  # a bug here must still not fail the job
        return _warn(f"job {args.job_id}: internal error {type(exc).__name__}: {exc}; no record written")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pidfile:
            with contextlib.suppress(OSError):
                os.unlink(pidfile)
    return 0


def _collect(args: argparse.Namespace, stop: threading.Event) -> JobRecord | None:
    devices: GpuDevices = RecordedDevices(args.recorded) if args.recorded else NvmlDevices()
    try:
        gpus = select_gpus(devices.devices(), os.environ)
        if not gpus:
            _warn(f"job {args.job_id}: no GPUs for this job on this node; nothing to collect")
            return None
        start = datetime.now(UTC)
        got = Collector(devices, gpus, args.interval, duration=args.duration, pid=args.pid, stop=stop).run()
        end = datetime.now(UTC)
    finally:
        devices.close()
    if got.samples == 0:
        _warn(f"job {args.job_id}: no samples taken; no record written")
        return None
    env = os.environ
    oom = None
    if not args.no_oom_scan:
        try:
            oom = gpu_oom_outcome(args.job_id, args.stderr, env)
        except Exception as exc:  # the usage record still goes, without the outcome
            _warn(f"job {args.job_id}: stderr not scanned for a GPU OOM ({type(exc).__name__}: {exc})")
    return JobRecord(SCHEMA_VERSION, "nvml", args.cluster, args.job_id,
                     env.get("SLURMD_NODENAME") or socket.gethostname(),
                     env.get("SLURM_JOB_USER") or env.get("USER") or None,
                     start, end, args.interval, *got, gpu_oom=oom)


def _stop(run_dir: str, job_id: str, wait: float) -> int:
    """SIGTERM the job's collector, then wait (bounded) so its record is on disk when the Epilog ends."""
    pidfile = _pidfile(run_dir, job_id)
    try:
        with open(pidfile) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except FileNotFoundError as exc:
        missing = "no collector running" if exc.filename == pidfile else "collector already gone"
        return _warn(f"job {job_id}: {missing} ({exc.filename})")
    except (OSError, ValueError) as exc:
        return _warn(f"job {job_id}: cannot read {pidfile}: {exc}")
    if b"slurmgpu-monitor" not in cmdline and b"slurmgpu.collector.monitor" not in cmdline:
        return _warn(f"job {job_id}: PID {pid} in {pidfile} is not a collector; not signalled")
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError as exc:
        return _warn(f"job {job_id}: cannot signal collector PID {pid}: {exc.strerror}")
    deadline = time.monotonic() + wait
    while _alive(pid):
        if time.monotonic() >= deadline:
            return _warn(f"job {job_id}: collector PID {pid} still running after {wait:g} s")
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
