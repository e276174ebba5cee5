"""How this site decides: its config, model bundle, the daemon when it answers, free GPUs.

Shared by gsbatch and the admin commands, so neither imports the other's entry module.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Mapping

from slurmgpu.apps.daemon_client import PLAN_TIMEOUT_S
from slurmgpu.pipeline.config import Config, find_config, load_config, user_cache_dir
from slurmgpu.pipeline.errors import one_line
from slurmgpu.pipeline.files import read_regular
from slurmgpu.typing_lite import TYPE_CHECKING

if TYPE_CHECKING:  # the decision modules load only when gsbatch decides in its own process
    from typing import Any

    from slurmgpu.pipeline.policy import Admits, Decider, Decision, GivenLimit
    from slurmgpu.pipeline.request import ComponentRequest, JobRequest
    from slurmgpu.slurm.backend import SlurmBackend
    from slurmgpu.slurm.partitions import PartitionRules

# Tells the site's job_submit.lua hook that gsbatch already decided this job: gsbatch sets it to the
# submission's Unix time, and the hook believes it within DECIDED_WINDOW_S of its own clock. The job
# inherits the variable, so a plain sbatch inside it later (a chain, a resubmission) carries a stale
# time and is decided by the hook; "1" is a user's explicit opt-out, believed always.
DECIDED_MARKER = "SLURMGPU_DECIDED"
DECIDED_WINDOW_S = 300
MAX_CACHE_BYTES = 64 << 20  # a per-user cache file past this is not read


def load_site(config_path: str | None, env: Mapping[str, str]) -> Config | None:
    path = find_config(config_path, env)
    return load_config(path, user_cache_dir(env)) if path else None


def model_path(config: Config | None, env: Mapping[str, str]) -> str:
    from slurmgpu.pipeline.spool import PERSONAL_SPOOL

    site = config.site.model_path if config else None
    return os.path.expanduser(env.get("SLURMGPU_MODEL") or site
                              or os.path.join(os.path.dirname(PERSONAL_SPOOL), "model.json"))


_TRES_FIELD = {"gres": "tres_per_node", "gpus-per-node": "tres_per_node", "gpus": "tres_per_job",
               "gpus-per-task": "tres_per_task", "gpus-per-socket": "tres_per_socket"}


def daemon_job(request: JobRequest, user: str | None = None) -> dict[str, Any]:
    """The job as slurmctld's job_submit.lua would describe it to the daemon; no user: the
    daemon learns it from the kernel (``user`` is kept for callers, and ignored)."""
    comp = request.main
    job: dict[str, Any] = {"script": request.script.text if request.script else None,
                           "partition": comp.partition, "account": comp.account, "qos": comp.qos,
                           "num_tasks": comp.ntasks, "ntasks_per_node": comp.ntasks_per_node,
                           "cpus_per_task": comp.cpus_per_task, "sockets_per_node": comp.sockets_per_node,
                           "time_limit": comp.time_limit_s // 60 if comp.time_limit_s else None,
                           "min_nodes": comp.nodes if comp.nodes_set else None,
                           "features": comp.options["constraint"].value if "constraint" in comp.options else None}
    for ask in comp.gpus:
        job[_TRES_FIELD[ask.option]] = f"gres:gpu:{ask.type + ':' if ask.type else ''}{ask.count}"
    return {k: v for k, v in job.items() if v is not None}


class DaemonDecider:
    """Asks ``slurmgpu serve`` (model and config already loaded there); falls back to deciding
    in this process when the daemon does not answer by ``deadline`` (``time.monotonic()``: the
    submission's one deadline for all its daemon exchanges; None: ``PLAN_TIMEOUT_S`` from asking)."""

    name = "daemon"

    def __init__(self, socket_path: str, user: str | None, fallback: Any, deadline: float | None = None,
                 config: Config | None = None) -> None:
        self.socket_path, self.user, self.fallback, self.deadline = socket_path, user, fallback, deadline
        self.config = config  # the answer is checked against it before it is used

    def decide(self, request: JobRequest) -> Decision:
        from slurmgpu.apps.daemon_client import ask
        from slurmgpu.pipeline.policy import Candidate, ComponentChange, Decision, KeepDecider
        from slurmgpu.pipeline.validate import check_decision

        timeout_s = PLAN_TIMEOUT_S if self.deadline is None else self.deadline - time.monotonic()
        answer = ask(self.socket_path, daemon_job(request), timeout_s)
        if answer is None or request.is_hetjob:
            return self.fallback().decide(request)
        problem = check_decision(answer, self.config, request.to_json()) if self.config else None
        if problem is None:
            try:
                return Decision(tuple(ComponentChange(**c) for c in answer.get("changes", [])),
                                tuple(str(r) for r in answer.get("reasons", [])), answer.get("refused"),
                                str(answer.get("decider", "model")),
                                tuple(Candidate(**c) for c in answer.get("per_type", [])))
            except (TypeError, ValueError) as exc:
                problem = f"malformed: {exc}"
        print(f"gsbatch: warning: slurmgpu serve's answer not applied ({one_line(problem)}); request kept as written",
              file=sys.stderr)
        return KeepDecider(f"the daemon's answer was not applied ({problem}); request kept").decide(request)


def site_decider(config: Config | None, backend: SlurmBackend, env: Mapping[str, str],
                 deadline: float | None = None) -> Decider:
    """The configured decider: the daemon when its socket is there (the fast path, asked by
    ``deadline``: see DaemonDecider), else the model in this process; a model that cannot be used
    leaves the request as written."""
    from slurmgpu.pipeline.policy import make_decider

    if config is None or config.policy.decider != "model":
        return make_decider(config)
    from slurmgpu.apps.daemon_client import DEFAULT_SOCKET

    user = env.get("USER") or env.get("LOGNAME")
    socket_path = env.get("SLURMGPU_SOCKET") or DEFAULT_SOCKET
    if os.path.exists(socket_path):
        return DaemonDecider(socket_path, user, lambda: local_decider(config, backend, env, user), deadline, config)
    return local_decider(config, backend, env, user)


def local_decider(config: Config, backend: SlurmBackend, env: Mapping[str, str], user: str | None) -> Decider:
    from slurmgpu.pipeline.bundle import Bundle
    from slurmgpu.pipeline.policy import KeepDecider, make_decider

    path = model_path(config, env)
    try:
        bundle = Bundle.load(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"gsbatch: warning: {one_line(f'model {path} unusable ({exc})')}; request kept as written",
              file=sys.stderr)
        return KeepDecider("model unusable")
    try:  # Slurm's rules: for a move to another partition, and the limit a job writing none gets
        rules, error = cached_partitions(env), None
    except (OSError, ValueError) as exc:
        rules, error = None, str(exc)
    admits = slurm_admits(rules, error, user, os.getuid()) if config.policy.move_partitions else None
    wait, capacity = cached_queue(backend, env)
    return make_decider(config, bundle, user=user, admits=admits, wait=wait, capacity=capacity,
                        given_limit=slurm_given_limit(rules))


def slurm_admits(rules: Mapping[str, PartitionRules] | None, error: str | None, user: str | None,
                 uid: int | None,
                 groups_of: Callable[[str | None, int | None], frozenset[str] | None] | None = None) -> Admits:
    """Why Slurm would refuse a component in a partition (None: it would take it) for this user,
    from ``scontrol show partition``'s RULES (None: they could not be read, for ERROR).
    ``groups_of``: the user's groups (default: looked up now; the daemon caches them)."""
    import math

    from slurmgpu.slurm.partitions import JobAccess, nodelist_of, user_groups

    groups = (groups_of or user_groups)(user, uid) if rules is not None else None

    def check(name: str, comp: ComponentRequest) -> str | None:
        if rules is None:
            return f"Slurm's partition rules are unknown ({error})"
        if name not in rules:
            return f"Slurm has no partition {name}"
        try:
            nodes = nodelist_of(comp.options["nodelist"].value) if "nodelist" in comp.options else ()
        except ValueError as exc:
            return f"the job's node list: {exc}"
        job = JobAccess(uid=uid, groups=groups, account=comp.account, qos=comp.qos,
                        time_limit_min=math.ceil(comp.time_limit_s / 60) if comp.time_limit_s else None,
                        min_nodes=comp.nodes if comp.nodes_set else None, nodelist=nodes)
        return rules[name].refusal(job)

    return check


def slurm_given_limit(rules: Mapping[str, PartitionRules] | None) -> GivenLimit | None:
    """The time limit Slurm gives a job that writes none, per partition, from its rules (None where
    they could not be read: such a job's moves are then held to no limit, as before they were read)."""
    if rules is None:
        return None

    def given(name: str) -> int | None:
        minutes = rules[name].given_time_min if name in rules else None
        return minutes * 60 if minutes is not None else None

    return given


def _fresh_cache(env: Mapping[str, str], name: str, ttl_s: float) -> tuple[str, str | None, float]:
    """A per-user cache file of gsbatch's: its path, its text when it is less than TTL_S old (else
    None: absent, stale, unreadable) and its age in seconds."""
    path = os.path.join(user_cache_dir(env), name)
    try:
        age = time.time() - os.stat(path).st_mtime
        if 0 <= age < ttl_s:
            return path, read_regular(path, MAX_CACHE_BYTES).decode(), age
    except (OSError, ValueError):
        pass
    return path, None, 0.0


def _keep_cache(path: str, text: str) -> None:
    """Write a per-user cache file (0600); a cache that cannot be written is only a cost."""
    from slurmgpu.pipeline.spool import write_private

    try:
        write_private(path, text.encode())
    except OSError:
        pass


def cached_partitions(env: Mapping[str, str], ttl_s: float = 60.0,
                      scontrol: str = "scontrol") -> dict[str, PartitionRules]:
    """Slurm's partition rules for gsbatch, from a per-user cache of ``scontrol show partition`` a
    minute old at most: they change when an admin edits slurm.conf, not between submissions, and
    every scontrol call is one more RPC slurmctld serves. OSError/ValueError as read_partitions."""
    from slurmgpu.slurm.partitions import parse_partitions, show_partitions

    path, text, _ = _fresh_cache(env, "partitions.txt", ttl_s)
    if text is not None:
        try:
            return parse_partitions(text)
        except ValueError:
            pass
    text = show_partitions(scontrol)
    rules = parse_partitions(text)  # nonsense is refused before it is kept
    _keep_cache(path, text)
    return rules


def cached_queue(backend: SlurmBackend, env: Mapping[str, str], ttl_s: float = 10.0) -> tuple[Any, Any]:
    """Expected wait per GPU type and count from the live queue (pipeline/queue.py: running jobs'
    time left, then pending demand by priority), and what the nodes can start at all
    (pipeline/capacity.py), from a per-user cache a few seconds old at most (sinfo and squeue are
    not free); (None, None) when Slurm cannot be asked (rank by runtime alone, as the config says)."""
    import json

    from slurmgpu.pipeline.capacity import Capacity
    from slurmgpu.pipeline.queue import GpuLedger

    path, text, age = _fresh_cache(env, "gpu-queue.json", ttl_s)
    ledger = GpuLedger({})
    try:
        if text is None:
            raise ValueError("no fresh cache")
        cached = json.loads(text)
        ledger.free = {str(t): [[float(x) for x in node] for node in nodes] for t, nodes in cached["free"].items()}
        ledger.capacity = Capacity.from_json(cached["nodes"])
    except (ValueError, TypeError, AttributeError, KeyError):
        age = 0.0
        try:
            ledger = GpuLedger.from_queue(backend.nodes(), backend.queue())
        except Exception:  # noqa: BLE001 - no queue view: rank by runtime alone
            return None, None
        capacity = ledger.capacity.to_json() if ledger.capacity else []
        _keep_cache(path, json.dumps({"free": ledger.free, "nodes": capacity}))
    return functools.partial(ledger.wait, now=age), ledger.capacity


def cached_slurm_version(env: Mapping[str, str], sinfo: str = "sinfo") -> tuple[int, int] | None:
    """The (major, minor) of the Slurm client tools gsbatch runs, from a per-user cache keyed by
    sinfo's identity (it changes only with an upgrade, so ``sinfo --version`` is forked once per
    install, not per submission; sbatch itself is not asked, a wrapper of it could submit); None
    when it cannot be told (options are then read by the union of the versions' tables)."""
    from slurmgpu.pipeline.sbatch_options import release_of
    from slurmgpu.slurm.backend import which

    found = which(sinfo, env)  # not shutil.which: on gsbatch's hot path its import alone costs ~4 ms
    if found is None:
        return None
    try:
        st = os.stat(found)
    except OSError:
        return None
    key = f"{found}\t{st.st_ino}\t{st.st_mtime_ns}\t{st.st_size}"
    path, text, _ = _fresh_cache(env, "slurm-version.txt", 30 * 86400.0)
    if text is None or text.split("\n")[0] != key:
        import subprocess  # only when sinfo is asked: the module costs ~7 ms to import

        try:
            out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=5, check=False,
                                 stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        text = f"{key}\n{out.strip()}"
        _keep_cache(path, text)
    return release_of(text.split("\n", 1)[-1])
