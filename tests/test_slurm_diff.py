"""Differential tests against the live Slurm: the scheduler, not a hand-written table, is the oracle.

Hypothesis generates GPU requests over every GPU option (``--gres`` with one or several entries,
``--gpus``/``-G``, ``--gpus-per-node``, ``--gpus-per-task``, ``--gpus-per-socket``,
``--ntasks-per-gpu``), typed, untyped or mixed, with node, task, socket and CPU counts, partitions
and GPU features (what the rules decider acts on), heterogeneous components, and each option in
the script, on the command line or in an ``SBATCH_*`` variable (sometimes in two places at once),
spelt long, short or abbreviated. Counts are small but not only satisfiable ones: sbatch refusing
is an outcome too. Each case is submitted held with plain sbatch and read back with
``scontrol show job`` (one record per heterogeneous component); then

* sbatch accepted: ``build_request`` gives the TRES's GPU total and per-type counts for every
  component, and ``gsbatch --no-rewrite`` submits a job whose TRES (and TresPer*, node, task
  counts, partition) is identical;
* sbatch refused: gsbatch refuses too (non-zero exit) and no job of that name exists;
* the rules decider of contrib/slurmgpu.toml changes the request: gsbatch, rewriting, submits a
  job whose TRES shows the decided type and total (and partition); it refuses, or sbatch refused
  the original: nothing is submitted.

``KNOWN`` keeps every disagreement found so far as a named case, and every change the decider
makes in the golden set (tests/test_golden.py) is submitted the same way.

Cluster facts the strategy is sized for (contrib/local-slurm): one node, 8 CPUs on one socket,
a100:4, v100:4, t4:4. Held jobs are not fitted to the node at submission, so multi-node and
oversized requests are accepted and compared too.

The default share runs ``SLURMGPU_DIFF_EXAMPLES`` cases (25), derandomized so CI is reproducible;
``SLURMGPU_DIFF_EXAMPLES=300`` (``make test-slurm-diff``) runs a few hundred, and
``SLURMGPU_DIFF_SEED=N`` draws another reproducible sequence.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from slurmgpu.pipeline.config import Config, load_config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.plan import Plan, make_plan
from slurmgpu.pipeline.policy import RuleDecider
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.rewrite import RewriteError
from slurmgpu.pipeline.script import parse_script, read_script

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PATH = ROOT / "contrib" / "slurmgpu.toml"
GSBATCH = Path(sys.executable).parent / "gsbatch"
TYPES = ("a100", "v100", "t4")
EXAMPLES = int(os.environ.get("SLURMGPU_DIFF_EXAMPLES", "25"))
SEED = os.environ.get("SLURMGPU_DIFF_SEED") or None

# sbatch 22.05's input variables for the options generated here (src/sbatch/opt.c env_vars[]);
# the node, task and socket counts have none.
ENV_VARS = {"gres": "SBATCH_GRES", "gpus": "SBATCH_GPUS", "gpus-per-node": "SBATCH_GPUS_PER_NODE",
            "gpus-per-task": "SBATCH_GPUS_PER_TASK", "gpus-per-socket": "SBATCH_GPUS_PER_SOCKET",
            "partition": "SBATCH_PARTITION", "constraint": "SBATCH_CONSTRAINT"}
SHORT = {"gpus": "G", "nodes": "N", "ntasks": "n", "cpus-per-task": "c", "partition": "p", "constraint": "C"}
ABBREVIATED = {"gpus-per-node": "gpus-per-n", "gpus-per-task": "gpus-per-t", "ntasks-per-node": "ntasks-per-n"}
GPU_OPTIONS = ("gres", "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket")


# --- cases ----------------------------------------------------------------------------------------


class Opt(NamedTuple):
    """One option as the user wrote it, and where."""

    name: str  # sbatch's long name
    value: str
    where: str  # script | cli | env
    spelling: str = "long="  # long= | long | short | short-joined | abbrev

    def words(self) -> list[str]:
        if self.spelling == "short":
            return ["-" + SHORT[self.name], self.value]
        if self.spelling == "short-joined":
            return ["-" + SHORT[self.name] + self.value]
        if self.spelling == "long":
            return ["--" + self.name, self.value]
        name = ABBREVIATED[self.name] if self.spelling == "abbrev" else self.name
        return [f"--{name}={self.value}"]


class Case(NamedTuple):
    """A batch script's directives per heterogeneous component, command-line options and environment;
    ``lines`` are script lines written as they stand after the directives (#PBS lines, a value on
    a line of its own), ``variables`` other environment variables."""

    components: tuple[tuple[Opt, ...], ...]
    cli: tuple[Opt, ...] = ()
    env: tuple[Opt, ...] = ()
    lines: tuple[str, ...] = ()
    variables: tuple[tuple[str, str], ...] = ()

    def script(self) -> str:
        lines = ["#!/bin/bash"]
        for i, comp in enumerate(self.components):
            if i:
                lines.append("#SBATCH hetjob")
            lines.extend("#SBATCH " + " ".join(shlex.quote(w) for w in o.words()) for o in comp)
        return "\n".join([*lines, *self.lines, "true", ""])

    def cli_words(self) -> list[str]:
        return [w for o in self.cli for w in o.words()]

    def environment(self) -> dict[str, str]:
        return {**{ENV_VARS[o.name]: o.value for o in self.env}, **dict(self.variables)}

    def __str__(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.environment().items())
        head = f"{env} sbatch {shlex.join(self.cli_words())} job.sh".strip()
        return head + "\n" + "\n".join("    " + line for line in self.script().splitlines())


def count() -> st.SearchStrategy[int]:
    return st.sampled_from([1, 1, 1, 2, 2, 3, 4, 0, 5])


@st.composite
def gpu_type(draw: st.DrawFn, typing: str, fixed: str) -> str | None:
    """None for an untyped entry; in a typed case usually the case's type, sometimes another."""
    if typing == "untyped" or (typing == "mixed" and draw(st.booleans())):
        return None
    return fixed if draw(st.integers(0, 3)) else draw(st.sampled_from(TYPES))


@st.composite
def gpu_value(draw: st.DrawFn, name: str, typing: str, fixed: str) -> str:
    """A GPU option's value: one entry mostly, sometimes two or three."""
    entries = []
    for _ in range(draw(st.sampled_from([1, 1, 1, 1, 2, 2, 3]))):
        t, n = draw(gpu_type(typing, fixed)), draw(count())
        implicit = draw(st.integers(0, 5)) == 0  # count 1 left out: gpu, gpu:a100, -G a100
        if name == "gres":
            entries.append("gpu" + (f":{t}" if t else "") + ("" if implicit and n == 1 else f":{n}"))
        elif t:
            entries.append(t if implicit and n == 1 else f"{t}:{n}")
        else:
            entries.append(str(n))
    return ",".join(entries)


@st.composite
def placed(draw: st.DrawFn, name: str, values: st.SearchStrategy[str], in_het: bool) -> list[Opt]:
    """The option placed in the script, on the command line or in the environment; sometimes in two
    places, usually with another value (the command line wins over the environment over the script)."""
    places = ["script"] * 6 + (["cli"] * 3 + (["env"] * 2 if name in ENV_VARS else []) if not in_het else [])
    spellings = ["long="] * 8 + ["long"] * 2 + (["short", "short-joined"] if name in SHORT else [])
    spellings += ["abbrev"] if name in ABBREVIATED else []
    first = Opt(name, draw(values), draw(st.sampled_from(places)), draw(st.sampled_from(spellings)))
    if in_het or draw(st.integers(0, 5)):
        return [first]
    where = draw(st.sampled_from([p for p in ("script", "cli", "env") if p != first.where
                                  and (p != "env" or name in ENV_VARS)]))
    return [first, Opt(name, draw(values), where, draw(st.sampled_from(spellings)))]


@st.composite
def component(draw: st.DrawFn, in_het: bool = False) -> list[Opt]:
    """One component: one to three GPU options, then node, task, socket and CPU counts, a partition
    and a GPU feature, each only sometimes (``--sockets-per-node`` usually when per-socket GPUs are asked)."""
    typing = draw(st.sampled_from(["typed"] * 9 + ["untyped"] * 8 + ["mixed"] * 3))
    fixed = draw(st.sampled_from(TYPES))
    names = draw(st.lists(st.sampled_from(GPU_OPTIONS), min_size=1, max_size=3, unique=True))
    opts: list[Opt] = []
    for name in names:
        opts.extend(draw(placed(name, gpu_value(name, typing, fixed), in_het)))
    geometry: dict[str, st.SearchStrategy[str]] = {
        "nodes": st.sampled_from(["1", "1", "1-1", "1", "2", "1-2", "2-2"]),
        "ntasks": st.sampled_from(["1", "2", "2", "3", "4"]),
        "ntasks-per-node": st.sampled_from(["1", "2", "4"]),
        "ntasks-per-socket": st.sampled_from(["1", "2"]),
        "sockets-per-node": st.sampled_from(["1", "1", "1", "2"]),
        "cpus-per-task": st.sampled_from(["1", "2"]),
        "ntasks-per-gpu": st.sampled_from(["1", "2"]),
        # what the rules decider acts on: a partition without the type, a GPU feature
        "partition": st.sampled_from(["gpu", "gpu-small", "gpu-small", "debug", "gpu-small,gpu"]),
        "constraint": st.sampled_from(["a100", "v100", "t4", "t4", "a100|v100"]),
    }
    odds = {"nodes": 3, "ntasks": 3, "ntasks-per-node": 6, "ntasks-per-socket": 8, "sockets-per-node": 6,
            "cpus-per-task": 8, "ntasks-per-gpu": 12, "partition": 3, "constraint": 4}
    for name, values in geometry.items():
        wanted = draw(st.integers(0, odds[name] - 1)) == 0
        if name == "sockets-per-node" and "gpus-per-socket" in names:
            wanted = draw(st.integers(0, 7)) > 0
        if wanted:
            opts.extend(draw(placed(name, values, in_het)))
    return draw(st.permutations(opts))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A job, heterogeneous one time in four; command-line and environment options apply to every component."""
    first = draw(component())
    het = [draw(component(in_het=True)) for _ in range(draw(st.sampled_from([0, 0, 0, 1])))]
    script = tuple(o for o in first if o.where == "script")
    return Case((script, *(tuple(c) for c in het)),
                tuple(o for o in first if o.where == "cli"), tuple(o for o in first if o.where == "env"))


# --- Slurm and gsbatch ------------------------------------------------------------------------------


class Job(NamedTuple):
    """What scontrol says of one (component) job record."""

    tres: str
    fields: Mapping[str, str]

    @property
    def gpus(self) -> dict[str, int]:
        """GPUs per type as the TRES counts them; untyped ones under ""."""
        found = dict(re.findall(r"gres/gpu(?::([^=,]+))?=(\d+)", self.tres))
        total = int(found.pop("", 0))
        by_type = {t: int(n) for t, n in found.items()}
        untyped = total - sum(by_type.values())
        return {**by_type, **({"": untyped} if untyped else {})}

    def same_request(self) -> tuple[str, ...]:
        keys = ("TresPerJob", "TresPerNode", "TresPerSocket", "TresPerTask", "NumNodes", "NumTasks", "Partition")
        return (self.tres, *(f"{k}={self.fields.get(k)}" for k in keys))


class Submitted(NamedTuple):
    code: int
    stdout: str
    stderr: str
    jobs: tuple[Job, ...]  # one per component, in order

    @property
    def accepted(self) -> bool:
        return self.code == 0 and bool(self.jobs)


def default_partition() -> str:
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30, check=True).stdout
    return next(p.rstrip("*") for p in out.split() if p.endswith("*"))


def scontrol_jobs(job_id: str) -> tuple[Job, ...]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    jobs = []
    for line in out.splitlines():
        fields = dict(re.findall(r"(?:^|\s)([A-Za-z]+)=(\S*)", line))
        jobs.append((int(fields.get("HetJobOffset", "0")), Job(fields.get("TRES", ""), fields)))
    return tuple(j for _, j in sorted(jobs, key=lambda p: p[0]))


def jobs_named(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return out.split()


class Runner:
    """Submits each case's script (a unique file name, so its default job name finds its jobs) and
    cancels everything it created."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.spool = workdir / "spool"
        self.spool.mkdir(exist_ok=True)
        self.created: list[str] = []
        self.default_partition = default_partition()

    def base_env(self) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(self.workdir), "LANG": "C.UTF-8"}

    def gsbatch_env(self) -> dict[str, str]:
        # PYTHONPATH: gsbatch runs this checkout's code, whichever checkout the venv was installed from
        return {**self.base_env(), "PYTHONPATH": str(ROOT), "SLURMGPU_CONFIG": str(CONFIG_PATH),
                "SLURMGPU_SUBMISSION_SPOOL": str(self.spool),
                "SLURMGPU_SOCKET": str(self.workdir / "no-daemon.sock"), "XDG_CACHE_HOME": str(self.workdir / "cache")}

    def submit(self, argv: list[str], env: Mapping[str, str]) -> Submitted:
        res = subprocess.run(argv, capture_output=True, text=True, cwd=self.workdir, env=dict(env), timeout=60,
                             check=False)
        m = re.fullmatch(r"(\d+)(?:;\S*)?\n?", res.stdout)
        jobs: tuple[Job, ...] = ()
        if m:
            self.created.append(m.group(1))
            jobs = scontrol_jobs(m.group(1))
        return Submitted(res.returncode, res.stdout, res.stderr, jobs)

    def cancel(self, names: Sequence[str] = ()) -> None:
        ids = self.created + [i for n in names for i in jobs_named(n)]
        if ids:
            subprocess.run(["scancel", *sorted(set(i.split("+")[0].split("_")[0] for i in ids))],
                           capture_output=True, timeout=30, check=False)
        self.created.clear()


@pytest.fixture(scope="module")
def config() -> Iterator[Config]:
    """The sample config; options are read in-process as the running sbatch reads them (as gsbatch does)."""
    from slurmgpu.pipeline.sbatch_options import release_of, use_slurm_version

    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, check=False).stdout
    use_slurm_version(release_of(version))
    yield load_config(CONFIG_PATH)
    use_slurm_version(None)


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    with tempfile.TemporaryDirectory(prefix="slurm-diff-") as d:
        r = Runner(Path(d))
        yield r
        r.cancel()


def read_request(case: Case, path: str, config: Config) -> dict[str, Any] | str:
    """The request as slurmgpu reads it (JSON form), or the error text when it refuses."""
    try:
        script = parse_script(case.script().encode(), path)
        return build_request(script, case.cli_words(), case.environment(), config.gpu_features()).to_json()
    except InputError as exc:
        return str(exc)


def check_case(case: Case, runner: Runner, config: Config) -> list[str]:
    """Every disagreement between Slurm and slurmgpu on one case (empty: they agree)."""
    name = f"diff-{uuid.uuid4().hex[:12]}.sh"
    path = runner.workdir / name
    path.write_text(case.script())
    problems: list[str] = []
    hold = ["--hold", "--parsable"]
    env = {**runner.base_env(), **case.environment()}
    gs_env = {**runner.gsbatch_env(), **case.environment()}
    try:
        plain = runner.submit(["sbatch", *hold, *case.cli_words(), name], env)
        parsed = read_request(case, name, config)
        before = set(jobs_named(name))  # a refused hetjob can leave a cancelled component record
        keep = runner.submit([str(GSBATCH), "--no-rewrite", *hold, *case.cli_words(), name], gs_env)
        if plain.accepted:
            problems += _compare_parse(plain, parsed, runner.default_partition)
            if not keep.accepted:
                problems.append(f"gsbatch --no-rewrite refused what sbatch accepts: {keep.stderr.strip()}")
            elif [j.same_request() for j in keep.jobs] != [j.same_request() for j in plain.jobs]:
                problems.append(f"gsbatch --no-rewrite submitted {[j.same_request() for j in keep.jobs]}, "
                                f"sbatch {[j.same_request() for j in plain.jobs]}")
        else:
            if keep.code == 0 or keep.jobs or set(jobs_named(name)) - before:
                problems.append(f"sbatch refused ({plain.stderr.strip()}) but gsbatch --no-rewrite submitted "
                                f"{keep.stdout.strip()!r}")
        problems += _check_decision(case, name, plain, runner, config, gs_env)
    finally:
        runner.cancel([name])
    return problems


def _compare_parse(plain: Submitted, parsed: dict[str, Any] | str, default: str) -> list[str]:
    if isinstance(parsed, str):
        return [f"slurmgpu refuses what sbatch accepts: {parsed}"]
    problems = []
    comps = parsed["components"]
    if len(comps) != len(plain.jobs):
        return [f"{len(comps)} components parsed, Slurm made {len(plain.jobs)} job records"]
    for comp, job in zip(comps, plain.jobs, strict=True):
        want = job.gpus
        got = {k: v for k, v in comp.get("gpus_by_type", {}).items() if v}
        if comp["gpus_total"] != sum(want.values()) or got != want:
            problems.append(f"component {comp['index']}: parse says {comp['gpus_total']} GPUs {got}, "
                            f"Slurm TRES {job.tres!r}")
        if "," not in (comp["partition"] or "") and (comp["partition"] or default) != job.fields.get("Partition"):
            problems.append(f"component {comp['index']}: parse says partition {comp['partition'] or default}, "
                            f"Slurm {job.fields.get('Partition')}")
    want_total = sum(sum(j.gpus.values()) for j in plain.jobs)
    if parsed["gpus_total"] != want_total:
        problems.append(f"parse says {parsed['gpus_total']} GPUs in all, Slurm {want_total}")
    return problems


def _check_decision(case: Case, name: str, plain: Submitted, runner: Runner, config: Config,
                    gs_env: Mapping[str, str]) -> list[str]:
    """The rules decider's change, submitted by gsbatch, is what Slurm records; a refusal submits nothing."""
    try:
        plan = make_plan(parse_script(case.script().encode(), name), case.cli_words(), case.environment(),
                         RuleDecider(config), config.gpu_features())
    except InputError:
        return []  # gsbatch refuses with or without rewriting; checked above
    except RewriteError as exc:  # gsbatch would warn and submit as written (--dry-run: fail)
        return [f"the decider made a change the rewrite cannot express: {exc}"]
    decision = plan.decision
    if not decision.changed and not decision.refusal and plain.accepted:
        return []
    before = set(jobs_named(name))
    res = runner.submit([str(GSBATCH), "--hold", "--parsable", *case.cli_words(), name], gs_env)
    if decision.refusal or not plain.accepted:
        if res.code == 0 or res.jobs or set(jobs_named(name)) - before:
            why = f"the decider refused ({decision.refusal})" if decision.refusal else "sbatch refused"
            return [f"{why} but gsbatch submitted {res.stdout.strip()!r}"]
        return []
    return _as_decided(plan, res)


def _as_decided(plan: Plan, res: Submitted) -> list[str]:
    """Slurm's record of the rewritten job shows the decided type, total and partition."""
    decision = plan.decision
    if not res.accepted:
        return [f"gsbatch refused its own rewrite ({decision.to_json()['changes']}): {res.stderr.strip()}"]
    assert plan.request is not None
    problems = []
    for change in decision.changes:
        comp = plan.request.components[change.index]
        job = res.jobs[change.index]
        total = change.gpus_total if change.gpus_total is not None else comp.gpus_total
        if change.gpu_type:
            want = {change.gpu_type: total}
        elif change.gpus_total is None:
            want = comp.gpus_by_type  # type and count as the user wrote them
        else:
            want = {comp.gpu_type or "": total}
        if job.gpus != want:
            problems.append(f"decided {want} for component {change.index}, Slurm TRES {job.tres!r}")
        if change.partition and job.fields.get("Partition") != change.partition:
            problems.append(f"decided partition {change.partition}, Slurm {job.fields.get('Partition')}")
    return problems


# --- the tests --------------------------------------------------------------------------------------


def _settings(test: Any) -> Any:
    test = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)(test)
    return seed(int(SEED))(test) if SEED is not None else test


@_settings
@given(case=cases())
def test_slurm_and_slurmgpu_agree(case: Case, runner: Runner, config: Config) -> None:
    problems = check_case(case, runner, config)
    assert not problems, f"{case}\n" + "\n".join(problems)


def _case(*script: str, cli: Sequence[str] = (), env: Mapping[str, str] | None = None,
          lines: Sequence[str] = (), variables: Mapping[str, str] | None = None) -> Case:
    """A hand-written case: script directives (a lone 'hetjob' separates components), cli words, env,
    raw script lines after the directives and other environment variables."""
    comps: list[list[Opt]] = [[]]
    for word in script:
        if word == "hetjob":
            comps.append([])
            continue
        name, _, value = word.lstrip("-").partition("=")
        comps[-1].append(Opt(name, value, "script"))
    cli_opts = tuple(Opt(w.lstrip("-").partition("=")[0], w.partition("=")[2], "cli") for w in cli)
    names = {v: k for k, v in ENV_VARS.items()}
    env_opts = tuple(Opt(names[k], v, "env") for k, v in (env or {}).items())
    return Case(tuple(tuple(c) for c in comps), cli_opts, env_opts, tuple(lines), tuple((variables or {}).items()))


# The disagreements issue 12 measured, and those this harness found; each one stays checked.
KNOWN = {
    "gpus and gpus-per-node: Slurm 4": _case("--gpus=4", "--gpus-per-node=4"),
    "gres and gpus-per-task, one task: Slurm 1": _case("--gres=gpu:1", "--gpus-per-task=1", "--ntasks=1"),
    "gpus-per-task and gpus-per-node, one task: Slurm 2": _case("--gpus-per-task=2", "--gpus-per-node=2",
                                                                "--ntasks=1"),
    "gpus-per-task and gpus-per-node without tasks: sbatch refuses": _case("--gpus-per-task=2",
                                                                           "--gpus-per-node=2"),
    "256 GPUs on 64 nodes: Slurm 256": _case("--gpus=256", "--gpus-per-node=4", "--nodes=64"),
    "a100 per node and t4 per task: Slurm a100=2 t4=2": _case("--gres=gpu:a100:2", "--ntasks=2",
                                                              "--gpus-per-task=t4:1"),
    "gres=gpu and gpus-per-node: Slurm accepts": _case("--gres=gpu", "--gpus-per-node=2"),
    "gres and gpus-per-node on both sides": _case("--gres=gpu:2", cli=["--gpus-per-node=2"]),
    "typed gres and untyped gpus: sbatch refuses": _case("--gres=gpu:a100:1", "--gpus=1"),
    "two types in one gres": _case("--gres=gpu:a100:1,gpu:v100:1"),
    "a100 per node and v100 per job": _case("--gres=gpu:a100:1", "--gpus=v100:1"),
    "type without count in --gpus": _case("--gpus=a100"),
    "a zero count is skipped": _case("--gres=gpu:a100:0,gpu:1"),
    "zero GPUs per task on the command line": _case("--gpus-per-task=3", "--gres=gpu:3", cli=["--gpus-per-task=0"]),
    "gpus not a multiple of gpus-per-node: sbatch refuses": _case("--gpus=3", "--gpus-per-node=2"),
    "fewer GPUs per node than per task: sbatch refuses": _case("--gres=gpu:1", "--ntasks=2", "--gpus-per-task=2"),
    "gpus and gpus-per-task disagree with -n: sbatch refuses": _case("--ntasks=3", "--gpus=2", "--gpus-per-task=1"),
    "same type twice in one gres: the larger count": _case("--gres=gpu:2,gpu:1"),
    "gpus-per-node and gres disagree: the larger count": _case("--gres=gpu:2", "--gpus-per-node=3"),
    "gpus-per-task implicit tasks from -N": _case("--nodes=2", "--gpus-per-task=2"),
    "gpus-per-task with -N and -c: sbatch refuses": _case("--nodes=1", "--cpus-per-task=2", "--gpus-per-task=1"),
    "more tasks than nodes allow: -n lowers -N": _case("--nodes=2", "--ntasks=1", "--gres=gpu:1"),
    "gpus spread one per node": _case("--gpus=4", "--gres=gpu:1"),
    "gpus-per-socket": _case("--gpus-per-socket=2", "--sockets-per-node=1"),
    "gpus-per-socket from the environment": _case("--sockets-per-node=1", env={"SBATCH_GPUS_PER_SOCKET": "t4:1"}),
    "gpus-per-socket without sockets-per-node: sbatch refuses": _case("--gpus-per-socket=1"),
    "GPUs from tasks: ntasks-per-gpu": _case("--ntasks=4", "--ntasks-per-gpu=2"),
    "tasks from GPUs: ntasks-per-gpu": _case("--ntasks-per-gpu=2", "--gpus=a100:2"),
    "fewer tasks than ntasks-per-gpu: no GPUs": _case("--ntasks=1", "--ntasks-per-gpu=2", "--constraint=t4"),
    "hetjob, cli applies to each component": _case("--gres=gpu:a100:1", "hetjob", "--gpus=t4:2", cli=["--gpus=v100:1"]),
    "hetjob, a command-line GPU option is not rewritten for one component": _case(
        "--ntasks=1", "hetjob", "--gres=gpu:1", cli=["--gpus-per-node=1"], env={"SBATCH_CONSTRAINT": "v100"}),
    "untyped gres with a GPU constraint: made typed": _case("--gres=gpu:2", "--constraint=v100"),
    "typed request in a partition without the type: moved": _case("--gpus-per-task=t4:1", "--ntasks=2"),
    # issue 27: #PBS lines, which sbatch translates after the #SBATCH ones
    "#PBS -q beats #SBATCH -p": _case("--gres=gpu:a100:1", "--partition=gpu", lines=["#PBS -q gpu-small"]),
    "#PBS -q alone: moved where the type is": _case("--gres=gpu:a100:1", lines=["#PBS -q gpu-small"]),
    "#PBS -q attached, a t4 request: stays": _case("--gres=gpu:t4:1", lines=["#PBS -qgpu-small"]),
    "#PBS --destination after the first command": _case("--gres=gpu:a100:1",
                                                        lines=["echo hi", "#PBS --destination=gpu-small"]),
    "#PBS -q under -p on the command line": _case("--gres=gpu:a100:1", cli=["--partition=debug"],
                                                  lines=["#PBS -q gpu-small"]),
    "#PBS -q under SBATCH_PARTITION": _case("--gres=gpu:a100:1", env={"SBATCH_PARTITION": "debug"},
                                            lines=["#PBS -q gpu-small"]),
    "#PBS skipped with --ignore-pbs": _case("--gres=gpu:a100:1", cli=["--ignore-pbs"], lines=["#PBS -q gpu-small"]),
    "#PBS skipped with SBATCH_IGNORE_PBS": _case("--gres=gpu:a100:1", lines=["#PBS -q gpu-small"],
                                                 variables={"SBATCH_IGNORE_PBS": "1"}),
    "#PBS read with SBATCH_IGNORE_PBS=0": _case("--gres=gpu:a100:1", lines=["#PBS -q gpu-small"],
                                                variables={"SBATCH_IGNORE_PBS": "0"}),
    "#PBS after 101 commands: not read": _case("--gres=gpu:a100:1", lines=[*["true"] * 101, "#PBS -q gpu-small"]),
    "#PBS after 100 commands: read": _case("--gres=gpu:a100:1", lines=[*["true"] * 100, "#PBS -q gpu-small"]),
    "#BSUB first: #PBS skipped": _case("--gres=gpu:a100:1", lines=["#BSUB -q debug", "#PBS -q gpu-small"]),
    "#PBS -l nodes with gpus and ppn": _case(lines=["#PBS -l nodes=2:ppn=2:gpus=1"]),
    "#PBS -l gpus replaces #SBATCH --gpus-per-node": _case("--gpus-per-node=a100:1", lines=["#PBS -l nodes=1:gpus=2"]),
    "#PBS -l naccelerators joins #SBATCH --gres": _case("--gres=gpu:1", lines=["#PBS -l naccelerators=2"]),
    "#PBS -l naccelerators with a typed gres: sbatch refuses": _case("--gres=gpu:a100:1",
                                                                     lines=["#PBS -l naccelerators=2"]),
    "#PBS -l select, ncpus, mpiprocs": _case(lines=["#PBS -l select=2:ncpus=2:mpiprocs=2"]),
    "#PBS unknown option: sbatch refuses": _case("--gres=gpu:1", lines=["#PBS -Y"]),
    "#PBS stray word: sbatch refuses": _case("--gres=gpu:1", lines=["#PBS foo -q gpu-small"]),
    "#PBS value on its own line": _case("--gres=gpu:a100:1", lines=["#PBS -q", "#PBS gpu-small"]),
    "#PBS in a hetjob: every component": _case("--ntasks=1", "hetjob", "--gres=gpu:t4:1",
                                               lines=["#PBS -q gpu-small"]),
    # issue 27: what sbatch 22.05 accepts
    "time of a day and a dash": _case("--gres=gpu:1", "--time=1-"),
    "no nodes: no GPUs in the TRES": _case("--nodes=0", "--gres=gpu:1"),
    "no nodes with tasks": _case("--nodes=0", "--ntasks=2", "--gpus-per-task=1"),
    "value on the next #SBATCH line": _case("--gres=gpu:a100:1", lines=["#SBATCH --partition", "#SBATCH gpu-small"]),
    "k suffix on a gres count": _case("--gres=gpu:1k"),
    "k suffix on a typed gres count": _case("--gres=gpu:a100:1K"),
    "k suffix on --gpus": _case("--gpus=1k"),
    "k suffix on the node count": _case("--nodes=1k", "--gpus-per-node=1"),
    "k suffix on the task count: sbatch refuses": _case("--ntasks=1k", "--gres=gpu:1"),
    "-B cores and threads make the tasks": _case("--nodes=1", "--extra-node-info=1:2:2", "--gpus-per-task=1"),
    "SBATCH_THREADS_PER_CORE makes the tasks": _case("--nodes=1", "--extra-node-info=1:2", "--gpus-per-task=1",
                                                     variables={"SBATCH_THREADS_PER_CORE": "2"}),
    # A prefix unambiguous in the running version only: -B in 22.05, ambiguous with --extra in 24.11.
    "a long option's prefix as the running sbatch reads it": _case("--ext=1", "--gres=gpu:1"),
    "a prefix on the command line as the running sbatch reads it": _case("--gres=gpu:1", cli=["--ext=1"]),
    "a prefix of an option the running sbatch lacks or shares": _case("--gres=gpu:1", "--tres-p=gres/gpu:1"),
}


@pytest.mark.parametrize("case", KNOWN.values(), ids=KNOWN.keys())
def test_known_disagreements(case: Case, runner: Runner, config: Config) -> None:
    problems = check_case(case, runner, config)
    assert not problems, f"{case}\n" + "\n".join(problems)


def golden_rewrites() -> list[str]:
    """The golden-set scripts (tests/test_golden.py) whose request the rules decider changes."""
    import test_golden

    config = load_config(CONFIG_PATH)
    changed = []
    for case in test_golden.CASES:
        group, name = case.split("/")
        words, env = test_golden.INVOCATIONS.get(case, ([], {}))
        try:
            plan = make_plan(read_script(str(test_golden.SOURCES[group] / name)), words, env, RuleDecider(config),
                             config.gpu_features())
        except InputError:
            continue
        if plan.decision.changed:
            changed.append(case)
    return changed


@pytest.mark.parametrize("case", golden_rewrites())
def test_golden_rewrites_reach_slurm_as_decided(case: str, runner: Runner, config: Config) -> None:
    """Every change the decider makes in the golden set, submitted by gsbatch, is what Slurm records."""
    import test_golden

    group, name = case.split("/")
    path = test_golden.SOURCES[group] / name
    words, env = test_golden.INVOCATIONS.get(case, ([], {}))
    plan = make_plan(read_script(str(path)), words, env, RuleDecider(config), config.gpu_features())
    hold = ["--hold", "--parsable"]
    try:
        plain = runner.submit(["sbatch", *hold, *words, str(path)], {**runner.base_env(), **env})
        res = runner.submit([str(GSBATCH), *hold, *words, str(path)], {**runner.gsbatch_env(), **env})
        if plain.accepted:
            problems = _as_decided(plan, res)
        else:  # e.g. a gres this cluster lacks: the rewrite must not make it acceptable
            problems = [f"sbatch refused ({plain.stderr.strip()}), gsbatch submitted"] if res.code == 0 else []
    finally:
        runner.cancel()
    assert plan.decision.changed and not problems, "\n".join(problems)
