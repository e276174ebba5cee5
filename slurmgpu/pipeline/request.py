"""The job's resource request as one typed object, whatever syntax the user wrote it in.

sbatch merges three sources — command line over ``SBATCH_*`` environment over script
directives — option by option; the GPU request can be spelled five ways (``--gres``,
``--gpus``, ``--gpus-per-node``, ``--gpus-per-task``, ``--gpus-per-socket``) plus node
features in ``--constraint``. ``build_request`` folds all of that into a ``JobRequest`` and
remembers where each effective value came from, so a rewrite can change it at its source.

How many GPUs of which type that request is worth is Slurm's arithmetic, not a sum of what was
written: ``tally_gpus`` replays Slurm 22.05's own (``gres_job_state_validate`` in
src/common/gres.c, run by sbatch and again by slurmctld), checked case by case against the live
scheduler by tests/test_slurm_diff.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from slurmgpu.pipeline.errors import SBATCH_USAGE, InputError
from slurmgpu.pipeline.sbatch_options import ENV_OPTIONS, OptionError, split_options
from slurmgpu.pipeline.script import BatchScript
from slurmgpu.typing_lite import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from typing import Any, Literal

    Per = Literal["job", "node", "task", "socket"]

GPU_OPTIONS: dict[str, str] = {
    "gres": "node",
    "gpus": "job",
    "gpus-per-node": "node",
    "gpus-per-task": "task",
    "gpus-per-socket": "socket",
}

# GPU model names that sites commonly publish as node features; the admin config adds its own.
KNOWN_GPU_FEATURES = frozenset(
    "k80 p100 t4 v100 v100s a10 a30 a40 a100 a6000 l4 l40 l40s h100 h200 b200 gh200 mi100 mi210 mi250 mi300".split()
)

# Patterns as text are compiled on first use (re caches them): most submissions need none of them.
_COUNT = r"^\d+$"
# A GPU count may carry a binary suffix, as Slurm's gres parser reads it: gpu:1k is 1024 GPUs.
_GPU_COUNT = re.compile(r"^(\d+)([kmg]?)$", re.IGNORECASE)
_TIME_DHMS = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_DAYS_ONLY = re.compile(r"^(\d+)-$")  # '1-': a day (time_str2mins reads the missing hours as 0)
_MEM = r"(?i)^(\d+)([KMGT]?)B?$"
# -N MIN[-MAX], each with an optional k/m suffix (get_resource_arg_range); 0 nodes is accepted.
_NODES = r"(?i)^(\d+)([km]?)(?:-(\d+)([km]?))?$"
_SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


COMMAND_LINE = "command line"  # where an option typed after gsbatch/sbatch was set, in messages


class Origin(NamedTuple):
    """Where an effective option value came from."""

    source: Literal["script", "env", "cli", "wrapper"]  # wrapper: a #PBS/#BSUB line sbatch translates
    line: int | None = None  # script line
    variable: str | None = None  # environment variable
    index: int | None = None  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema (first command-line word)
    last: int | None = None  # last command-line word (the value, when it was a word of its own)
    span: tuple[int, int] | None = None  # wrapper: the script text of the word that spells the value

    def describe(self, path: str) -> str:
        if self.source in ("script", "wrapper"):
            return f"{path}:{self.line}"
        if self.source == "env":
            return f"environment {self.variable}"
        return COMMAND_LINE


class OptionValue(NamedTuple):
    name: str
    value: str | None
    origin: Origin


class GpuAsk(NamedTuple):
    """One GPU request as written: count of one type (or any type) per job/node/task/socket."""

    type: str | None
    count: int  # type: ignore[assignment]  # field name shadows tuple.count; kept for the JSON schema
    per: Per
    option: str  # the option that spelled it
    origin: Origin
    other_gres: tuple[str, ...] = ()  # non-GPU entries sharing a --gres list, kept on rewrite


class GpuTally(NamedTuple):
    """What Slurm makes of one component's GPU options: the GPUs its TRES records per type, and the
    node, task and socket counts it derives from them on the way (see ``tally_gpus``)."""

    by_type: tuple[tuple[str, int], ...] = ()  # (type, or "" when untyped; count), in Slurm's order
    per_node: int | None = 0  # GPUs on each node, where that is one number
    nodes: int = 1  # the minimum node count Slurm settles on
    tasks: int | None = None  # the task count, where Slurm knows one
    sockets_per_node: int | None = None


class ComponentRequest(NamedTuple):
    """The request of one (possibly heterogeneous) job component."""

    index: int  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema
    options: Mapping[str, OptionValue]
    gpus: tuple[GpuAsk, ...] = ()
    constraint_gpu_types: tuple[str, ...] = ()
    nodes: int = 1
    nodes_max: int | None = None
    nodes_set: bool = False
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    sockets_per_node: int | None = None
    mem_mb: int | None = None
    mem_per_cpu_mb: int | None = None
    mem_per_gpu_mb: int | None = None
    time_limit_s: int | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    array: str | None = None
    job_name: str | None = None
    tally: GpuTally = GpuTally()

    @property
    def partitions(self) -> list[str]:
        return [p for p in (self.partition or "").split(",") if p]

    @property
    def array_tasks(self) -> tuple[int, int]:
        """(tasks, at most this many at once: 0 for no limit) of ``--array``, as Slurm reads
        ``0-15``, ``1,3,8-9``, ``0-15:4`` and ``%4``; (1, 0) for none or a spec it would refuse."""
        return array_tasks(self.array)

    @property
    def gpu_types(self) -> list[str]:
        types = [t for t, n in self.tally.by_type if t and n]
        if not types and len(self.constraint_gpu_types) == 1:
            types = list(self.constraint_gpu_types)
        return sorted(set(types))

    @property
    def gpu_type(self) -> str | None:
        types = self.gpu_types
        return types[0] if len(types) == 1 else None

    @property
    def gpus_by_type(self) -> dict[str, int]:
        """GPUs per type as Slurm counts them in the job's TRES; untyped ones under ""."""
        return {t: n for t, n in self.tally.by_type if n}

    def multiplier(self, per: Per) -> int:
        """How many units Slurm multiplies a per-job/node/task/socket GPU count by."""
        if per == "job":
            return 1
        if per == "node":
            return self.tally.nodes
        if per == "task":
            return self.tally.tasks or 1
        return (self.tally.sockets_per_node or 1) * self.tally.nodes

    @property
    def gpus_total(self) -> int:
        """GPUs for the whole component, as Slurm's TRES counts them."""
        return sum(n for _, n in self.tally.by_type)

    @property
    def gpus_per_node(self) -> int | None:
        """GPUs on each node, where the request makes that a single number."""
        return self.tally.per_node if self.tally.by_type else 0

    @property
    def rewrite_blocker(self) -> str | None:
        """Why a changed GPU type or count could not be written back without changing what else
        Slurm reads from the request (None: one option with one entry, which a rewrite replaces)."""
        asks = self.gpus
        if self.nodes_set and self.nodes == 0:
            return "-N 0: Slurm records no GPUs for a job of no nodes"
        derived = next((g for g in asks if g.origin.source == "wrapper" and g.origin.span is None), None)
        if derived is not None:
            return f"GPUs derived from a resource list on line {derived.origin.line} (#PBS -l)"
        if not asks:
            return "GPUs implied by --ntasks-per-gpu" if self.gpus_total else None
        if len({g.option for g in asks}) > 1:
            return "GPUs asked through several options (" + ", ".join(sorted({"--" + g.option for g in asks})) + ")"
        if len(asks) > 1:
            return f"several GPU entries in one --{asks[0].option}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "gpu_type": self.gpu_type,
            "gpu_types": self.gpu_types,
            "gpus_total": self.gpus_total,
            "gpus_by_type": self.gpus_by_type,
            "gpus_per_node": self.gpus_per_node,
            "gpu_requests": [
                {"type": g.type, "count": g.count, "per": g.per, "option": "--" + g.option}
                for g in self.gpus
            ],
            "constraint_gpu_types": list(self.constraint_gpu_types),
            "nodes": self.nodes,
            "nodes_max": self.nodes_max,
            "ntasks": self.ntasks,
            "ntasks_per_node": self.ntasks_per_node,
            "cpus_per_task": self.cpus_per_task,
            "mem_mb": self.mem_mb,
            "mem_per_cpu_mb": self.mem_per_cpu_mb,
            "mem_per_gpu_mb": self.mem_per_gpu_mb,
            "time_limit_s": self.time_limit_s,
            "partition": self.partition,
            "account": self.account,
            "qos": self.qos,
        }


class JobRequest(NamedTuple):
    """A whole job: its components, its script, and the options passed through untouched."""

    script: BatchScript | None
    components: tuple[ComponentRequest, ...]
    cli_words: tuple[str, ...] = ()
    env: Mapping[str, str] = MappingProxyType({})
    unknown_options: tuple[str, ...] = ()

    @property
    def main(self) -> ComponentRequest:
        return self.components[0]

    @property
    def gpus_total(self) -> int:
        return sum(c.gpus_total for c in self.components)

    @property
    def gpus_by_type(self) -> dict[str, int]:
        """GPUs per type over all components; untyped ones under ""."""
        out: dict[str, int] = {}
        for c in self.components:
            for t, n in c.gpus_by_type.items():
                out[t] = out.get(t, 0) + n
        return out

    @property
    def gpu_type(self) -> str | None:
        """The one type every GPU-requesting component asks for; None when any is untyped or they differ."""
        types = {c.gpu_type for c in self.components if c.gpus_total}
        return types.pop() if len(types) == 1 else None

    @property
    def is_hetjob(self) -> bool:
        return len(self.components) > 1

    def to_json(self) -> dict[str, Any]:
        main = self.main
        return {
            "script": self.script.path if self.script else None,
            "gpu_type": self.gpu_type,
            "gpus_total": self.gpus_total,
            "gpus_by_type": self.gpus_by_type,
            "gpus_per_node": main.gpus_per_node,
            "nodes": main.nodes,
            "ntasks": main.ntasks,
            "cpus_per_task": main.cpus_per_task,
            "mem_mb": main.mem_mb,
            "time_limit_s": main.time_limit_s,
            "partition": main.partition,
            "account": main.account,
            "array": main.array,
            "job_name": main.job_name,
            "hetjob": self.is_hetjob,
            "components": [c.to_json() for c in self.components],
            "ignored_directives": [
                {"line": i.line, "text": i.text, "reason": i.reason}
                for i in (self.script.ignored if self.script else ())
            ],
            "unknown_options": list(self.unknown_options),
        }


# --- value parsers: each raises InputError(option=...) on a value sbatch would refuse -------


def parse_count(text: str, option: str) -> int:
    if text.startswith("-") and text[1:].isdigit():
        raise InputError(f"negative GPU count '{text}'", option=option)
    m = _GPU_COUNT.match(text)
    if not m:
        raise InputError(f"malformed count '{text}' (expected a whole number)", option=option)
    return int(m.group(1)) * _SUFFIX[m.group(2).lower()]


def parse_gres(value: str, option: str = "--gres") -> tuple[list[tuple[str | None, int]], list[str]]:
    """Split a --gres list into GPU (type, count) pairs and the other gres entries."""
    gpus: list[tuple[str | None, int]] = []
    others: list[str] = []
    if value.lower() == "none":
        return gpus, others
    for item in value.split(","):
        if not item:
            raise InputError(f"empty entry in '{value}'", option=option)
        parts = item.split(":")
        name = parts[0].removeprefix("gres/")
        if name != "gpu":
            others.append(item)
            continue
        if len(parts) == 1:
            gpus.append((None, 1))
        elif len(parts) == 2:
            tail = parts[1]
            if _GPU_COUNT.match(tail) or (tail.startswith("-") and tail[1:].isdigit()):
                gpus.append((None, parse_count(tail, option)))
            elif tail:
                gpus.append((tail, 1))
            else:
                raise InputError(f"malformed GPU request '{item}'", option=option)
        elif len(parts) == 3 and parts[1]:
            gpus.append((parts[1], parse_count(parts[2], option)))
        else:
            raise InputError(f"malformed GPU request '{item}' (expected gpu[:type][:count])", option=option)
    return gpus, others


def parse_gpus(value: str, option: str) -> list[tuple[str | None, int]]:
    """Parse --gpus / --gpus-per-* values: ``[type:]count`` entries, comma-separated; a lone type
    is one GPU of it (sbatch sends ``-G a100`` as ``gres:gpu:a100``)."""
    out: list[tuple[str | None, int]] = []
    for item in value.split(","):
        parts = item.split(":")
        if len(parts) == 1 and parts[0] and not (_GPU_COUNT.match(parts[0]) or parts[0].startswith("-")):
            out.append((parts[0], 1))
        elif len(parts) == 1 and parts[0]:
            out.append((None, parse_count(parts[0], option)))
        elif len(parts) == 2 and parts[0] and parts[1]:
            out.append((parts[0], parse_count(parts[1], option)))
        else:
            raise InputError(f"malformed GPU request '{item}' (expected [type:]count)", option=option)
    return out


def parse_time(value: str, option: str = "--time") -> int | None:
    """Slurm time limit to seconds; None for UNLIMITED/INFINITE."""
    if value.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    if days_only := _DAYS_ONLY.match(value):
        return int(days_only.group(1)) * 86400
    m = _TIME_DHMS.match(value)
    if not m:
        raise InputError(f"invalid time limit '{value}'", option=option, exit_code=SBATCH_USAGE)
    days, a, b, c = m.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # hours:minutes:seconds
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # minutes:seconds
        return int(a) * 60 + int(b)
    return int(a) * 60  # minutes


def format_time(seconds: int) -> str:
    """A time limit as sbatch's --time reads it and scontrol shows it: [days-]hours:minutes:seconds.
    The pipeline's own copy of ``slurm.sacct.format_duration``: the two layers may not import each
    other (pyproject's import contracts); above them, that one serves."""
    days, rest = divmod(int(seconds), 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def parse_mem_mb(value: str, option: str) -> int:
    m = re.match(_MEM, value)
    if not m:
        raise InputError(f"invalid memory size '{value}'", option=option, exit_code=SBATCH_USAGE)
    number, unit = int(m.group(1)), m.group(2).upper()
    if unit == "K":
        return -(-number // 1024)  # sbatch rounds kilobytes up to whole megabytes
    return number * {"": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]


def parse_positive(value: str, option: str) -> int:
    if not re.match(_COUNT, value) or int(value) == 0:
        raise InputError(f"invalid value '{value}' (expected a positive whole number)", option=option)
    return int(value)


def constraint_features(expr: str) -> list[str]:
    """Feature names in a --constraint expression (operators, counts and brackets dropped)."""
    names = re.split(r"[&|,\[\]()!]|\*\d*", expr)
    return [n.strip() for n in names if n.strip()]


# --- merging the three sources ---------------------------------------------------------------


def _cli_options(words: Sequence[str]) -> tuple[list[OptionValue], list[str]]:
    try:
        parsed, _ = split_options(list(words))
    except OptionError as exc:
        raise InputError(str(exc), file=COMMAND_LINE, option=exc.option, exit_code=SBATCH_USAGE) from None
    values = [OptionValue(p.name, p.value, Origin("cli", index=p.first, last=p.last)) for p in parsed if p.known]
    unknown = [p.name for p in parsed if not p.known]
    return values, unknown


def _env_options(env: Mapping[str, str]) -> list[OptionValue]:
    return [OptionValue(opt, env[var], Origin("env", variable=var)) for var, opt in ENV_OPTIONS.items() if var in env]


def build_request(
    script: BatchScript | None,
    cli_options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    gpu_features: Iterable[str] = (),
) -> JobRequest:
    """Merge script directives, SBATCH_* variables and command-line options, as sbatch does."""
    env = dict(env or {})
    cli, unknown = _cli_options(cli_options)
    env_values = _env_options(env)
    features = KNOWN_GPU_FEATURES | {f.lower() for f in gpu_features}
    ncomp = script.components if script else 1
    components: list[ComponentRequest] = []
    translate = False  # #PBS or #BSUB lines, and no --ignore-pbs: pipeline.wrapper is loaded for them alone
    if script is not None and script.wrapper:
        from slurmgpu.pipeline import wrapper

        translate = not wrapper.ignored({o.name: o for o in (*cli, *(
            OptionValue(d.name, d.value, Origin("script")) for d in script.directives))}, env)
    for index in range(ncomp):
        merged: dict[str, OptionValue] = {}
        if script:
            for d in script.component_directives(index):
                if d.known:
                    merged[d.name] = OptionValue(d.name, d.value, Origin("script", line=d.line))
                else:
                    unknown.append(d.name)
        if script and translate:  # after the directives, before the environment; every component
            state = {k: v.value for k, v in merged.items()}
            for w in wrapper.translate(script, state):
                span = (w.words[0].start, w.words[0].end) if w.words else None
                merged[w.name] = OptionValue(w.name, w.value, Origin("wrapper", line=w.line, span=span))
        for ov in (*env_values, *cli):
            merged[ov.name] = ov
        if components:
            _inherit(merged, components[0].options)
        try:
            components.append(_component(index, merged, features))
        except InputError as exc:
            raise _locate(exc, script, merged) from None
    return JobRequest(script, tuple(components), tuple(cli_options), env, tuple(dict.fromkeys(unknown)))


def _extra_field(extra: str | None, field: int) -> int | None:
    """Sockets per node (0), cores per socket (1) or threads per core (2) from -B/--extra-node-info
    'S[:C[:T]]' ('*' or a malformed field: not given; sbatch itself refuses a malformed one)."""
    fields = (extra or "").split(":")
    text = fields[field] if field < len(fields) else ""
    return int(text) if text.isdigit() and int(text) > 0 else None


_MEMORY = ("mem", "mem-per-cpu", "mem-per-gpu")
# What later hetjob components take from component 0 when they do not say (seen with real
# sbatch 22.05 and scontrol); partition, constraint and GPUs are not inherited.
_INHERITED = (("time",), _MEMORY, ("account",), ("job-name",), ("qos",))


def _inherit(merged: dict[str, OptionValue], first: Mapping[str, OptionValue]) -> None:
    for family in _INHERITED:
        if not any(name in merged for name in family):
            merged.update({name: first[name] for name in family if name in first})


def _locate(exc: InputError, script: BatchScript | None, merged: Mapping[str, OptionValue]) -> InputError:
    """Attach where the option an error is about was set: the command line, the environment
    variable, or the script line (a value from the command line is never blamed on the script)."""
    if exc.file or exc.option is None:
        return exc
    ov = merged.get(exc.option.lstrip("-"))
    if ov is not None and ov.origin.source in ("cli", "env"):
        return exc.located(file=ov.origin.describe(""))
    if script is None:
        return exc
    name = exc.option.lstrip("-")
    lines = [d.line for d in script.directives if d.name == name]
    return exc.located(file=script.path, line=lines[-1] if lines else None)


def _component(index: int, opts: dict[str, OptionValue], features: frozenset[str] | set[str]) -> ComponentRequest:
    def val(name: str) -> str | None:
        ov = opts.get(name)
        return ov.value if ov else None

    gpus: list[GpuAsk] = []
    for name, per in GPU_OPTIONS.items():
        ov = opts.get(name)
        if ov is None or ov.value is None:
            continue
        if name == "gres":
            pairs, others = parse_gres(ov.value)
            gpus.extend(GpuAsk(t, c, "node", name, ov.origin, tuple(others)) for t, c in pairs)
        else:
            gpus.extend(GpuAsk(t, c, per, name, ov.origin) for t, c in parse_gpus(ov.value, "--" + name))  # type: ignore[arg-type]
    constraint = val("constraint")
    ctypes = tuple(f.lower() for f in constraint_features(constraint) if f.lower() in features) if constraint else ()

    nodes, nodes_max = 1, None
    if (n := val("nodes")) is not None:
        m = re.match(_NODES, n)
        if not m:
            raise InputError(f"invalid node count '{n}'", option="--nodes", exit_code=SBATCH_USAGE)
        nodes = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
        nodes_max = int(m.group(3)) * _SUFFIX[m.group(4).lower()] if m.group(3) else nodes
        if nodes_max < nodes:
            raise InputError(f"invalid node count '{n}' (maximum below minimum)", option="--nodes",
                             exit_code=SBATCH_USAGE)

    def pos(name: str) -> int | None:
        v = val(name)
        return parse_positive(v, "--" + name) if v is not None else None

    def mem(name: str) -> int | None:
        v = val(name)
        return parse_mem_mb(v, "--" + name) if v is not None else None

    # sbatch (slurm_opt.c, _validate_memory_options): two given on the command line or in the script
    # are an error; one given there drops any from the environment; two from the environment are.
    given = [n for n in _MEMORY if val(n) is not None]
    explicit = [n for n in given if opts[n].origin.source != "env"]
    if len(explicit) > 1:
        raise InputError(f"{' and '.join('--' + n for n in explicit)} are mutually exclusive",
                         option="--" + explicit[-1])
    if explicit:
        opts = {k: v for k, v in opts.items() if k not in given or k in explicit}
    elif len(given) > 1:
        raise InputError(f"{' and '.join(str(opts[n].origin.variable) for n in given)} are mutually exclusive")
    time_value = val("time")
    comp = ComponentRequest(
        index=index,
        options=dict(opts),
        gpus=tuple(gpus),
        constraint_gpu_types=tuple(dict.fromkeys(ctypes)),
        nodes=nodes,
        nodes_max=nodes_max,
        nodes_set="nodes" in opts,
        ntasks=pos("ntasks"),
        ntasks_per_node=pos("ntasks-per-node"),
        cpus_per_task=pos("cpus-per-task"),
        sockets_per_node=pos("sockets-per-node") or _extra_field(val("extra-node-info"), 0),
        mem_mb=mem("mem"),
        mem_per_cpu_mb=mem("mem-per-cpu"),
        mem_per_gpu_mb=mem("mem-per-gpu"),
        time_limit_s=parse_time(time_value) if time_value is not None else None,
        partition=val("partition"),
        account=val("account"),
        qos=val("qos"),
        array=val("array"),
        job_name=val("job-name"),
    )
    return comp._replace(tally=tally_gpus(comp))


# --- Slurm's GPU arithmetic ------------------------------------------------------------------
#
# sbatch turns --gpus into tres_per_job, --gpus-per-node then --gres into tres_per_node,
# --gpus-per-socket and --gpus-per-task into tres_per_socket and tres_per_task (slurm_opt.c).
# gres_job_state_validate (gres.c) keeps one record per GPU type ("" when untyped): a later entry
# of the same type and unit replaces the count, and the record's total is the largest of
# per-job count, per-node count x nodes, per-socket count x sockets and per-task count x tasks
# seen while reading. It then checks the units against each other, deriving node, task and
# socket counts, and refuses typed and untyped GPUs together. sbatch runs it first (its derived
# counts go to slurmctld), slurmctld again; the TRES is the sum of the second run's totals.

_UNITS: tuple[Per, ...] = ("job", "node", "socket", "task")


class _Job:
    """The job descriptor fields the GPU validation reads and may change (None: not set). A plain
    class, not a dataclass: importing dataclasses would cost gsbatch's hot path ~10 ms."""

    __slots__ = ("num_tasks", "min_nodes", "max_nodes", "ntasks_per_node", "ntasks_per_socket", "sockets_per_node",
                 "cpus_per_task", "ntasks_per_gpu")

    def __init__(self, num_tasks: int | None, min_nodes: int | None, max_nodes: int | None,
                 ntasks_per_node: int | None, ntasks_per_socket: int | None, sockets_per_node: int | None,
                 cpus_per_task: int | None, ntasks_per_gpu: int | None) -> None:
        self.num_tasks, self.min_nodes, self.max_nodes = num_tasks, min_nodes, max_nodes
        self.ntasks_per_node, self.ntasks_per_socket = ntasks_per_node, ntasks_per_socket
        self.sockets_per_node, self.cpus_per_task, self.ntasks_per_gpu = sockets_per_node, cpus_per_task, ntasks_per_gpu


class _Record:
    """One GPU type's record: the last count per unit, the largest total seen."""

    def __init__(self, gtype: str) -> None:
        self.type = gtype
        self.count: dict[Per, int] = {}
        self.option: dict[Per, str] = {}
        self.total = 0


def _submitted_job(comp: ComponentRequest) -> _Job:
    """What sbatch sends after its own option checks (src/sbatch/opt.c, _opt_verify)."""
    def lenient(name: str) -> int | None:
        ov = comp.options.get(name)
        return int(ov.value) if ov and ov.value and ov.value.isdigit() else None

    ntasks, min_nodes, max_nodes = comp.ntasks, comp.nodes, comp.nodes_max or 0
    if comp.ntasks_per_node and ntasks is None and (max_nodes == 0 or min_nodes == max_nodes):
        ntasks = min_nodes * comp.ntasks_per_node
    if comp.nodes_set and (min_nodes == max_nodes or max_nodes == 0) and ntasks is None:
        extra = comp.options["extra-node-info"].value if "extra-node-info" in comp.options else None
        per_node = [n for n in (comp.sockets_per_node, lenient("cores-per-socket") or _extra_field(extra, 1),
                                lenient("threads-per-core") or _extra_field(extra, 2)) if n]
        if per_node:  # one task per socket, core or thread unless told
            import math  # rare (sockets, cores or threads asked): start-up does not load the extension

            ntasks = math.prod(per_node, start=max(min_nodes, 1))
    elif comp.nodes_set and ntasks is not None:
        max_nodes = min(max_nodes, ntasks) if max_nodes else max_nodes
        if ntasks < min_nodes:
            min_nodes = max_nodes = ntasks
    return _Job(num_tasks=ntasks, min_nodes=min_nodes if comp.nodes_set else None,
                max_nodes=max_nodes if comp.nodes_set and max_nodes else None,
                ntasks_per_node=comp.ntasks_per_node, ntasks_per_socket=lenient("ntasks-per-socket"),
                sockets_per_node=comp.sockets_per_node, cpus_per_task=comp.cpus_per_task,
                ntasks_per_gpu=lenient("ntasks-per-gpu"))


def _read_records(asks: Sequence[GpuAsk], job: _Job) -> list[_Record]:
    """Slurm's records in its reading order, with their totals; untyped and typed together refused."""
    if (job.ntasks_per_gpu or any(g.per == "task" for g in asks)) and job.num_tasks is None \
            and job.min_nodes is not None and job.min_nodes == job.max_nodes:
        if job.ntasks_per_gpu:
            job.num_tasks = job.min_nodes * job.ntasks_per_gpu
        elif job.ntasks_per_node:  # the task count implied by whole nodes
            job.num_tasks = job.min_nodes * job.ntasks_per_node
        elif job.cpus_per_task is None:
            job.num_tasks = job.min_nodes
    records: dict[str, _Record] = {}
    for unit in _UNITS:
        ordered = sorted((g for g in asks if g.per == unit), key=lambda g: g.option == "gres")
        for g in ordered:
            if g.count == 0:
                continue  # Slurm skips a zero count entirely
            rec = records.setdefault(g.type or "", _Record(g.type or ""))
            rec.count[unit], rec.option[unit] = g.count, "--" + g.option
            times = 1
            if unit == "node" and job.min_nodes is not None:
                times = job.min_nodes
            elif unit == "socket" and job.min_nodes is not None and job.sockets_per_node is not None:
                times = job.min_nodes * job.sockets_per_node
            elif unit == "socket" and job.num_tasks is not None and job.ntasks_per_socket is not None:
                times = -(-job.num_tasks // job.ntasks_per_socket)
            elif unit == "task" and job.num_tasks is not None:
                times = job.num_tasks
            rec.total = max(rec.total, g.count * times)
    if job.ntasks_per_gpu:  # tasks from GPUs, or (no GPUs asked) untyped GPUs for the job from tasks
        if records:
            job.num_tasks = sum(r.total for r in records.values()) * job.ntasks_per_gpu
        elif job.num_tasks is not None:
            if job.num_tasks >= job.ntasks_per_gpu:
                if job.num_tasks % job.ntasks_per_gpu:
                    raise InputError("-n/--ntasks has to be a multiple of --ntasks-per-gpu",
                                     option="--ntasks-per-gpu")
                rec = records[""] = _Record("")
                rec.count["job"] = rec.total = job.num_tasks // job.ntasks_per_gpu
                rec.option["job"] = "--ntasks-per-gpu"
        else:
            raise InputError("--ntasks-per-gpu needs either a GPU request or a node/task count",
                             option="--ntasks-per-gpu")
    for rec in records.values():
        _check_units(rec, job)
    if "" in records and len(records) > 1:
        typed = next(r for r in records.values() if r.type)
        untyped = records[""]
        raise InputError("Invalid GRES specification (with and without type identification): "
                         f"{next(iter(untyped.option.values()))} asks for untyped GPUs, "
                         f"{next(iter(typed.option.values()))} for {typed.type}",
                         option=next(iter(untyped.option.values())))
    return list(records.values())


def _check_units(rec: _Record, job: _Job) -> None:
    """Slurm's _test_gres_cnt for one record: its units must agree; derived counts go into ``job``."""
    c = rec.count
    per_job, per_node, per_socket, per_task = (c.get(u, 0) for u in _UNITS)

    def refuse(message: str, unit: Per) -> InputError:
        return InputError(message, option=rec.option.get(unit))

    if per_job and any(n > per_job for n in (per_node, per_task, per_socket)):
        raise refuse("Failed to ensure --gpus >= --gres=gpu/--gpus-per-node >= --gpus-per-socket", "job")
    if per_node and (per_task > per_node or per_socket > per_node):
        raise refuse("Failed to ensure --gpus >= --gpus-per-task", "node")
    if per_socket and job.sockets_per_node is None:
        raise refuse("--gpus-per-socket option requires --sockets-per-node specification", "socket")
    if per_job and per_node:
        if per_job % per_node:
            raise refuse("--gpus is not multiple of --gres=gpu/--gpus-per-node", "job")
        nodes = per_job // per_node
        if (job.min_nodes is not None and nodes < job.min_nodes) or (job.max_nodes is not None
                                                                      and nodes > job.max_nodes):
            raise refuse(f"Based on --gpus and --gres=gpu/--gpus-per-node required nodes ({nodes}) doesn't fall "
                         f"between min_nodes ({job.min_nodes}) and max_nodes ({job.max_nodes}) boundaries", "job")
        job.min_nodes = job.max_nodes = nodes
    if per_node and per_socket:
        if per_node % per_socket:
            raise refuse("--gres=gpu/--gpus-per-node not multiple of --gpus-per-socket", "socket")
        if job.sockets_per_node is None:
            job.sockets_per_node = per_node // per_socket
        elif job.sockets_per_node != per_node // per_socket:
            raise refuse("Based on --gres=gpu/--gpus-per-node and --gpus-per-socket required number of sockets "
                         "differ from --sockets-per-node", "socket")
    if per_task:
        if per_job:
            if per_job % per_task:
                raise refuse("--gpus not multiple of --gpus-per-task", "task")
            if job.num_tasks is None:
                job.num_tasks = per_job // per_task
            elif job.num_tasks != per_job // per_task:
                raise refuse("Based on --gpus and --gpus-per-task number of requested tasks differ from -n/--ntasks",
                             "task")
        elif job.num_tasks is not None:
            per_job = job.num_tasks * per_task
        else:
            raise refuse("--gpus-per-task used without either --gpus or -n/--ntasks is not allowed", "task")
    if per_node and per_task:
        if per_node % per_task:
            raise refuse("--gres=gpu/--gpus-per-node not multiple of --gpus-per-task", "task")
        if not job.ntasks_per_node:
            job.ntasks_per_node = per_node // per_task
        elif job.ntasks_per_node != per_node // per_task:
            raise refuse("Based on --gres=gpu/--gpus-per-node and --gpus-per-task requested number of tasks per "
                         "node differ from --ntasks-per-node", "task")
    if per_socket and per_task:
        if per_socket % per_task:
            raise refuse("--gpus-per-socket not multiple of --gpus-per-task", "task")
        if not job.ntasks_per_socket:
            job.ntasks_per_socket = per_socket // per_task
        elif job.ntasks_per_socket != per_socket // per_task:
            raise refuse("Based on --gpus-per-socket and --gpus-per-task requested number of tasks per sockets "
                         "differ from --ntasks-per-socket", "task")
    if per_job:
        if job.min_nodes is not None and per_job < job.min_nodes:
            raise refuse("--gpus < -N", "job" if "job" in c else "task")
        if job.max_nodes is not None and per_job < job.max_nodes:
            job.max_nodes = per_job


def tally_gpus(comp: ComponentRequest) -> GpuTally:
    """The component's GPUs as Slurm 22.05 counts them, with the node, task and socket counts it
    derives; raises InputError where sbatch or slurmctld would refuse the combination."""
    if (not comp.gpus and "ntasks-per-gpu" not in comp.options) or (comp.nodes_set and comp.nodes == 0):
        # measured: with -N 0 (or 0-N) Slurm's TRES holds no GPUs, whatever the GPU options say
        return GpuTally(nodes=comp.nodes, tasks=comp.ntasks, sockets_per_node=comp.sockets_per_node)
    if "ntasks-per-gpu" in comp.options:  # sbatch's own check (slurm_opt.c, _validate_ntasks_per_gpu)
        for name in ("gpus-per-task", "gpus-per-socket", "ntasks-per-node"):
            if name in comp.options:
                raise InputError(f"--{name} is mutually exclusive with --ntasks-per-gpu", option="--" + name)
    job = _submitted_job(comp)
    _read_records(comp.gpus, job)  # sbatch's run; only its derived counts reach slurmctld
    if job.min_nodes is None:
        job.min_nodes = 1
    records = _read_records(comp.gpus, job)  # slurmctld's run: the TRES
    nodes = job.min_nodes or 1
    single = nodes == 1 and job.max_nodes in (None, 1)
    per_node: int | None = 0
    for rec in records:
        c = rec.count
        if "node" in c:
            n: int | None = c["node"]
        elif "socket" in c:
            n = c["socket"] * (job.sockets_per_node or 1)
        elif "task" in c and job.ntasks_per_node:
            n = c["task"] * job.ntasks_per_node
        elif "task" in c and job.num_tasks == nodes and job.max_nodes == nodes:
            n = c["task"]  # as many tasks as nodes: one on each
        else:
            n = rec.total if single else None
        per_node = None if per_node is None or n is None else per_node + n
    return GpuTally(tuple((r.type, r.total) for r in records), per_node, nodes, job.num_tasks, job.sockets_per_node)


_ARRAY_RANGE = r"(\d+)(?:-(\d+)(?::(\d+))?)?"  # compiled on first use


def array_tasks(spec: str | None) -> tuple[int, int]:
    """(tasks, concurrent limit or 0) of an ``--array`` value; (1, 0) for none or a malformed one."""
    if not spec:
        return 1, 0
    body, _, limit = spec.partition("%")
    tasks = 0
    for part in body.split(","):
        m = re.fullmatch(_ARRAY_RANGE, part.strip())
        if m is None:
            return 1, 0
        first, last, step = int(m[1]), int(m[2] or m[1]), int(m[3] or 1)
        if last < first or step < 1:
            return 1, 0
        tasks += (last - first) // step + 1
    return max(tasks, 1), int(limit) if limit.isdigit() else 0

