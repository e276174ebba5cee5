"""Slurm behind one small interface: submit a job, and ask what the cluster offers.

The command-line tools are always there and are the tested default. pyslurm is used for
queries only when it imports and its version matches the running Slurm (its releases are tied
to one Slurm release). Submission always goes through sbatch itself, so users see sbatch's
own output and exit codes.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from slurmgpu.typing_lite import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from datetime import datetime

# Patterns of sinfo's GRES items, compiled when nodes are read (re caches them), not by a submission
_GRES_ITEM = r"^gpu(?::([^:(]+))?:(\d+)"
SHARD_ITEM = r"^shard(?::([^:(]+))?:(\d+)"


class SlurmError(RuntimeError):
    """A Slurm command could not be run or answered nonsense."""


class NodeInfo(NamedTuple):
    name: str
    partitions: tuple[str, ...]
    gpus: Mapping[str, int] = MappingProxyType({})  # type ("" when untyped) -> count
    state: str = ""
    features: tuple[str, ...] = ()  # available features (slurm.conf Feature=)
    shards: Mapping[str, int] = MappingProxyType({})  # gres "shard" by the GPU type it shares


class QueuedJob(NamedTuple):
    """A running or pending job's GPUs, from squeue: per type ("" untyped) for the whole job."""

    job_id: str
    running: bool
    nodes: tuple[str, ...]  # where it runs (empty while pending)
    seconds: float  # running: time left; pending: time limit (inf: none)
    gpus: Mapping[str, int]
    num_nodes: int
    partition: str


SQUEUE_FORMAT = "JobID:|,StateCompact:|,NodeList:|,TimeLeft:|,TimeLimit:|,tres-alloc:|,NumNodes:|,Partition:|,Reason:|"


def parse_squeue(text: str) -> list[QueuedJob]:
    """``squeue -h -t R,PD --sort=-p,i -O SQUEUE_FORMAT``: GPU jobs, highest priority first. For a
    pending job tres-alloc is what it asks for; typed counts win over the untyped total. Held jobs
    (JobHeldUser, JobHeldAdmin) wait for a person, not for GPUs: left out."""
    from slurmgpu.slurm.partitions import nodelist_of
    from slurmgpu.slurm.sacct import ParseError, parse_duration

    jobs = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 9 or fields[8].startswith("JobHeld"):
            continue
        job_id, state, nodelist, left, limit, tres, num_nodes, partition = fields[:8]
        try:
            seconds = parse_duration(left if state == "R" else limit, "TimeLeft")
            nodes = nodelist_of(nodelist) if state == "R" else ()
        except (ParseError, ValueError):
            continue
        job = queued_job(job_id, state == "R", nodes, float("inf") if seconds is None else float(seconds), tres,
                         int(num_nodes) if num_nodes.isdigit() else 1, partition)
        if job is not None:
            jobs.append(job)
    return jobs


def queued_job(job_id: str, running: bool, nodes: tuple[str, ...], seconds: float, tres: str, num_nodes: int,
               partition: str) -> QueuedJob | None:
    """One queue entry from its TRES string (typed counts win over the untyped total); None without GPUs.
    Shared by squeue's text (parse_squeue) and pyslurm's job records."""
    gpus: dict[str, int] = {}
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key.startswith("gres/gpu") and value.isdigit() and "gpumem" not in key and "gpuutil" not in key:
            gpus[key[len("gres/gpu:"):] if ":" in key else ""] = int(value)
    typed = {t: n for t, n in gpus.items() if t}
    if not any(gpus.values()):
        return None
    return QueuedJob(job_id, running, nodes, seconds, typed or gpus, num_nodes, partition)


class SlurmBackend(Protocol):
    name: str

    def version(self) -> str: ...

    def nodes(self) -> list[NodeInfo]: ...

    def free_gpus(self) -> dict[str, int]: ...

    def default_partition(self) -> str | None: ...

    def queue(self) -> list[QueuedJob]: ...

    def cluster_name(self) -> str | None: ...

    def accounting(self, since: datetime | None = None, until: datetime | None = None,
                   job_ids: Sequence[str] = ()) -> Iterator[str]: ...

    def submit(self, words: Sequence[str], env: Mapping[str, str], stdin: bytes | None = None) -> Submitted: ...


class Submitted(NamedTuple):
    """sbatch's exit status and the job id it printed (None when it printed none)."""

    code: int
    job_id: str | None = None


_JOB_ID = re.compile(rb"^(?:Submitted batch job )?(\d+)(?:;\S+)?\s*$")


def parse_gres(gres: str, item: str = _GRES_ITEM) -> dict[str, int]:
    """``gpu:a100:4(S:0),gpu:v100:2`` -> {'a100': 4, 'v100': 2} (other gres dropped); with
    ``item=SHARD_ITEM``, the shards: sinfo says ``shard:a100:8``, by the GPU type they share."""
    out: dict[str, int] = {}
    if gres in ("", "(null)"):
        return out
    for text in re.split(r",(?![^()]*\))", gres):
        m = re.match(item, text)
        if m:
            out[m.group(1) or ""] = out.get(m.group(1) or "", 0) + int(m.group(2))
    return out


class CliBackend:
    """The Slurm command-line tools (sbatch, sinfo)."""

    name = "cli"

    def __init__(self, sbatch: str = "sbatch", sinfo: str = "sinfo", timeout: float = 10.0) -> None:
        self.sbatch, self.sinfo, self.timeout = sbatch, sinfo, timeout

    def _run(self, argv: list[str]) -> str:
        import subprocess  # queries only: a submission spawns sbatch without it (see submit)

        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found on PATH") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{argv[0]} did not answer within {self.timeout:g} s") from None
        if res.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: {res.stderr.strip() or 'exit ' + str(res.returncode)}")
        return res.stdout

    def version(self) -> str:
        return self._run([self.sinfo, "--version"]).split()[-1]

    def free_gpus(self) -> dict[str, int]:
        """Idle GPUs per type right now (each node counted once, whatever its partitions; by node
        name, since several nodes may share a host)."""
        out = self._run([self.sinfo, "-h", "-N", "-O", "NodeList:|,Gres:|,GresUsed:|,StateCompact:|"])
        free: dict[str, int] = {}
        seen = set()
        for line in out.splitlines():
            node, gres, used, state = line.split("|")[:4]
            if node in seen or any(s in state for s in ("down", "drain", "fail", "maint")):
                continue
            seen.add(node)
            busy = parse_gres(re.sub(r"\(IDX:[^)]*\)", "", used))
            for gtype, count in parse_gres(gres).items():
                free[gtype] = free.get(gtype, 0) + count - busy.get(gtype, 0)
        return free

    def queue(self) -> list[QueuedJob]:
        """Running and pending GPU jobs, highest priority first (all users': squeue shows them)."""
        return parse_squeue(self._run(["squeue", "-h", "-t", "R,PD", "--sort=-p,i", "-O", SQUEUE_FORMAT]))

    def default_partition(self) -> str | None:
        """The partition sinfo marks with ``*``, if any."""
        for line in self._run([self.sinfo, "-h", "-o", "%P"]).split():
            if line.endswith("*"):
                return line[:-1]
        return None

    def cluster_name(self) -> str | None:
        """ClusterName from slurm.conf, as the running slurmctld has it."""
        m = re.search(r"^ClusterName\s*=\s*(\S+)", self._run(["scontrol", "show", "config"]), re.MULTILINE)
        return m.group(1) if m else None

    def accounting(self, since: datetime | None = None, until: datetime | None = None,
                   job_ids: Sequence[str] = ()) -> Iterator[str]:
        """sacct's lines (``sacct.LIVE_FIELDS``, ``sacct.LIVE_DELIMITER``, each job followed by its steps)
        for all users' jobs active in [since, until] (naive UTC), or for JOB_IDS whatever their times.
        Read as sacct prints them; SlurmError after the last line when sacct failed."""
        import subprocess

        from slurmgpu.slurm.sacct import LIVE_DELIMITER, LIVE_FIELDS

        argv = ["sacct", "--allusers", "--parsable2", "--noheader", f"--delimiter={LIVE_DELIMITER}",
                f"--format={','.join(LIVE_FIELDS)}"]
        if job_ids:
            argv.append(f"--jobs={','.join(job_ids)}")
        else:
            if since is None or until is None:
                raise ValueError("accounting: a time window or job ids")
            argv += [f"--starttime={local_time(since)}", f"--endtime={local_time(until)}"]
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                                    errors="surrogateescape")
        except FileNotFoundError:
            raise SlurmError("sacct not found on PATH") from None
        assert proc.stdout is not None and proc.stderr is not None
        read = False
        try:
            yield from proc.stdout
            read = True
        finally:
            if not read:
                proc.kill()  # the reader stopped early
            proc.stdout.close()
            err = proc.stderr.read()
            proc.stderr.close()
            code = proc.wait()
        if code != 0:
            raise SlurmError(f"sacct exited {code}: {err.strip()}")

    def nodes(self) -> list[NodeInfo]:
        out = self._run([self.sinfo, "-h", "-N", "-o", "%N|%P|%G|%T|%f"])
        merged: dict[str, NodeInfo] = {}
        for line in out.splitlines():
            name, part, gres, state, features = line.split("|")
            part = part.rstrip("*")
            if name in merged:
                merged[name] = merged[name]._replace(partitions=(*merged[name].partitions, part))
            else:
                merged[name] = NodeInfo(name, (part,), parse_gres(gres), state, _features(features),
                                        parse_gres(gres, SHARD_ITEM))
        return list(merged.values())

    def submit(self, words: Sequence[str], env: Mapping[str, str], stdin: bytes | None = None) -> Submitted:
        """Run sbatch; its stderr is the terminal's, its stdout is passed through line by line
        as it comes (so ``--wait`` still shows the job id at once) and read for the job id.

        Spawned with posix_spawn rather than subprocess: a submission is gsbatch's hot path, and
        the subprocess module costs more to import than sbatch takes to run.
        """
        path = which(self.sbatch, env)
        if path is None:
            raise SlurmError(f"{self.sbatch} not found on PATH")
        out_r, out_w = os.pipe()
        actions = [(os.POSIX_SPAWN_DUP2, out_w, 1)]
        in_r = in_w = -1
        if stdin is not None:
            in_r, in_w = os.pipe()
            actions.append((os.POSIX_SPAWN_DUP2, in_r, 0))
        try:
            pid = os.posix_spawn(path, [self.sbatch, *words], dict(env), file_actions=actions)
        except BaseException:
            for fd in (out_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            os.close(out_w)
            if in_r >= 0:
                os.close(in_r)
        if stdin is not None:
            with open(in_w, "wb") as to_sbatch:
                try:
                    to_sbatch.write(stdin)
                except BrokenPipeError:  # sbatch stopped reading: its exit status says why
                    pass
        out = sys.stdout.buffer
        job_id = None
        with open(out_r, "rb") as from_sbatch:
            for line in from_sbatch:
                out.write(line)
                out.flush()
                m = _JOB_ID.match(line) if job_id is None else None
                if m:
                    job_id = m.group(1).decode()
        return Submitted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), job_id)


def _features(text: str) -> tuple[str, ...]:
    """sinfo's ``%f``: ``a100,v100`` or ``(null)``."""
    return tuple(f for f in text.split(",") if f and f != "(null)")


def local_time(t: datetime) -> str:
    """Naive UTC to the local wall-clock time sacct and slurmdbd read (``2026-01-31T23:00:00``)."""
    from datetime import UTC

    return t.replace(tzinfo=UTC).astimezone().strftime("%Y-%m-%dT%H:%M:%S")


def which(command: str, env: Mapping[str, str]) -> str | None:
    """COMMAND as the child's PATH finds it (as subprocess does), or None. The PATH is split as
    ``os.get_exec_path`` splits a str mapping's, without its import of warnings on gsbatch's path."""
    if os.sep in command:
        return command if os.access(command, os.X_OK) else None
    path = env.get("PATH")
    for directory in (os.defpath if path is None else path).split(os.pathsep):
        candidate = os.path.join(directory, command)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


class Choice(NamedTuple):
    """The backend select_backend picks, and why in one line (``slurmgpu doctor`` shows it)."""

    backend: SlurmBackend
    reason: str


def choose_backend(env: Mapping[str, str] | None = None) -> Choice:
    """pyslurm when asked for (SLURMGPU_BACKEND=pyslurm or auto), importable and matching the
    running Slurm's major.minor; else the command-line tools, with the reason."""
    env = os.environ if env is None else env
    choice = env.get("SLURMGPU_BACKEND", "auto")
    cli = CliBackend()
    import shutil

    if choice == "cli":
        return Choice(cli, "SLURMGPU_BACKEND=cli")
    if shutil.which("sinfo") is None:
        return Choice(cli, "sinfo is not on PATH")
    try:
        import pyslurm
    except ImportError as exc:  # not installed, or its libslurm missing: the error says which
        return Choice(cli, f"pyslurm is not importable ({exc}); make pyslurm installs it in a checkout, "
                           "make site-install in a site")
    try:
        running = cli.version()
    except SlurmError as exc:
        return Choice(cli, f"the Slurm version is unknown ({exc})")
    theirs = str(getattr(pyslurm, "__version__", ""))
    if _major_minor(theirs) != _major_minor(running):
        return Choice(cli, f"pyslurm {theirs or '(no version)'} does not match Slurm {running}")
    import importlib

    # Loaded by name: pyslurm_backend builds on this module, which must not import it back.
    backend: SlurmBackend = importlib.import_module("slurmgpu.slurm.pyslurm_backend").PyslurmBackend(pyslurm)
    return Choice(backend, f"pyslurm {theirs} matches Slurm {running}")


def select_backend(env: Mapping[str, str] | None = None) -> SlurmBackend:
    """The backend ``choose_backend`` picks."""
    return choose_backend(env).backend
