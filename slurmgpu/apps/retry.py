"""``slurmgpu retry``: a job that ran out of GPU memory runs again once, as a new job, on a card that holds it.

Opt-in per site (``[policy] oom_retry = true``), run by root after the ingest (a timer every few
minutes: slurmctld keeps a finished job, and so its batch script, for ``MinJobAge`` seconds only).

Why a new job and not a requeue: on Slurm 22.05 ``scontrol update TresPerNode=... Partition=...`` of a
requeued job adds the new gres and keeps the old one (``TRES=...gres/gpu:t4=1,gres/gpu:v100=1``), so
the job pends for good (``BadConstraints``) or, within one partition, runs holding both cards. The new
job is the failed job's own batch script (``scontrol write batch_script``) with the request slurmctld
holds for it on the command line, GPUs and partition changed by the project's rewrite (as gsbatch
changes them), submitted by sbatch running as the job's owner (``runuser``: the job is theirs and Slurm
checks their rights, not root's). It is submitted held and released only once ``scontrol show job``
shows it as decided and the history links it to the failed job (``jobs.retry_of``, unique per cluster:
never twice, even when two runs race); released, a job Slurm would never start (``BadConstraints``
and the like) is cancelled and said so. A job submitted with ``--no-requeue`` (``Requeue=0``) is left
alone, and so is a retry itself.

The GPU OOM is the collector's finding in the job's stderr (collector/oom.py, stored with the job's
GPU record); the next card is the smallest configured type with more memory than the one it ran out
on that the model, when there is one and it knows the job, predicts to hold it, in a partition whose
Slurm rules admit the job (the job's own first). The new job's comment tells the user (when they wrote
none), and every action is one line of output.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from slurmgpu.history.db import GpuUsage, Job, Submission, utcnow
from slurmgpu.pipeline.config import Config, GpuType
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.policy import ComponentChange, Decision
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.rewrite import RewriteError, apply
from slurmgpu.pipeline.script import encode, parse_script
from slurmgpu.slurm.backend import which

Run = Callable[..., "subprocess.CompletedProcess[str]"]  # (argv, input=None): a command's result
Fits = Callable[[GpuType], bool]
# Finished states a GPU OOM ends in (a rank's OOM can leave the others hanging to the limit).
RETRY_STATES = ("FAILED", "OUT_OF_MEMORY", "TIMEOUT")
NONE = ("", "(null)", "None", "N/A")
# A pending job's reasons that Slurm never clears by itself: a retry left so would never run.
NEVER_RUNS = ("BadConstraints", "PartitionConfig", "InvalidAccount", "InvalidQOS", "AccountNotAllowed",
              "QOSNotAllowed", "PartitionNodeLimit", "PartitionTimeLimit", "ReqNodeNotAvail")
# Where slurmctld shows each GPU option, and the option that writes it again.
GPU_FIELDS = {"TresPerNode": "gres", "TresPerJob": "gpus", "TresPerTask": "gpus-per-task"}
# The request as slurmctld holds it (its effective value, whatever set it), option by option.
REQUEST_FIELDS = (("JobName", "job-name"), ("WorkDir", "chdir"), ("Account", "account"), ("QOS", "qos"),
                  ("NumNodes", "nodes"), ("NumTasks", "ntasks"), ("CPUs/Task", "cpus-per-task"),
                  ("MinMemoryNode", "mem"), ("MinMemoryCPU", "mem-per-cpu"), ("Features", "constraint"),
                  ("ExcNodeList", "exclude"), ("Reservation", "reservation"), ("Partition", "partition"))
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=")


class Candidate(NamedTuple):
    job_id: str
    user: str | None
    gpu_type: str
    gpus: int
    framework: str
    retry_of: str | None = None


class Action(NamedTuple):
    job_id: str
    done: bool
    message: str


class NotRetried(Exception):
    """Why a job is not retried (the action's message)."""


def run_command(argv: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=30, check=False,
                          cwd="/")  # root's working directory may be closed to the job's owner


def candidates(engine: Engine, cluster: str, since: datetime) -> list[Candidate]:
    """Jobs that ended since ``since`` with a GPU OOM in their collector record."""
    stmt = (select(Job.job_id, Job.user, Job.gpu_type, Job.gpu_count, GpuUsage.gpu_oom, Job.retry_of)
            .join(GpuUsage, (GpuUsage.cluster == Job.cluster) & (GpuUsage.job_id == Job.job_id))
            .where(Job.cluster == cluster, GpuUsage.gpu_oom.is_not(None), Job.state.in_(RETRY_STATES),
                   Job.end_time >= since, Job.gpu_type.is_not(None), Job.gpu_count > 0)
            .order_by(Job.end_time))
    with engine.connect() as conn:
        seen: dict[str, Candidate] = {}
        for job_id, user, gpu_type, gpus, framework, retry_of in conn.execute(stmt):
            seen.setdefault(job_id, Candidate(job_id, user, str(gpu_type), int(gpus), str(framework), retry_of))
    return list(seen.values())


def retried_as(engine: Engine, cluster: str, job_id: str) -> str | None:
    """The job that retries ``job_id``, when one was submitted."""
    with engine.connect() as conn:
        return conn.execute(select(Job.job_id).where(Job.cluster == cluster, Job.retry_of == job_id)).scalar()


def show_job(job_id: str, run: Run) -> dict[str, str] | None:
    """Every field of ``scontrol show job -o`` (None when slurmctld no longer knows the job). A value
    runs to the next ``Key=``, so a comment with spaces stays whole."""
    res = run(["scontrol", "show", "job", "-o", job_id])
    line = (res.stdout.splitlines() or [""])[0].strip()
    if res.returncode != 0 or not line.startswith(f"JobId={job_id} "):
        return None
    marks = list(_FIELD.finditer(line))
    return {m.group(1): line[m.end():marks[n + 1].start() if n + 1 < len(marks) else len(line)]
            for n, m in enumerate(marks)}


def _value(info: Mapping[str, str], key: str) -> str | None:
    value = info.get(key, "")
    return None if value in NONE else value


def next_card(config: Config, gpu_type: str, fits: Fits | None = None) -> GpuType | None:
    """The smallest configured whole card (no MIG slice) with more memory than ``gpu_type`` (the faster on a tie) that
    ``fits`` accepts (the model's prediction, when there is one)."""
    ran_on = config.gpu_types.get(gpu_type)
    if ran_on is None:
        return None
    larger = sorted((t for t in config.gpu_types.values() if t.memory_gib > ran_on.memory_gib
                     and config.partitions_with(t.name) and not t.is_slice),  # a slice: a fraction of the speed
                    key=lambda t: (t.memory_gib, -t.relative_speed))
    return next((t for t in larger if fits is None or fits(t)), None)


def request_words(info: Mapping[str, str], set_in_script: set[str]) -> list[str]:
    """sbatch options for the request slurmctld holds of the job. The command line it was submitted
    with is not kept, so each value is the effective one; the output files, which slurmctld shows
    expanded (``%j``), are left to the script when it names them, and else written to with
    ``--open-mode=append``, so the failed job's log stays."""
    words = [f"--{opt}={v}" for key, opt in REQUEST_FIELDS if (v := _value(info, key)) is not None]
    limit = _value(info, "TimeLimit")
    if limit and limit not in ("UNLIMITED", "Partition_Limit"):
        words.append(f"--time={limit}")
    for key, opt in GPU_FIELDS.items():
        if (v := _value(info, key)) is None:
            continue
        if opt != "gres" and not (v.startswith("gres:gpu:") and "," not in v):
            raise NotRetried(f"{key}={v} cannot be asked for again: not retried")
        words.append(f"--{opt}={v.replace('gres:', '') if opt == 'gres' else v[len('gres:gpu:'):]}")
    out = _value(info, "StdOut")
    defaults = {"StdOut": f"{info.get('WorkDir')}/slurm-{info.get('JobId')}.out", "StdErr": out, "StdIn": "/dev/null"}
    files = [f"--{opt}={v}" for key, opt in (("StdOut", "output"), ("StdErr", "error"), ("StdIn", "input"))
             if (v := _value(info, key)) is not None and v != defaults[key] and opt not in set_in_script]
    return words + files + (["--open-mode=append"] if files else [])


def _owner(c: Candidate, info: Mapping[str, str]) -> pwd.struct_passwd:
    """The job's owner as slurmctld knows it, which must be the stored job's user and known here."""
    m = re.fullmatch(r"(\S+)\((\d+)\)", info.get("UserId", ""))
    try:
        entry = pwd.getpwuid(int(m.group(2))) if m else None
    except KeyError:
        entry = None
    if m is None or entry is None or entry.pw_name != m.group(1) or (c.user and c.user != entry.pw_name):
        raise NotRetried(f"owner {info.get('UserId')} is not the stored user {c.user} here: not retried")
    return entry


def sbatch_as(owner: pwd.struct_passwd, words: Sequence[str]) -> list[str]:
    """sbatch run as the job's owner, held, its script on stdin. The owner's plain environment: the
    one the job was submitted from is not kept by Slurm 22.05."""
    sbatch = which("sbatch", os.environ) or "sbatch"
    path = ":".join(dict.fromkeys([os.path.dirname(sbatch) or "/usr/bin", "/usr/local/bin", "/usr/bin", "/bin"]))
    env = [f"HOME={owner.pw_dir}", f"USER={owner.pw_name}", f"LOGNAME={owner.pw_name}", f"SHELL={owner.pw_shell}",
           f"PATH={path}", *([f"SLURM_CONF={os.environ['SLURM_CONF']}"] if "SLURM_CONF" in os.environ else [])]
    return ["runuser", "-u", owner.pw_name, "--", "env", "-i", *env, sbatch, "--parsable", "--hold", *words]


def _comment(info: Mapping[str, str], c: Candidate, told: str, onto: str) -> str:
    """The new job's comment: the user's own (decision tags live in AdminComment, the history's
    ``retry_of`` links the two jobs), else what happened."""
    return _value(info, "Comment") or f"slurmgpu: retry of job {c.job_id} after a {told}, on {onto}"


def _differs(new: Mapping[str, str] | None, owner: str, part: str, card: str, old: str) -> str | None:
    """What of the held job is not as decided, or None."""
    if new is None:
        return "not shown by scontrol"
    gpus = " ".join([new.get("TRES", ""), *(new.get(f, "") for f in GPU_FIELDS)])
    if not new.get("UserId", "").startswith(f"{owner}("):
        return f"owner {new.get('UserId')}"
    if new.get("Partition") != part:
        return f"partition {new.get('Partition')}"
    if re.search(rf"gpu[:/]{re.escape(old)}\b", gpus) or not re.search(rf"gpu[:/]{re.escape(card)}\b", gpus):
        return f"GPUs {gpus.split()[0] if gpus.split() else '(none)'}"
    return None


def retry_job(c: Candidate, config: Config, run: Run, partition_ok: Callable[[str, Mapping[str, str]], bool],
              engine: Engine, cluster: str, fits: Fits | None = None) -> Action:
    """Submit one job again onto the next card, or say why not."""
    try:
        return Action(c.job_id, True, _retry(c, config, run, partition_ok, engine, cluster, fits))
    except NotRetried as why:
        return Action(c.job_id, False, str(why))


def _retry(c: Candidate, config: Config, run: Run, partition_ok: Callable[[str, Mapping[str, str]], bool],
           engine: Engine, cluster: str, fits: Fits | None) -> str:
    if c.retry_of:
        raise NotRetried(f"a retry of job {c.retry_of} itself: never retried twice")
    if (done := retried_as(engine, cluster, c.job_id)) is not None:
        raise NotRetried(f"already retried as job {done}: never retried twice")
    info = show_job(c.job_id, run)
    if info is None:
        raise NotRetried("no longer known to slurmctld (older than MinJobAge): not retried")
    if info.get("Requeue") == "0":
        raise NotRetried("asked not to be requeued (--no-requeue): not retried")
    if info.get("JobState") not in RETRY_STATES:
        raise NotRetried(f"state {info.get('JobState')}: not retried")
    if _value(info, "ArrayJobId") or _value(info, "HetJobId"):
        raise NotRetried("an array task or heterogeneous job: not retried")
    if _value(info, "ReqNodeList"):
        raise NotRetried(f"asks for nodes {info['ReqNodeList']} by name: not retried")
    owner = _owner(c, info)
    card = next_card(config, c.gpu_type, fits)
    if card is None:
        raise NotRetried(f"no configured card holds more than {c.gpu_type}: not retried")
    own = info.get("Partition", "").split(",")[0]
    parts = sorted(config.partitions_with(card.name), key=lambda p: p.name != own)
    part = next((p.name for p in parts if partition_ok(p.name, info)), None)
    if part is None:
        raise NotRetried(f"no partition with {card.name} admits the job: not retried")
    ran_on = config.gpu_types[c.gpu_type]
    told = f"GPU out of memory ({c.framework}) on {c.gpu_type} ({ran_on.memory_gib:g} GiB)"
    onto = f"{c.gpus} x {card.name} ({card.memory_gib:g} GiB) in partition {part}"
    script = run(["scontrol", "write", "batch_script", c.job_id, "-"])
    if script.returncode != 0 or not script.stdout:
        raise NotRetried(f"scontrol write batch_script failed ({script.stderr.strip() or script.returncode}): "
                         "not retried")
    try:
        parsed = parse_script(encode(script.stdout), f"job {c.job_id}'s batch script")
        words = [*request_words(info, {d.name for d in parsed.directives}),
                 f"--comment={_comment(info, c, told, onto)}"]
        request = build_request(parsed, words, {}, config.gpu_features())
        sub = apply(request, Decision(changes=(ComponentChange(0, gpu_type=card.name, partition=part),),
                                      reasons=(f"{told}; once on {onto}",), decider="retry"))
    except (InputError, RewriteError, ValueError) as exc:
        raise NotRetried(f"its request cannot be rewritten ({exc}): not retried") from None
    res = run(sbatch_as(owner, sub.cli_words), input=sub.script_text)
    new_id = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not new_id.isdigit():
        raise NotRetried(f"sbatch failed ({res.stderr.strip() or res.returncode}): not retried")
    held = show_job(new_id, run)
    if (wrong := _differs(held, owner.pw_name, part, card.name, c.gpu_type)) is not None:
        run(["scancel", new_id])
        raise NotRetried(f"sbatch failed to ask for {onto} (job {new_id}: {wrong}): job {new_id} cancelled")
    try:
        with engine.begin() as conn:
            conn.execute(insert(Job).values(
                cluster=cluster, job_id=new_id, job_id_raw=int(new_id), user=owner.pw_name, name=info.get("JobName"),
                account=_value(info, "Account"), partition=part, qos=_value(info, "QOS"), submit_time=utcnow(),
                state="PENDING", gpu_type=card.name, gpu_count=c.gpus, retry_of=c.job_id))
    except IntegrityError:
        run(["scancel", new_id])
        raise NotRetried(f"retried by another run meanwhile: job {new_id} cancelled") from None
    except SQLAlchemyError as exc:
        run(["scancel", new_id])
        raise NotRetried(f"storing the retry failed ({type(exc).__name__}): job {new_id} cancelled") from None
    released = run(["scontrol", "release", new_id])
    if released.returncode != 0:
        raise NotRetried(f"scontrol release failed ({released.stderr.strip() or released.returncode}); job {new_id} "
                         f"stays held: release it with scontrol release {new_id}")
    now = show_job(new_id, run) or {}
    state, reason = now.get("JobState", "?"), now.get("Reason", "None")
    if reason in NEVER_RUNS:
        run(["scancel", new_id])
        raise NotRetried(f"{told}; retry job {new_id} failed to become eligible ({state}, {reason}): cancelled")
    return f"{told}; retried once as job {new_id} on {onto} ({state}{'' if reason == 'None' else ', ' + reason})"


def retry(engine: Engine, config: Config, cluster: str, since_hours: float = 24.0, run: Run = run_command,
          partition_ok: Callable[[str, Mapping[str, str]], bool] | None = None,
          fits_for: Callable[[Candidate], Fits | None] | None = None,
          now: datetime | None = None) -> list[Action]:
    """Submit again every GPU-OOM job of the last ``since_hours`` that may be retried."""
    since = (now or utcnow()) - timedelta(hours=since_hours)
    ok = partition_ok or (lambda name, info: True)
    return [retry_job(c, config, run, ok, engine, cluster, fits_for(c) if fits_for else None)
            for c in candidates(engine, cluster, since)]


def slurm_admits(rules: Mapping[str, Any]) -> Callable[[str, Mapping[str, str]], bool]:
    """A partition check from ``scontrol show partition`` rules (slurm/partitions.py) and the job's
    user, account, QOS and time limit as scontrol shows them."""
    import pwd

    from slurmgpu.slurm.partitions import JobAccess, user_groups
    from slurmgpu.slurm.sacct import ParseError, parse_duration

    def check(name: str, info: Mapping[str, str]) -> bool:
        if name not in rules:
            return False
        m = re.match(r"(\w[\w.-]*)\((\d+)\)", info.get("UserId", ""))
        uid = int(m.group(2)) if m else None
        try:
            user = pwd.getpwuid(uid).pw_name if uid is not None else None
            limit = parse_duration(info.get("TimeLimit", ""), "TimeLimit")
        except (KeyError, ParseError):
            return False
        job = JobAccess(uid=uid, groups=user_groups(user, uid), account=info.get("Account") or None,
                        qos=info.get("QOS") or None, time_limit_min=-(-limit // 60) if limit else None)
        return rules[name].refusal(job) is None

    return check


def model_fits(config: Config, bundle: Any, engine: Engine, cluster: str) -> Callable[[Candidate], Fits | None]:
    """For a job gsbatch recorded: whether the model predicts a card holds it (with the margin)."""
    from slurmgpu.pipeline.features import card_features, job_features

    def for_job(c: Candidate) -> Fits | None:
        with engine.connect() as conn:
            row = conn.execute(select(Submission.features, Submission.original_request)
                               .where(Submission.cluster == cluster, Submission.job_id == c.job_id)).first()
        script = (row[0] or {}).get("script") if row else None
        if not script:
            return None
        request = dict(row[1] or {}) if row else {}

        def fits(card: GpuType) -> bool:
            gpu = card_features(card, script.get("precision_bits"))
            asked = config.gpu_types.get(c.gpu_type)
            f = job_features(script, {**request, "req_gpu_mem_gib": asked.memory_gib if asked else 0.0}, gpu,
                             c.gpus, bundle.history, card.name)
            peak = bundle.peak_mib(f, script)
            return peak * (1 + config.policy.memory_margin) <= card.memory_gib * 1024

        return fits

    return for_job
