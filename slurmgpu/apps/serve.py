"""``slurmgpu serve``: GPU decisions over a Unix socket, for slurmctld's job_submit.lua and gsbatch.

Why a daemon: a job_submit.lua hook runs inside slurmctld and must answer in milliseconds, and
gsbatch spends most of its time starting Python and loading the config and model. The daemon
loads both once, reloads the model when its file changes (checked every few seconds, in the
background, so no request waits or is dropped), and answers each decision in a few milliseconds.

Protocol: UTF-8 JSON, one object per line, one reply line per request line; a connection may
carry several requests. A line longer than ``MAX_REQUEST_BYTES`` is answered with an error and
the connection closed. Requests:

``{"op": "health"}``
    ``{"ok": true, "version": ..., "decider": "model", "config": PATH, "requests": N,
    "uptime_s": S, "model": {"path", "loaded", "sha256", "mtime", "jobs", "window", "error"}}``
``{"op": "decide", "job": JOB}``
    ``{"ok": true, "decision": {...Decision.to_json()..., "request": TEXT, "apply": {FIELD: VALUE}}}``
``{"op": "plan", "config": PATH, "script": TEXT|null, "script_name": NAME, "options": [WORD...],
"env": {SBATCH_*: VALUE}}``
    gsbatch's fast path: ``{"ok": true, "plan": {...Plan.to_json()...}}``, the same plan gsbatch makes in
    its own process (``slurmgpu.pipeline.plan``), rewritten script included; ``{"ok": false,
    "input_error": TEXT}`` when the script or options are bad. Only for the config this daemon serves.

``{"op": "seff", "jobs": [JOBID...], "cluster": C|null}``
    ``{"ok": true, "seff": [{"job_id", "text", "json"} | {"job_id", "error"}]}``: ``slurmgpu seff`` for a
    user who cannot read the history database (slurmgpu.apps.userview), at most 100 ids.
``{"op": "jobs", "user": U|null, "since": ISO|null, "job_ids": [ID...], "limit": N}``
    ``{"ok": true, "jobs": [ROW...], "left_out": N}``: ``slurmgpu jobs``, at most 1000 rows.
``{"op": "report", "since": ISO, "until": ISO, "user": U|null, "account": A|null, "cluster": C|null}``
    ``{"ok": true, "jobs": [JOBUSE...], "user": U|null}``: the jobs ``slurmgpu report`` summarises.
    These three answer only what the peer may see: its own jobs; an account coordinator's accounts;
    everything for root, SlurmUser, the daemon's own account and Slurm administrators.

Anything else, or a job that cannot be read, gets ``{"ok": false, "error": TEXT}``.

JOB is what job_submit.lua sees in ``job_desc``; every key is optional and unknown keys are
ignored. Strings: ``script`` (the batch script text), ``tres_per_node``, ``tres_per_job``,
``tres_per_task``, ``tres_per_socket`` (in either Slurm spelling: ``gres:gpu:a100:2``,
``gres/gpu=1``), ``partition``, ``account``, ``qos``, ``name``, ``features`` (--constraint),
``req_nodes`` (--nodelist), ``user_name``. Whole numbers: ``num_tasks``, ``min_nodes``,
``max_nodes``, ``ntasks_per_node``, ``cpus_per_task``, ``sockets_per_node``, ``time_limit``
(minutes), ``user_id``; Slurm's NO_VAL/INFINITE mean "not set".

Who asks: the kernel says (SO_PEERCRED), never the request. A client that is not root or
SlurmUser is the user it runs as, whatever ``user_name``/``user_id`` it sends. Only slurmctld's
hook (its peer is root or SlurmUser) speaks for another user: it sends ``job_desc.user_id``,
which slurmctld took from the submitter's authenticated credential. Each log line names the user
and uid so resolved.

Where a job may go: with a cluster view (``slurmgpu serve`` reads ``scontrol show partition -o``
every few seconds, off the request path), a job is moved only to a partition whose rules admit
it (State, AllowGroups, AllowAccounts/DenyAccounts, AllowQos/DenyQos, MaxTime, MaxNodes, the
job's node list); while those rules cannot be read, no job is moved at all.
The fields become sbatch command-line words over the script's directives, so ``build_request``
applies sbatch's own precedence; the script's GPU directives are left out because the tres
fields already hold the job's whole GPU request. A heterogeneous job, or a script with a
``#GSBATCH --no-rewrite`` (or older ``#SLURMGPU keep``) line, is answered "kept".

``apply`` holds only what changes, ready for the job descriptor: a ``tres_per_*`` field maps to
its new GPU entry without the ``gres:``/``gres/`` prefix (``gpu:v100:2``; the hook keeps the
job's own prefix and its other entries), ``partition`` to a partition name. It is empty when the
request stands, and on a refusal too (reported in ``refused``; Slurm has the last word).

Security: the socket is mode 0660, group ``--group``, in a root-owned 0755 directory, and each
peer is checked with SO_PEERCRED: only root, the daemon's own user, SlurmUser and members of the
group get answers. History requests (``seff``, ``jobs``, ``report``) are answered only with the
jobs the peer may see (slurmgpu.apps.userview), each in a child process off the I/O thread; the
model it applies holds no per-user statistics. A request line is at most
``MAX_REQUEST_BYTES`` (256 KiB); connections are served concurrently (see serve_socket).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import pwd
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any, NamedTuple

from slurmgpu import __version__
from slurmgpu.apps import metrics
from slurmgpu.apps.daemon_client import DEFAULT_SOCKET, MAX_REQUEST_BYTES, ask, call  # noqa: F401 - re-exported
from slurmgpu.apps.serve_records import DecisionRecords
from slurmgpu.apps.site import slurm_admits, slurm_given_limit
from slurmgpu.pipeline.bundle import Bundle  # imported here, as root: after --run-as the install may be unreadable
from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.modes import ADVISE, Resolution, advised, resolve, waived

try:  # a long-running daemon can afford numpy: it evaluates all candidate types in one pass
    import numpy  # noqa: F401
except ImportError:  # pragma: no cover - numpy ships with the training extra
    pass
from slurmgpu.pipeline.capacity import Capacity
from slurmgpu.pipeline.plan import Plan, make_plan
from slurmgpu.pipeline.policy import Admits, Decider, Decision, KeepDecider, make_decider
from slurmgpu.pipeline.queue import GpuLedger, Waits
from slurmgpu.pipeline.request import GPU_OPTIONS, JobRequest, build_request
from slurmgpu.pipeline.rewrite import RewriteError, _new_gpu_value, describe
from slurmgpu.pipeline.script import encode, parse_script
from slurmgpu.slurm.partitions import PartitionRules, user_groups

FREE_GPUS_EVERY_S = 10.0
# A decision is reused for the same request line from the same user while the daemon's view (model,
# queue, idle GPUs, partition rules, users, date) is the one it was made with, for at most as long as
# that view is kept before it is read again: a burst of one script (sbatch in a loop) is decided once
# per view, not once per job. Within one view a new decision differs from a reused one only by the
# age of the waits it reads, and the view itself is up to FREE_GPUS_EVERY_S old. (At 1 s, bench_serve's
# model p99 at 1,000/s was 7.55-7.66 ms with 17% of lines decided anew; at 10 s 4.34-4.80 ms, 3%.)
REUSE_S = FREE_GPUS_EVERY_S
# What is held for reuse per process, at most; past either the store is emptied. Few entries: a burst
# repeats a few scripts, and every entry held is more for the garbage collector to walk (bench_serve,
# every line distinct, model at 1,000/s: 494 answers/s and 3.3 ms CPU each with 10,000 lines held;
# 580/s and 2.8 ms with 256 at most).
REUSE_ENTRIES = 256
REUSE_BYTES = 16 << 20  # request bytes
HISTORY_OPS = ("seff", "jobs", "report")
DECISION_SOURCES = {"decide": "hook", "plan": "gsbatch"}  # op -> its metrics label (apps.metrics)
NO_VAL16, NO_VAL = 0xFFFE, 0xFFFFFFFE  # Slurm's "unset"; anything at or above is a sentinel

log = logging.getLogger("slurmgpu.apps.serve")

# job_desc field -> the sbatch option that fills it (--gpus-per-node also lands in tres_per_node)
TRES_FIELDS = {"tres_per_node": "gres", "tres_per_job": "gpus", "tres_per_task": "gpus-per-task",
               "tres_per_socket": "gpus-per-socket"}
FIELD_OF_OPTION = {option: field for field, option in TRES_FIELDS.items()}
STRING_FIELDS = {"partition": "partition", "account": "account", "qos": "qos", "name": "job-name",
                 "features": "constraint", "req_nodes": "nodelist"}
COUNT_FIELDS = {"num_tasks": ("ntasks", NO_VAL), "ntasks_per_node": ("ntasks-per-node", NO_VAL16),
                "cpus_per_task": ("cpus-per-task", NO_VAL16), "sockets_per_node": ("sockets-per-node", NO_VAL16),
                "time_limit": ("time", NO_VAL)}


# --- the job descriptor as a JobRequest ----------------------------------------------------------


def gpu_entries(tres: str | None) -> list[str]:
    """The GPU entries of a tres string, as ``gpu[:type][:count]`` (``gres/gpu=1`` -> ``gpu:1``)."""
    out = []
    for item in (tres or "").split(","):
        entry = item.removeprefix("gres:").removeprefix("gres/").replace("=", ":")
        if entry == "gpu" or entry.startswith("gpu:"):
            out.append(entry)
    return out


def _string(job: Mapping[str, Any], key: str) -> str | None:
    value = job.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or "\n" in value or "\0" in value:
        raise InputError("must be a one-line string", option=key)
    return value


def _count(job: Mapping[str, Any], key: str, unset: int) -> int | None:
    value = job.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError("must be a whole number", option=key)
    return value if 0 < value < unset else None


def job_words(job: Mapping[str, Any]) -> list[str]:
    """sbatch command-line words that say what the job descriptor's fields say."""
    words = []
    for field, option in TRES_FIELDS.items():
        entries = gpu_entries(_string(job, field))
        if entries:
            values = entries if option == "gres" else [e.partition(":")[2] or "1" for e in entries]
            words.append(f"--{option}={','.join(values)}")
    for field, option in STRING_FIELDS.items():
        if (value := _string(job, field)) is not None:
            words.append(f"--{option}={value}")
    for field, (option, unset) in COUNT_FIELDS.items():
        if (count := _count(job, field, unset)) is not None:
            words.append(f"--{option}={count}")
    low, high = _count(job, "min_nodes", NO_VAL), _count(job, "max_nodes", NO_VAL)
    if low is not None:
        words.append(f"--nodes={low}-{high}" if high and high > low else f"--nodes={low}")
    return words


def job_request(job: Mapping[str, Any], gpu_features: set[str]) -> JobRequest:
    """The JobRequest of a job descriptor; raises InputError for fields that cannot be read."""
    script = None
    if (text := job.get("script")) is not None:
        if not isinstance(text, str):
            raise InputError("must be a string", option="script")
        parsed = parse_script(encode(text), "<job_submit>")
        script = parsed._replace(directives=tuple(d for d in parsed.directives if d.name not in GPU_OPTIONS))
    return build_request(script, job_words(job), {}, gpu_features)


def apply_fields(request: JobRequest, decision: Decision) -> dict[str, str]:
    """The job descriptor fields a decision changes; raises RewriteError when it cannot be said."""
    if decision.refusal or not decision.changes:
        return {}
    change, comp = decision.changes[0], request.main
    out = {}
    if change.gpu_type is not None or change.gpus_total is not None:
        ask, value = _new_gpu_value(comp, change)
        out[FIELD_OF_OPTION[ask.option]] = value if ask.option == "gres" else f"gpu:{value}"
    if change.partition is not None:
        out["partition"] = change.partition
    if change.time_limit_s is not None:
        out["time_limit"] = str(change.time_limit_s // 60)  # job_desc.time_limit: minutes (whole: longer_limit)
    return out


# --- the service: model, free GPUs, decisions ---------------------------------------------------


class Peer(NamedTuple):
    """The process at the other end of a connection, as the kernel reports it (SO_PEERCRED);
    ``trusted`` when it may speak for other users (root or SlurmUser: slurmctld's hook)."""

    pid: int
    uid: int
    gid: int
    trusted: bool = False


class Who(NamedTuple):
    """Whom a request is for: a name and uid (either may be unknown) and how it was learnt."""

    name: str | None
    uid: int | None
    source: str  # "peer" (SO_PEERCRED), "slurmctld" (job_desc.user_id from a trusted peer), "caller"


def _uid_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return None


class Users:
    """Users' names by uid and group names by user, looked up once per cluster refresh (Service
    clears it with the partition rules): a passwd or group lookup goes through NSS (files, LDAP,
    sssd) and cost each decision more than the rules decider did (0.17 ms for a user with no
    passwd entry, measured), yet Slurm's AllowGroups are read only every FREE_GPUS_EVERY_S anyway."""

    MAX_ENTRIES = 4096  # past this many users or uids the cache starts again

    def __init__(self) -> None:
        self.names: dict[int, str | None] = {}
        self.groups: dict[tuple[str | None, int | None], frozenset[str] | None] = {}

    def name(self, uid: int) -> str | None:
        if uid not in self.names:
            if len(self.names) >= self.MAX_ENTRIES:
                self.names = {}
            self.names[uid] = _uid_name(uid)
        return self.names[uid]

    def groups_of(self, user: str | None, uid: int | None) -> frozenset[str] | None:
        key = (user, uid)
        if key not in self.groups:
            if len(self.groups) >= self.MAX_ENTRIES:
                self.groups = {}
            self.groups[key] = user_groups(user, uid)
        return self.groups[key]


def identify(message: Mapping[str, Any], peer: Peer | None,
             uid_name: Callable[[int], str | None] = _uid_name) -> Who:
    """The requesting user: the peer itself unless the peer is trusted to speak for the job's
    user (slurmctld sends job_desc.user_id). ``peer`` None: an in-process caller, believed.
    ``uid_name``: a uid's user name (Users.name caches them)."""
    job = message.get("job")
    body: Mapping[str, Any] = job if isinstance(job, dict) else message
    name = body.get("user_name") if isinstance(body.get("user_name"), str) else None
    uid = body.get("user_id")
    uid = uid if isinstance(uid, int) and not isinstance(uid, bool) and 0 <= uid < NO_VAL else None
    if peer is not None and not peer.trusted:
        return Who(uid_name(peer.uid), peer.uid, "peer")
    if uid is not None:  # the uid is what slurmctld authenticated; a name that disagrees is ignored
        return Who(uid_name(uid) or name, uid, "slurmctld" if peer is not None else "caller")
    if peer is not None and name is None:
        return Who(uid_name(peer.uid), peer.uid, "peer")
    return Who(name, None, "slurmctld" if peer is not None else "caller")


class ModelState(NamedTuple):
    """The model in use; a failed reload keeps the previous bundle and records the error."""

    bundle: Bundle | None = None
    signature: tuple[int, int, int] | None = None
    sha256: str | None = None
    mtime: float | None = None
    error: str | None = "not loaded"
    digest: str | None = None  # Bundle.digest of the file's bytes: the model version decisions record


class Service:
    """Decides jobs with the config's decider and the newest usable model."""

    def __init__(self, config: Config, model_path: str | None = None,
                 free_gpus: Callable[[], Mapping[str, int]] | None = None, reload_s: float = 2.0,
                 partitions: Callable[[], Mapping[str, PartitionRules]] | None = None,
                 queue: Callable[[], GpuLedger] | None = None, record_spool: str | None = None,
                 database_url: str | None = None) -> None:
        self.config, self.reload_s = config, reload_s
        # The history database, for users who may not read it themselves (seff, jobs, report); the
        # modules are imported now, as root: after --run-as the install may be unreadable.
        self.database_url = database_url
        if database_url is not None:
            from slurmgpu.apps import userview  # noqa: F401
            from slurmgpu.history import db  # noqa: F401
        # Decisions made for slurmctld's hook go as spool records into ``record_spool`` (lineage), written
        # by a background thread off the request path; None records nothing.
        self.features = config.gpu_features()
        self.records = DecisionRecords(record_spool, config.site.cluster,
                                       functools.partial(job_request, gpu_features=self.features)) \
            if record_spool else None
        # The queue view (expected wait per type and count); None until read: idle GPUs then.
        self.fetch_queue = queue
        self.ledger: tuple[GpuLedger, float] | None = None  # and when it was read (monotonic)
        self.model_path = model_path if config.policy.decider == "model" else None
        self.fetch_free = free_gpus
        self.free: Mapping[str, int] = {}  # idle GPUs per type; {} ranks by runtime alone
        # Slurm's partition rules: without a fetcher (a library caller) moves are not checked;
        # with one, rules that could not be read yet (None) admit no move at all.
        self.fetch_partitions = partitions
        self.partitions: Mapping[str, PartitionRules] | None = None
        self.partitions_error: str | None = "not read yet" if partitions else None
        self._counter = itertools.count(1)
        self.users = Users()  # emptied at each refresh of the cluster view
        self.model = ModelState()
        self.fixed: Decider | None = None if self.model_path else make_decider(config)
        self.started = time.monotonic()
        self.count = 0  # requests handled (several threads count: see _counter)
        self.stopped = threading.Event()
        self.today: Callable[[], date] = date.today  # waivers expire by this clock (tests freeze it)
        self.watch_model = True  # False in a worker of serve_workers: its supervisor reloads the model
        # (line, who) -> (when, view, reply before its record, request): see REUSE_S
        self.recent: dict[tuple[bytes, Who], tuple[float, tuple[Any, ...], dict[str, Any], JobRequest]] = {}
        self.recent_bytes = 0
        self.reused = 0  # decide requests answered with a reused decision (health)
        if self.model_path and not self.check_model():
            log.warning("no usable model yet (%s): requests are kept as written until one appears", self.model.error)

    def check_model(self) -> bool:
        """Load the model file when it changed; True when a new bundle is in use."""
        assert self.model_path is not None
        try:
            st = os.stat(self.model_path)
        except OSError as exc:
            self.model = self.model._replace(error=f"{self.model_path}: {exc.strerror}")
            return False
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self.model.signature:
            return False
        try:
            with open(self.model_path, "rb") as fh:
                data = fh.read()
            bundle = Bundle(json.loads(data))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.model = self.model._replace(signature=signature, error=f"{self.model_path}: {exc}")
            log.error("model %s unusable (%s); %s", self.model_path, exc,
                      "keeping the loaded one" if self.model.bundle else "requests are kept as written")
            return False
        full = hashlib.sha256(data).hexdigest()
        self.model = ModelState(bundle, signature, full[:16], st.st_mtime, None, full[:12])
        log.info("model %s loaded (sha256 %s, %s jobs)", self.model_path, self.model.sha256, bundle.data.get("jobs"))
        return True

    def refresh_free(self) -> None:
        """Idle GPUs and partition rules from the cluster, off the request path: sinfo and
        scontrol wait while slurmctld sits in the hook."""
        if self.fetch_free is not None:
            try:
                self.free = dict(self.fetch_free())
            except Exception as exc:  # noqa: BLE001 - no cluster view: keep the last one
                log.warning("idle GPU counts not refreshed: %s", exc)
        if self.fetch_queue is not None:
            try:
                self.ledger = (self.fetch_queue(), time.monotonic())
            except Exception as exc:  # noqa: BLE001 - no queue view: keep the last one
                log.warning("queue view not refreshed: %s", exc)
        self.users = Users()  # a user's groups are looked up again with the rules that name them
        if self.fetch_partitions is not None:
            try:
                self.partitions, self.partitions_error = dict(self.fetch_partitions()), None
            except Exception as exc:  # noqa: BLE001 - rules unknown: no job is moved until they are read
                if self.partitions_error is None or self.partitions is not None:
                    log.warning("partition rules not read (%s): no job is moved to another partition", exc)
                self.partitions, self.partitions_error = None, str(exc)

    def admits(self, who: Who) -> Admits | None:
        """Why Slurm would refuse a component in a partition (None: it would take it), for this user."""
        if self.fetch_partitions is None:
            return None
        return slurm_admits(self.partitions, self.partitions_error, who.name, who.uid, self.users.groups_of)

    def watch(self, next_free: float = 0.0) -> None:
        """Background loop: idle GPUs every ``FREE_GPUS_EVERY_S``, the model file every ``reload_s``."""
        while True:
            if time.monotonic() >= next_free:
                self.refresh_free()
                next_free = time.monotonic() + FREE_GPUS_EVERY_S
            if self.stopped.wait(self.reload_s):
                return
            if self.model_path and self.watch_model:
                self.check_model()

    def start(self) -> None:
        """Start watching the model file and the cluster (when there is either)."""
        if self.model_path or self.fetch_free or self.fetch_partitions:
            # The cluster view is read once before the first answer: a daemon that answered before
            # knowing the partition rules would keep its first jobs where they were asked for.
            self.refresh_free()
            threading.Thread(target=self.watch, args=(time.monotonic() + FREE_GPUS_EVERY_S,),
                             name="slurmgpu-watch", daemon=True).start()

    def decider(self, who: Who) -> Decider:
        return self.versioned_decider(who)[0]

    def versioned_decider(self, who: Who) -> tuple[Decider, str | None]:
        """The decider for this request and the model version (Bundle.digest) it decides with, if any."""
        if self.fixed is not None and self.fixed.name == "keep":
            return self.fixed, None
        if self.fixed is not None:
            return make_decider(self.config, admits=self.admits(who), capacity=self._capacity()), None
        model = self.model  # read once: a reload meanwhile cannot pair one bundle with another's digest
        if model.bundle is None:
            return KeepDecider(f"model unusable ({model.error}); request kept"), None
        return (make_decider(self.config, model.bundle, lambda: self.free, who.name, self.admits(who), self._wait(),
                             self._capacity(), slurm_given_limit(self.partitions)), model.digest)

    def _capacity(self) -> Capacity | None:
        """What the live nodes can start, from the last queue view (None before one is read)."""
        return self.ledger[0].capacity if self.ledger is not None else None

    def _wait(self) -> Waits | None:
        """Expected wait from the last queue view, aged by the time since it was read."""
        if self.ledger is None:
            return None
        return functools.partial(self.ledger[0].wait, now=time.monotonic() - self.ledger[1])

    def decide(self, job: Mapping[str, Any], who: Who | None = None, record: bool = False) -> dict[str, Any]:
        """The reply to a decide request (raises InputError for an unreadable job). ``record``: the
        decision goes into the spool (when this daemon records), and a model decision the hook
        applies carries a decision tag for the job's comment, which links the job to the record."""
        return self.decide_request(job, who, record)[0]

    def decide_request(self, job: Mapping[str, Any], who: Who | None = None,
                       record: bool = False) -> tuple[dict[str, Any], JobRequest]:
        """``decide``, and the job's request as read (what the metrics compare the decision with)."""
        who = who or identify(job, None)
        out, request = self.unrecorded(job, who)
        return self.recorded(out, job, request, who, record), request

    def view(self) -> tuple[Any, ...]:
        """What a decision depends on besides the request and its user (compared by identity: each
        refresh or reload replaces these objects)."""
        return self.model, self.ledger, self.free, self.partitions, self.users, self.fixed, self.today()

    def decide_line(self, line: bytes, job: Mapping[str, Any], who: Who,
                    record: bool) -> tuple[dict[str, Any], JobRequest, bool]:
        """``decide_request`` for a request line, reusing the decision made for the same line and user
        under the same view less than REUSE_S ago (the third item: whether it was); each answer still
        has its own record and id."""
        key, now, view = (line, who), time.monotonic(), self.view()
        hit = self.recent.get(key)
        if hit is not None and now - hit[0] < REUSE_S and \
                all(a is b or a == b for a, b in zip(hit[1], view, strict=True)):
            self.reused += 1
            _, _, out, request = hit  # the same line: the same job
            return self.recorded(dict(out), job, request, who, record), request, True
        # the line's request, read again only for a new line: a refresh of the cluster view makes every
        # decision anew, and most of a burst's after it are of lines read before it
        out, request = self.unrecorded(job, who, hit[3] if hit is not None else None)
        if self.recent_bytes + len(line) > REUSE_BYTES or len(self.recent) >= REUSE_ENTRIES:
            self.recent.clear()
            self.recent_bytes = 0
        if key not in self.recent:
            self.recent_bytes += len(line)
        self.recent[key] = (now, view, out, request)
        return self.recorded(dict(out), job, request, who, record), request, False

    def recorded(self, out: dict[str, Any], job: Mapping[str, Any], request: JobRequest, who: Who,
                 record: bool) -> dict[str, Any]:
        """The reply, with its decision id and tag once its record is queued (``record``, when this
        daemon records)."""
        if record and self.records is not None:
            return self.records.add(out, job, request, who)
        return out

    def unrecorded(self, job: Mapping[str, Any], who: Who,
                   request: JobRequest | None = None) -> tuple[dict[str, Any], JobRequest]:
        """The decision for a job, under the mode and waivers, before any record is made of it
        (``request``: the job's, where it was read before)."""
        request = request or job_request(job, self.features)
        script = request.script
        version = None
        if request.is_hetjob:
            decision = KeepDecider("heterogeneous job: its components reach the hook one by one; "
                                   "request kept").decide(request)
        elif script is not None and script.keep_marker:
            decision = KeepDecider(script.keep_reason).decide(request)
        else:
            decider, version = self.versioned_decider(who)
            decision = decider.decide(request)
        try:
            apply = apply_fields(request, decision)
        except RewriteError as exc:
            decision = decision._replace(changes=(), reasons=(*decision.reasons, f"not applied: {exc}"))
            apply = {}
        out = {**decision.to_json(), "request": describe(request.main), "apply": apply}
        out = self.moderated(out, job, request, who)
        out["model_version"] = version if out.get("decider") == "model" else None
        return out, request

    def resolution(self, who: Who, account: Any, partition: Any,
                   script_text: str | None) -> tuple[Resolution, str | None]:
        """The admin config's mode and waiver for this job (never anything the request says of
        them), and the job's family key."""
        family = None
        if script_text is not None:
            from slurmgpu.pipeline.features import script_features

            try:
                family = script_features(script_text)["family"]
            except ValueError:
                family = None
        config = self.config
        return resolve(config.modes, config.waivers, user=who.name,
                       account=account if isinstance(account, str) else None,
                       partition=partition if isinstance(partition, str) else None, family=family,
                       default_partition=config.default_partition, today=self.today()), family

    def moderated(self, out: dict[str, Any], job: Mapping[str, Any], request: JobRequest, who: Who) -> dict[str, Any]:
        """A decide reply under the mode and waivers: a waiver keeps the request (its reason in
        ``reasons``); advise mode moves ``apply`` to ``advice``, so a hook of any version applies
        nothing. ``mode`` and ``family`` tell the hook what the daemon resolved."""
        res, family = self.resolution(who, job.get("account"), job.get("partition"),
                                      request.script.text if request.script else None)
        apply = out["apply"]
        if res.waiver is not None and out.get("changes") and not out.get("refused"):
            out, apply = waived(out, res.waiver), {}
        if res.mode == ADVISE:
            out, apply = {**advised(out, res), "advice": apply}, {}
        return {**out, "mode": res.mode, "family": family, "apply": apply, "advice": out.get("advice", {})}

    def health(self) -> dict[str, Any]:
        m = self.model
        bundle = m.bundle
        return {
            "ok": True, "version": __version__, "decider": self.config.policy.decider, "config": self.config.path,
            "requests": self.count, "uptime_s": round(time.monotonic() - self.started, 1),
            "partitions": None if self.fetch_partitions is None else {
                "read": self.partitions is not None, "names": sorted(self.partitions or ()),
                "error": self.partitions_error},
            "records": None if self.records is None else {
                "spool": self.records.directory, "written": self.records.written, "dropped": self.records.dropped,
                "failed": self.records.failed, "error": self.records.last_error},
            "reused": self.reused,
            "model": None if self.model_path is None else {
                "path": self.model_path, "loaded": bundle is not None, "sha256": m.sha256,
                "mtime": datetime.fromtimestamp(m.mtime, UTC).isoformat() if m.mtime else None,
                "jobs": bundle.data.get("jobs") if bundle else None,
                "window": bundle.data.get("window") if bundle else None, "error": m.error},
        }

    def tally(self) -> None:
        """Count one request (health's ``requests``); serve_socket counts here those a child answered."""
        self.count = next(self._counter)

    def handle(self, line: bytes, peer: Peer | None = None) -> dict[str, Any]:
        """One request line to one reply; never raises, logs each decision. ``peer``: who is
        connected (None for an in-process caller, whose user fields are believed)."""
        t0 = time.perf_counter()
        self.tally()
        who = Who(None, peer.uid if peer else None, "peer" if peer else "caller")
        op: Any = None
        try:
            message = json.loads(line.decode("utf-8", "surrogateescape"))
            op = message.get("op") if isinstance(message, dict) else None
            if op == "health":
                return self.health()
            who = identify(message if isinstance(message, dict) else {}, peer, self.users.name)
            if op == "plan":
                return self.plan_reply(message, t0, who)
            if op in HISTORY_OPS:
                return self.history_reply(op, message, peer, t0)
            if op != "decide":
                raise InputError(f"unknown op {op!r} (expected 'decide', 'plan', 'health', 'seff', 'jobs' or 'report')")
            if not isinstance(message.get("job"), dict):
                raise InputError("'job' must be an object")
            # recorded as the hook's decision only when slurmctld asks (or an in-process caller)
            decision, request, reused = self.decide_line(line, message["job"], who,
                                                         record=peer is None or peer.trusted)
        except (InputError, ValueError, UnicodeError, RecursionError) as exc:
            self._log(who, t0, error=str(exc))
            if op in DECISION_SOURCES:
                metrics.record_decision(DECISION_SOURCES[op], None, time.perf_counter() - t0, error="bad_request")
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a fault of ours must not take the daemon down
            log.exception("internal error")
            if op in DECISION_SOURCES:
                metrics.record_decision(DECISION_SOURCES[op], None, time.perf_counter() - t0, error="internal")
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
        result = (f"refused: {decision['refused']}" if decision["refused"] else
                  " ".join(f"{k}={v}" for k, v in decision["apply"].items()) or "kept")
        if decision.get("advice"):
            result = "advised: " + " ".join(f"{k}={v}" for k, v in decision["advice"].items())
        elif decision.get("waiver"):
            result = f"kept: {decision['reasons'][0]}"
        self._log(who, t0, request=decision["request"], result=result, decider=decision["decider"],
                  mode=decision.get("mode", "rewrite"), **({"reused": "yes"} if reused else {}))
        main = request.main
        metrics.record_decision("hook", decision, time.perf_counter() - t0, main.gpu_type, main.gpus_total,
                                self.config.gpu_types)
        return {"ok": True, "decision": decision}

    def plan(self, message: Mapping[str, Any], who: Who | None = None, decider: Decider | None = None) -> Plan:
        """The plan gsbatch would make in its own process for the same script, options and
        SBATCH_* variables (raises InputError for the user's input, ValueError for a bad request)."""
        config = message.get("config")
        if not isinstance(config, str) or os.path.realpath(config) != os.path.realpath(self.config.path):
            raise ValueError(f"gsbatch reads config {config!r}; this daemon serves {self.config.path!r}")
        text, name, options, env = (message.get(k) for k in ("script", "script_name", "options", "env"))
        if not (text is None or isinstance(text, str)) or not (name is None or isinstance(name, str)) \
                or not isinstance(options, list) or not all(isinstance(o, str) for o in options) \
                or not isinstance(env, dict) or not all(isinstance(k, str) and k.startswith("SBATCH_")
                                                        and isinstance(v, str) for k, v in env.items()):
            raise ValueError("plan: script and script_name must be strings or null, options a list of "
                             "strings, env an object of SBATCH_* strings")
        script = parse_script(text.encode("utf-8", "surrogateescape"), name or "<stdin>") if text is not None else None
        return make_plan(script, options, env, decider or self.decider(who or identify(message, None)), self.features)

    def versioned_plan(self, message: Mapping[str, Any], who: Who) -> tuple[Plan, str | None]:
        """``plan`` and the model version (Bundle.digest) it was decided with, which gsbatch puts in its
        own submission record (the daemon records no plan: gsbatch does)."""
        decider, version = self.versioned_decider(who)
        made = self.plan(message, who, decider)
        return made, version if made.decision.decider == "model" else None

    def plan_reply(self, message: Mapping[str, Any], t0: float, who: Who) -> dict[str, Any]:
        """A plan request to its reply: the user's input errors travel back to be printed by gsbatch."""
        try:
            made, version = self.versioned_plan(message, who)
        except InputError as exc:
            self._log(who, t0, error=str(exc))
            metrics.record_decision("gsbatch", None, time.perf_counter() - t0, error="bad_request")
            return {"ok": False, "input_error": str(exc)}
        decision = made.decision
        waived = False
        result = (f"refused: {decision.refusal}" if decision.refusal else
                  "rewritten" if made.submission.changed else "kept")
        mode = "rewrite"
        if not (self.config.modes.trivial and not self.config.waivers) and made.request is not None:
            # Logged only: gsbatch applies the mode itself, from the same config (pipeline/modes.py).
            comp = made.request.main
            res, _ = self.resolution(who, comp.account, comp.partition,
                                     made.request.script.text if made.request.script else None)
            mode = res.mode
            if made.submission.changed and res.waiver is not None:
                result, waived = f"kept: {res.waiver.text()}", True
            elif made.submission.changed and res.mode == ADVISE:
                result = "advised"
        self._log(who, t0, request=describe(made.request.main) if made.request else "-", result=result,
                  decider=decision.decider, mode=mode)
        plan = made.to_json()
        if made.request is not None:
            main = made.request.main
            metrics.record_decision("gsbatch", {**plan["decision"], "mode": mode, "waiver": waived},
                                    time.perf_counter() - t0, main.gpu_type, main.gpus_total, self.config.gpu_types)
        return {"ok": True, "plan": {**plan, "model_version": version}}

    @staticmethod
    def slow(line: bytes) -> bool:
        """Whether a line may be a history request, which reads the database and runs sacct: those are
        answered in a child process, off the I/O thread (serve_socket). A false positive costs a fork."""
        return b'"op"' in line and any(b'"%s"' % op.encode() in line for op in HISTORY_OPS)

    def history_reply(self, op: str, message: Mapping[str, Any], peer: Peer | None, t0: float) -> dict[str, Any]:
        """A seff, jobs or report request, answered with only what the peer may see; root, SlurmUser and
        the daemon's own account (the nightly account) see everything."""
        from slurmgpu.apps import userview
        from slurmgpu.history import db

        uid = os.geteuid() if peer is None else peer.uid
        who = Who(_uid_name(uid), uid, "peer" if peer else "caller")
        if self.database_url is None:
            raise InputError("this daemon serves no history database")
        viewer = userview.Viewer(uid, everyone=peer is None or peer.trusted or peer.uid == os.geteuid())
        engine = db.make_engine(self.database_url)
        try:
            reply = self._history(op, message, viewer, engine)
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - the database's fault, said in one line
            error = db.describe_error(self.database_url, exc)
            self._log(who, t0, op=op, error=error)
            return {"ok": False, "error": error}
        finally:
            engine.dispose()
        self._log(who, t0, op=op, result=f"{len(reply.get('seff') or reply.get('jobs') or ())} answered")
        return {"ok": True, **reply}

    def _history(self, op: str, message: Mapping[str, Any], viewer: Any, engine: Any) -> dict[str, Any]:
        from slurmgpu.apps import userview

        def text(key: str) -> str | None:
            value = message.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > 256):
                raise InputError(f"{op}: {key!r} must be a string or null")
            return value

        def when(key: str) -> datetime | None:
            value = text(key)
            try:
                return datetime.fromisoformat(value) if value else None
            except ValueError:
                raise InputError(f"{op}: {key!r} must be an ISO time") from None

        def ids(key: str, most: int) -> list[str]:
            value = message.get(key) or []
            if not isinstance(value, list) or len(value) > most or \
                    not all(isinstance(v, str) and 0 < len(v) <= 64 for v in value):
                raise InputError(f"{op}: {key!r} must be a list of at most {most} job ids")
            return value

        if op == "seff":
            return {"seff": userview.seff_answers(engine, ids("jobs", userview.MAX_SEFF_JOBS), text("cluster"),
                                                  self.config, viewer)}
        if op == "jobs":
            limit = message.get("limit", userview.MAX_JOB_ROWS)
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise InputError("jobs: 'limit' must be a whole number")
            return userview.jobs_answer(engine, viewer, text("user"), when("since"), ids("job_ids", 1000), limit)
        since, until = when("since"), when("until")
        if since is None or until is None:
            raise InputError("report: 'since' and 'until' are required")
        jobs, user = userview.report_jobs(engine, viewer, since, until, text("user"), text("account"),
                                          text("cluster"))
        if len(jobs) > userview.MAX_REPORT_JOBS:
            raise InputError(f"report: {len(jobs)} jobs in the window, more than {userview.MAX_REPORT_JOBS} "
                             "(a shorter --since/--until)")
        return {"jobs": userview.jobs_to_json(jobs), "user": user}

    @staticmethod
    def _log(who: Who, t0: float, **fields: str) -> None:
        """One line per request: who (name and uid as resolved, and how), what was asked, what
        came of it, how long it took."""
        text = " ".join(f"{key}={json.dumps(value)}" for key, value in fields.items())
        log.info("user=%s uid=%s via=%s %s latency_ms=%.2f", json.dumps(who.name or "?"),
                 "?" if who.uid is None else who.uid, who.source, text, (time.perf_counter() - t0) * 1000)



