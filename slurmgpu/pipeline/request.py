"""The job's resource request as one typed object, whatever syntax the user wrote it in.

sbatch merges three sources — command line over ``SBATCH_*`` environment over script
directives — option by option; the GPU request can be spelled five ways (``--gres``,
``--gpus``, ``--gpus-per-node``, ``--gpus-per-task``, ``--gpus-per-socket``) plus node
features in ``--constraint``. ``build_request`` folds all of that into a ``JobRequest`` and
remembers where each effective value came from, so a rewrite can change it at its source.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.sbatch_options import ENV_OPTIONS, OptionError, split_options
from slurmgpu.pipeline.script import BatchScript

GPU_OPTIONS: dict[str, str] = {
    "gres": "node",
    "gpus": "job",
    "gpus-per-node": "node",
    "gpus-per-task": "task",
    "gpus-per-socket": "socket",
}
Per = Literal["job", "node", "task", "socket"]

# GPU model names that sites commonly publish as node features; the admin config adds its own.
KNOWN_GPU_FEATURES = frozenset(
    "k80 p100 t4 v100 v100s a10 a30 a40 a100 a6000 l4 l40 l40s h100 h200 b200 gh200 mi100 mi210 mi250 mi300".split()
)

_COUNT = re.compile(r"^\d+$")
_TIME_DHMS = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM = re.compile(r"^(\d+)([KMGT]?)B?$", re.IGNORECASE)
_NODES = re.compile(r"^(\d+)(?:-(\d+))?$")


class Origin(NamedTuple):
    """Where an effective option value came from."""

    source: Literal["script", "env", "cli"]
    line: int | None = None  # script line
    variable: str | None = None  # environment variable
    index: int | None = None  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema (first command-line word)
    last: int | None = None  # last command-line word (the value, when it was a word of its own)

    def describe(self, path: str) -> str:
        if self.source == "script":
            return f"{path}:{self.line}"
        if self.source == "env":
            return f"environment {self.variable}"
        return "command line"


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

    @property
    def partitions(self) -> list[str]:
        return [p for p in (self.partition or "").split(",") if p]

    @property
    def gpu_types(self) -> list[str]:
        types = [g.type for g in self.gpus if g.type]
        if not types and len(self.constraint_gpu_types) == 1:
            types = list(self.constraint_gpu_types)
        return sorted(set(types))

    @property
    def gpu_type(self) -> str | None:
        types = self.gpu_types
        return types[0] if len(types) == 1 else None

    def _tasks(self) -> int:
        if self.ntasks is not None:
            return self.ntasks
        if self.ntasks_per_node is not None:
            return self.ntasks_per_node * self.nodes
        return self.nodes

    def multiplier(self, per: Per) -> int:
        """How many units a per-job/node/task/socket GPU count is multiplied by."""
        if per == "job":
            return 1
        if per == "node":
            return self.nodes
        if per == "task":
            return self._tasks()
        return (self.sockets_per_node or 1) * self.nodes

    @property
    def gpus_total(self) -> int:
        """GPUs for the whole component (per-node counts times the minimum node count)."""
        return sum(g.count * self.multiplier(g.per) for g in self.gpus)

    @property
    def gpus_per_node(self) -> int | None:
        """GPUs on each node, where the request makes that a single number."""
        if not self.gpus:
            return 0
        total = 0
        for g in self.gpus:
            if g.per == "node":
                total += g.count
            elif g.per == "socket":
                total += g.count * (self.sockets_per_node or 1)
            elif g.per == "task" and (self.ntasks_per_node is not None or self.ntasks is None):
                total += g.count * (self.ntasks_per_node or 1)  # one task per node unless told
            elif self.nodes == 1 and self.nodes_max in (None, 1):
                total += g.count * self.multiplier(g.per)
            else:
                return None
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "gpu_type": self.gpu_type,
            "gpu_types": self.gpu_types,
            "gpus_total": self.gpus_total,
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
    def gpu_type(self) -> str | None:
        """The one type every GPU-requesting component asks for; None when any is untyped or they differ."""
        types = {c.gpu_type for c in self.components if c.gpus}
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
    if not _COUNT.match(text):
        raise InputError(f"malformed count '{text}' (expected a whole number)", option=option)
    return int(text)


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
            if _COUNT.match(tail) or (tail.startswith("-") and tail[1:].isdigit()):
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
    """Parse --gpus / --gpus-per-* values: ``[type:]count`` entries, comma-separated."""
    out: list[tuple[str | None, int]] = []
    for item in value.split(","):
        parts = item.split(":")
        if len(parts) == 1 and parts[0]:
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
    m = _TIME_DHMS.match(value)
    if not m:
        raise InputError(f"invalid time limit '{value}'", option=option)
    days, a, b, c = m.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # hours:minutes:seconds
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # minutes:seconds
        return int(a) * 60 + int(b)
    return int(a) * 60  # minutes


def parse_mem_mb(value: str, option: str) -> int:
    m = _MEM.match(value)
    if not m:
        raise InputError(f"invalid memory size '{value}'", option=option)
    number, unit = int(m.group(1)), m.group(2).upper()
    if unit == "K":
        return -(-number // 1024)  # sbatch rounds kilobytes up to whole megabytes
    return number * {"": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]


def parse_positive(value: str, option: str) -> int:
    if not _COUNT.match(value) or int(value) == 0:
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
        raise InputError(str(exc), option=exc.option) from None
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
    for index in range(ncomp):
        merged: dict[str, OptionValue] = {}
        if script:
            for d in script.component_directives(index):
                if d.known:
                    merged[d.name] = OptionValue(d.name, d.value, Origin("script", line=d.line))
                else:
                    unknown.append(d.name)
        for ov in (*env_values, *cli):
            merged[ov.name] = ov
        if components:
            _inherit(merged, components[0].options)
        try:
            components.append(_component(index, merged, features))
        except InputError as exc:
            raise _locate(exc, script) from None
    return JobRequest(script, tuple(components), tuple(cli_options), env, tuple(dict.fromkeys(unknown)))


# What later hetjob components take from component 0 when they do not say (seen with real
# sbatch 22.05 and scontrol); partition, constraint and GPUs are not inherited.
_INHERITED = (("time",), ("mem", "mem-per-cpu", "mem-per-gpu"), ("account",), ("job-name",), ("qos",))


def _inherit(merged: dict[str, OptionValue], first: Mapping[str, OptionValue]) -> None:
    for family in _INHERITED:
        if not any(name in merged for name in family):
            merged.update({name: first[name] for name in family if name in first})


def _locate(exc: InputError, script: BatchScript | None) -> InputError:
    """Attach the script line of the option an error is about, when it came from the script."""
    if exc.file or script is None or exc.option is None:
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
    _check_conflicts(gpus)
    constraint = val("constraint")
    ctypes = tuple(f.lower() for f in constraint_features(constraint) if f.lower() in features) if constraint else ()

    nodes, nodes_max = 1, None
    if (n := val("nodes")) is not None:
        m = _NODES.match(n)
        if not m or int(m.group(1)) == 0:
            raise InputError(f"invalid node count '{n}'", option="--nodes")
        nodes = int(m.group(1))
        nodes_max = int(m.group(2)) if m.group(2) else nodes
        if nodes_max < nodes:
            raise InputError(f"invalid node count '{n}' (maximum below minimum)", option="--nodes")

    def pos(name: str) -> int | None:
        v = val(name)
        return parse_positive(v, "--" + name) if v is not None else None

    def mem(name: str) -> int | None:
        v = val(name)
        return parse_mem_mb(v, "--" + name) if v is not None else None

    if sum(val(n) is not None for n in ("mem", "mem-per-cpu", "mem-per-gpu")) > 1:
        given = [f"--{n}" for n in ("mem", "mem-per-cpu", "mem-per-gpu") if val(n) is not None]
        raise InputError(f"{' and '.join(given)} are mutually exclusive", option=given[-1])
    if any(g.per == "task" for g in gpus) and not ({"ntasks", "ntasks-per-node", "nodes", "gpus"} & opts.keys()):
        # sbatch's own check (slurm_opt.c), reported before submission rather than after.
        raise InputError("--gpus-per-task used without either --gpus or -n/--ntasks is not allowed",
                         option="--gpus-per-task")
    time_value = val("time")
    return ComponentRequest(
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
        sockets_per_node=pos("sockets-per-node"),
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


def _check_conflicts(gpus: list[GpuAsk]) -> None:
    """Two GPU options that cannot both hold (sbatch would refuse or silently pick one)."""
    by_option: dict[str, GpuAsk] = {}
    for g in gpus:
        by_option.setdefault(g.option, g)
    if "gres" in by_option and "gpus-per-node" in by_option:
        raise InputError("--gres=gpu and --gpus-per-node both set the GPUs per node; use one",
                         option="--gpus-per-node")
    typed = {g.type for g in gpus if g.type}
    if len(by_option) > 1 and len(typed) > 1:
        a, b = list(by_option.values())[:2]
        raise InputError(f"conflicting GPU types: --{a.option} asks for {a.type or 'any'}, "
                         f"--{b.option} for {b.type or 'any'}", option="--" + b.option)
