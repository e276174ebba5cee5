"""Synthetic submission histories: users with the habits GPU trace studies report.

Users belong to an account, mostly run one or two job families, and keep a few configurations
they rerun with small changes (learning rate, steps, now and then the batch size). They ask for
GPUs by habit: the biggest card, a type they know, or the smallest card that fits (in the default
partition where one does); some ask for
more GPUs than their program drives; some submit sweeps as job arrays. Runtimes are log-normal,
so heavy-tailed. A configuration that did not fit the card it asked for, ran out of host memory
or hit its time limit is fixed on its next run (checkpointing, a smaller batch, LoRA, ZeRO-3, a
bigger card; more memory; a longer limit), so failures cluster as they do in real histories.
Every probability and weight is a named assumption in ``data.toml``. Seeded: the same arguments
give the same jobs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from slurmgpu.simulation.workload.catalog import Family, load_catalog
from slurmgpu.simulation.workload.cluster import ClusterSpec
from slurmgpu.simulation.workload.jobs import JobSpec
from slurmgpu.simulation.workload.perf import fits, host_rss_mib, peak_mem_mib, run_model
from slurmgpu.simulation.workload.schedule import Scheduler
from slurmgpu.simulation.workload.scripts import ScriptStyle, render

K = TypeVar("K")
_NAMES = ("ana", "ben", "chen", "dev", "eli", "fatima", "gus", "hana", "ivan", "jun", "kofi", "lena", "mo", "nia",
          "omar", "priya", "quinn", "raj", "sara", "tom", "uma", "vik", "wei", "xin", "yara", "zoe")


def _pick(rng: random.Random, table: Mapping[K, float]) -> K:
    return rng.choices(list(table), weights=list(table.values()))[0]


class User(NamedTuple):
    name: str
    uid: int
    account: str
    activity: float  # relative submission rate
    families: dict[str, float]
    type_habit: str  # biggest | familiar | fit
    home_type: str  # the type a "familiar" user asks for
    over_ask: bool
    sweeper: bool
    fixed_limit_s: int | None
    cpus_per_gpu: int
    mem_gb_per_cpu: int
    launcher: str  # for multi-GPU programs without ZeRO
    style: ScriptStyle


class Project(NamedTuple):
    """A configuration a user reruns, with what happened on its last run on the requested GPUs."""

    family: str
    params: dict[str, Any]
    req_type: str
    runtime_s: float  # its usual runtime on the requested GPUs
    mem_mb: int
    limit_factor: float = 1.0
    oom: bool = False
    host_oom: bool = False
    timed_out: bool = False


class _Gen:
    """State of one generate() call."""

    def __init__(self, cluster: ClusterSpec, seed: int) -> None:
        self.cluster, self.cat, self.rng = cluster, load_catalog(), random.Random(seed)
        self.types = cluster.gpu_types()
        default = next((p for p in cluster.partitions if p.default), cluster.partitions[0])
        self.default_partition = default.name
        self.default_types = [pool.gpu_type for pool in default.pools]
        self.biggest = self._largest(self.types)  # where jobs that fit nothing else go
        self.flagship = self._largest(self.default_types)  # what "biggest" users ask for
        self.next_id = cluster.first_job_id
        self.capacity = {t: 0 for t in self.types}  # GPUs per type
        for part in cluster.partitions:
            for pool in part.pools:
                self.capacity[pool.gpu_type] = max(self.capacity[pool.gpu_type], len(pool.hosts) * pool.gpus_per_node)

    def a(self, name: str) -> Any:
        return self.cat.value(name)

    def _largest(self, types: list[str]) -> str:
        return max(types, key=lambda t: (self.cat.gpu_types[t].memory_gib, self.cat.gpu_types[t].fp16_tflops))

    # ---- users -----------------------------------------------------------------------------

    def users(self) -> list[User]:
        rng, shares = self.rng, {n: f.share for n, f in self.cat.families.items()}
        capacity = {pool.gpu_type: len(pool.hosts) * pool.gpus_per_node
                    for part in self.cluster.partitions for pool in part.pools}
        out: list[User] = []
        taken: set[str] = set()
        for i in range(self.cluster.users):
            name = _NAMES[i % len(_NAMES)] + chr(ord("a") + rng.randrange(26))
            while name in taken:
                name += str(rng.randrange(10))
            taken.add(name)
            primary, secondary = _pick(rng, shares), _pick(rng, shares)
            main = self.a("primary_family_share")
            families = {primary: main}
            families[secondary] = families.get(secondary, 0.0) + 1 - main
            r = rng.random()
            habit = ("biggest" if r < self.a("asks_biggest")
                     else "familiar" if r < self.a("asks_biggest") + self.a("asks_familiar") else "fit")
            fixed = (int(_pick(rng, self.a("time_limits_h"))) * 3600
                     if rng.random() < self.a("fixed_time_limit") else None)
            style = ScriptStyle(_pick(rng, self.a("gpu_option")), rng.random() < 0.5, rng.random() < 0.5,
                                rng.random() < 0.5)
            out.append(User(name, 10001 + i, self.cat.families[primary].account,
                            rng.lognormvariate(0.0, self.a("user_activity_sigma")), families, habit,
                            _pick(rng, capacity), rng.random() < self.a("over_ask"), rng.random() < self.a("sweeper"),
                            fixed, int(_pick(rng, self.a("cpus_per_gpu"))), int(_pick(rng, self.a("mem_gb_per_cpu"))),
                            _pick(rng, self.a("launcher")), style))
        return out

    # ---- configurations ----------------------------------------------------------------------

    def _params(self, fam: Family) -> dict[str, Any]:
        rng = self.rng
        p: dict[str, Any] = {"model": _pick(rng, fam.models), "batch_size": _pick(rng, fam.batch_size),
                             "precision": _pick(rng, fam.precision), "nproc": _pick(rng, fam.nproc)}
        model = self.cat.models[p["model"]]
        if model.kind == "transformer":
            p["seq_len"] = _pick(rng, fam.seq_len)
        elif model.ref_size:  # fixed-size inputs (Atari frames, Criteo features) have no size to choose
            p["image_size"] = _pick(rng, fam.image_size) if fam.image_size else model.ref_size
        if fam.gen_tokens:
            p["gen_tokens"] = _pick(rng, fam.gen_tokens)
        lora = rng.random() < fam.lora and (model.kind == "transformer" or model.lora_params_m > 0)
        p.update(lora=lora, lora_r=_pick(rng, fam.lora_r) if lora else 0, grad_ckpt=rng.random() < fam.grad_ckpt,
                 zero=_pick(rng, fam.zero), lr=rng.choice(fam.lr), steps=1)
        return p

    def _type_for(self, user: User, fam: Family, params: dict[str, Any]) -> str:
        if user.type_habit == "biggest":
            return self.flagship
        if user.type_habit == "familiar":
            return user.home_type
        room = 1 - self.a("fit_headroom")
        for types in (self.default_types, self.types):  # the default partition first
            fitting = []
            for t in types:
                probe = self._probe(user, fam, self._settle(user, params, t), t)
                if peak_mem_mib(probe, t, probe.req_gpus) <= room * self.cat.gpu_types[t].memory_mib:
                    fitting.append(t)
            if fitting:
                return min(fitting, key=lambda t: (self.cat.gpu_types[t].memory_gib, self.cat.gpu_types[t].fp16_tflops))
        return self.biggest

    def _settle(self, user: User, params: dict[str, Any], req_type: str) -> dict[str, Any]:
        """What the user writes for this type: no more processes than a node holds, ZeRO only
        across several GPUs, fp16 where the card has no bf16, the launcher their habit picks."""
        p = dict(params)
        p["nproc"] = min(p["nproc"], self.cluster.pool(req_type).gpus_per_node)
        if p["nproc"] == 1:
            p["zero"] = 0
        if p["precision"] == "bf16" and not self.cat.gpu_types[req_type].bf16:
            p["precision"] = "fp16"
        p["launcher"] = ("python" if p["nproc"] == 1 else "deepspeed" if p["zero"] else user.launcher)
        return p

    def _probe(self, user: User, fam: Family, params: dict[str, Any], req_type: str) -> JobSpec:
        """A job with these settings, for the performance model (ids and script come later)."""
        req_gpus = params["nproc"]
        if user.over_ask:
            req_gpus = min(self.cluster.pool(req_type).gpus_per_node, 2 * req_gpus)
        part = self.cluster.partition_for(req_type)
        cpus_per_task = user.cpus_per_gpu * req_gpus // (params["nproc"] if params["launcher"] == "srun" else 1)
        cpus = cpus_per_task * (params["nproc"] if params["launcher"] == "srun" else 1)
        return JobSpec("0", 0, user.name, user.uid, user.account, fam.name, params, datetime(2000, 1, 1), req_type,
                       req_gpus, part.name, 0, None, _job_name(fam, params), cpus, cpus * user.mem_gb_per_cpu * 1024,
                       "", False, False, 0.0)

    def new_project(self, user: User) -> Project:
        rng = self.rng
        fam = self.cat.families[_pick(rng, user.families)]
        tuned = rng.random() < self.a("tuned_start")
        for _ in range(30):  # a tuned start draws until the configuration fits the card asked for
            params = self._params(fam)
            req_type = self._type_for(user, fam, params)
            params = self._settle(user, params, req_type)
            probe = self._probe(user, fam, params, req_type)
            if not tuned or fits(probe, req_type, probe.req_gpus):
                break
        median = fam.runtime_median_min * 60
        return Project(fam.name, params, req_type, rng.lognormvariate(math.log(median), fam.runtime_sigma),
                       probe.mem_mb)

    def rerun(self, user: User, proj: Project) -> Project:
        """The next run of a configuration: fixed where the last one failed, else slightly changed."""
        rng, fam = self.rng, self.cat.families[proj.family]
        p, req_type = dict(proj.params), proj.req_type
        if proj.oom and not _fix_memory(p, fam, rng):
            req_type = self.biggest
        elif not proj.oom and rng.random() < self.a("batch_change"):
            p["batch_size"] = max(1, p["batch_size"] * 2 if rng.random() < 0.5 else p["batch_size"] // 2)
        if fam.mode == "train":
            p["lr"] = rng.choice(fam.lr)
        return proj._replace(params=self._settle(user, p, req_type), req_type=req_type,
                             mem_mb=proj.mem_mb * (2 if proj.host_oom else 1),
                             limit_factor=proj.limit_factor * (2 if proj.timed_out else 1))

    # ---- submissions ---------------------------------------------------------------------------

    def req_gpus(self, user: User, proj: Project) -> int:
        """The GPUs the next submission of ``proj`` asks for."""
        return self._probe(user, self.cat.families[proj.family], proj.params, proj.req_type).req_gpus

    def submit(self, user: User, proj: Project, when: datetime) -> tuple[list[JobSpec], Project]:
        """One submission (a single job or an array) and the project as its user then sees it."""
        rng, fam = self.rng, self.cat.families[proj.family]
        probe = self._probe(user, fam, proj.params, proj.req_type)._replace(mem_mb=proj.mem_mb, submit_time=when)
        if rng.random() < self.a("debug_share"):
            target = rng.lognormvariate(math.log(self.a("debug_median_min") * 60), self.a("debug_sigma"))
        else:
            target = proj.runtime_s * rng.lognormvariate(0.0, self.a("rerun_sigma"))
        one = run_model(probe._replace(params={**probe.params, "steps": 1}), proj.req_type, probe.req_gpus)
        steps = max(1, round((target - one.startup_s) / (one.steps * one.step_s)))
        probe = probe._replace(params={**probe.params, "steps": steps})
        runtime = run_model(probe, proj.req_type, probe.req_gpus).runtime_s
        part = self.cluster.partition_for(proj.req_type)
        limit = min(part.max_time_s, self._time_limit(user, runtime, proj.limit_factor))
        probe = probe._replace(time_limit_s=limit)

        tasks, throttle, array, lrs = 1, 0, None, None
        if user.sweeper and fam.mode == "train" and rng.random() < self.a("sweep_share"):
            tasks = int(_pick(rng, self.a("array_sizes")))
            throttle = int(_pick(rng, self.a("array_throttle")))
            # a sweep is sized so that its last task starts within the user's patience on an idle pool:
            # no sixteen 4-GPU day-long tasks on a node of four GPUs
            parallel = max(1, self.capacity[proj.req_type] // probe.req_gpus)
            if throttle:
                parallel = min(parallel, throttle)
            rounds = 1 + int(self.a("queue_patience_h") * 3600.0 // max(runtime, 1.0))
            tasks = min(tasks, parallel * rounds)
        if tasks > 1:
            array = f"0-{tasks - 1}" + (f"%{throttle}" if throttle else "")
            lrs = tuple(fam.lr[i % len(fam.lr)] for i in range(tasks))
        probe = probe._replace(array=array)
        script = render(probe, self.cluster.gres_name(proj.req_type), user.style, self.default_partition, self.cat, lrs)
        base = self.next_id
        self.next_id += tasks
        jobs = []
        for task in range(tasks):
            if array is None:
                job_id, raw = str(base), base
            else:  # as Slurm numbers them: the last task keeps the array's own id
                job_id, raw = f"{base}_{task}", base if task == tasks - 1 else base + task + 1
            fails = rng.random() < self.a("fail_rate")
            cancels = not fails and rng.random() < self.a("cancel_rate")
            params = {**probe.params, "lr": lrs[task]} if lrs else probe.params
            jobs.append(probe._replace(job_id=job_id, job_id_raw=raw, params=params, script=script,
                                       fails=fails, cancels=cancels, stop_frac=rng.random()))
        seen = proj._replace(oom=not fits(probe, proj.req_type, probe.req_gpus),
                             host_oom=host_rss_mib(probe, probe.req_gpus) > probe.mem_mb,
                             timed_out=runtime > limit)
        return jobs, seen

    def _time_limit(self, user: User, runtime: float, factor: float) -> int:
        if user.fixed_limit_s is not None:
            return int(user.fixed_limit_s * factor)
        estimate = runtime * self.rng.lognormvariate(0.0, self.a("estimate_sigma"))
        return _round_up_limit(estimate * self.rng.uniform(*self.a("padding")) * factor)

    def submit_times(self, start: datetime, days: float, count: int) -> list[datetime]:
        """Submission times with the daily and weekly cycle (thinning of a uniform stream)."""
        rng, hours, weekend = self.rng, self.a("office_hours"), self.a("weekend_rate")
        span = days * 86400
        out: list[datetime] = []
        while len(out) < count:
            t = start + timedelta(seconds=int(rng.uniform(0, span)))
            if rng.random() < hours[t.hour] * (weekend if t.weekday() >= 5 else 1.0):
                out.append(t)
        return sorted(out)


def _fix_memory(p: dict[str, Any], fam: Family, rng: random.Random) -> bool:
    """The user's next try after running out of GPU memory; False when nothing is left but a bigger card."""
    if fam.grad_ckpt > 0 and not p["grad_ckpt"]:
        p["grad_ckpt"] = True
    elif p["batch_size"] > 1:
        p["batch_size"] //= 2
    elif fam.lora > 0 and not p["lora"] and fam.lora_r:
        p.update(lora=True, lora_r=_pick(rng, fam.lora_r))
    elif 3 in fam.zero and p["nproc"] > 1 and p["zero"] < 3:
        p["zero"] = 3
    else:
        return False
    return True


def _round_up_limit(seconds: float) -> int:
    """Wall times as users write them: quarter hours under 2 h, whole hours under a day, then half days."""
    step = 900 if seconds < 7200 else 3600 if seconds < 86400 else 43200
    return max(900, math.ceil(seconds / step) * step)


def _job_name(fam: Family, p: dict[str, Any]) -> str:
    name = p["model"] if fam.dataset in p["model"] else f"{p['model']}-{fam.dataset}"
    return name + ("-lora" if p.get("lora") else "")


class _Backlog:
    """Users hold back while what they asked of a GPU type in the past week fills a share of it."""

    WINDOW = timedelta(days=7)

    def __init__(self, cluster: ClusterSpec, share: float) -> None:
        self.room = {t: 0.0 for t in cluster.gpu_types()}
        for part in cluster.partitions:
            for pool in part.pools:
                self.room[pool.gpu_type] += share * len(pool.hosts) * pool.gpus_per_node * self.WINDOW.total_seconds()
        self.asked: dict[tuple[str, str], list[tuple[datetime, float]]] = {}

    def full(self, user: str, gpu_type: str, when: datetime) -> bool:
        recent = [(t, s) for t, s in self.asked.get((user, gpu_type), []) if t > when - self.WINDOW]
        self.asked[(user, gpu_type)] = recent
        return sum(s for _, s in recent) >= self.room[gpu_type]

    def add(self, user: str, gpu_type: str, when: datetime, gpu_seconds: float) -> None:
        self.asked.setdefault((user, gpu_type), []).append((when, gpu_seconds))


def generate(cluster: ClusterSpec, start: datetime, days: float, seed: int,
             jobs_per_day: float | None = None) -> list[JobSpec]:
    """Jobs submitted to ``cluster`` over ``days`` from ``start`` (naive UTC), in submission order.

    ``jobs_per_day`` (default: the cluster's) is what users would submit. They see the queue, as
    ``squeue`` shows it: nobody submits a job that would wait more than ``queue_patience_h`` for
    its GPUs (another user submits, or nobody does then), so on a cluster too small for the rate
    fewer jobs are submitted and queues stay hours long, as on real clusters, instead of growing for
    as long as submissions exceed capacity. The queue is the one ``simulate`` will produce for the
    requested GPUs: a job's start depends only on the jobs submitted before it."""
    gen = _Gen(cluster, seed)
    cat, rng = gen.cat, gen.rng
    users = gen.users()
    weights = [u.activity for u in users]
    trains = {n for n, f in cat.families.items() if f.mode == "train"}
    sweeps = sum(u.activity * sum(w for f, w in u.families.items() if f in trains) for u in users if u.sweeper)
    array_share = sweeps / sum(weights) * gen.a("sweep_share")  # share of submissions that are arrays
    mean_tasks = sum(int(n) * w for n, w in gen.a("array_sizes").items())
    target = (jobs_per_day if jobs_per_day is not None else cluster.jobs_per_day) * days
    events = max(1, round(target / (1 + array_share * (mean_tasks - 1))))
    projects: dict[str, list[Project]] = {u.name: [] for u in users}
    backlog = _Backlog(cluster, gen.a("user_backlog_share"))
    queue = Scheduler(cluster)
    patience = timedelta(hours=gen.a("queue_patience_h"))
    jobs: list[JobSpec] = []
    for when in gen.submit_times(start, days, events):
        for _ in range(20):  # another user submits while this one's queue is long
            user = rng.choices(users, weights=weights)[0]
            mine = projects[user.name]
            if mine and (len(mine) >= gen.a("projects_per_user") or rng.random() < gen.a("repeat_project")):
                index = rng.randrange(len(mine))
                proj = gen.rerun(user, mine[index])
            else:
                index, proj = len(mine), gen.new_project(user)
            if backlog.full(user.name, proj.req_type, when):
                continue
            gpus = gen.req_gpus(user, proj)
            if queue.start_of(proj.req_type, gpus, when) - when <= patience:
                break
        else:
            continue  # every would-be submitter holds back: nobody submits now
        if index == len(mine):
            mine.append(proj)
        submitted, mine[index] = gen.submit(user, proj, when)
        backlog.add(user.name, proj.req_type, when, len(submitted) * submitted[0].req_gpus * proj.runtime_s)
        for job in submitted:
            queue.place(job)
        jobs.extend(submitted)
    return jobs
