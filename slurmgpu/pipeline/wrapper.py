"""``#PBS`` and ``#BSUB`` lines, translated into sbatch options as sbatch itself does.

sbatch reads them after the script's ``#SBATCH`` directives and before ``SBATCH_*`` variables and
the command line (src/sbatch/opt.c, process_options_second_pass), so a ``#PBS -q`` beats
``#SBATCH -p`` but not ``-p`` on the command line; they apply to every hetjob component. Only the
first kind found is read (``#BSUB``, then ``#PBS``); ``--ignore-pbs`` or ``SBATCH_IGNORE_PBS``
skips both. Each kind's words go through getopt_long as one argv with the kind's own table, and
every option maps onto an sbatch option, some through ``-l``'s resource list (src/sbatch/xlate.c,
Slurm 22.05 and 24.11: the tables are the union, 24.11 adds ``#PBS -d``/``-w``).
"""

from __future__ import annotations

from collections.abc import Mapping

from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.sbatch_options import Arg, OptionError, OptionSpec, OptionTable, split_options
from slurmgpu.pipeline.script import BatchScript, Word, tokenize
from slurmgpu.typing_lite import NamedTuple

_R, _N = Arg.REQUIRED, Arg.NONE
PBS = OptionTable.of((
    OptionSpec("start_time", _R, "a"), OptionSpec("account", _R, "A"), OptionSpec("checkpoint", _R, "c"),
    OptionSpec("working_dir", _R, "C"), OptionSpec("error", _R, "e"), OptionSpec("hold", _N, "h"),
    OptionSpec("interactive", _N, "I"), OptionSpec("join", _R, "j"), OptionSpec("job_array", _R, "J"),
    OptionSpec("keep", _R, "k"), OptionSpec("resource_list", _R, "l"), OptionSpec("mail_options", _R, "m"),
    OptionSpec("mail_user_list", _R, "M"), OptionSpec("job_name", _R, "N"), OptionSpec("out", _R, "o"),
    OptionSpec("priority", _R, "p"), OptionSpec("destination", _R, "q"), OptionSpec("rerunable", _R, "r"),
    OptionSpec("script_path", _R, "S"), OptionSpec("array", _R, "t"), OptionSpec("running_user", _R, "u"),
    OptionSpec("variable_list", _R, "v"), OptionSpec("all_env", _N, "V"), OptionSpec("attributes", _R, "W"),
    OptionSpec("no_std", _N, "z"), OptionSpec("-d", _R, "d"), OptionSpec("-w", _R, "w"),
))  # "-d", "-w", "-n": short options without a long name (no word spells a long name with a dash)
BSUB = OptionTable.of((
    OptionSpec("cwd", _R, "c"), OptionSpec("error_file", _R, "e"), OptionSpec("job_name", _R, "J"),
    OptionSpec("hostname", _R, "m"), OptionSpec("memory_limit", _R, "M"), OptionSpec("output_file", _R, "o"),
    OptionSpec("queue_name", _R, "q"), OptionSpec("time", _R, "W"), OptionSpec("exclusive", _N, "x"),
    OptionSpec("-n", _R, "n"),
))
# The options whose value is the sbatch option's value as written (None: read, then dropped).
_PBS_DIRECT: dict[str, str | None] = {
    "start_time": "begin", "account": "account", "error": "error", "out": "output", "job_array": "array",
    "array": "array", "mail_user_list": "mail-user", "job_name": "job-name", "priority": "nice",
    "destination": "partition", "-d": "chdir", "-w": "chdir", "checkpoint": None, "working_dir": None,
    "join": None, "keep": None, "rerunable": None, "script_path": None, "running_user": None,
}
_BSUB_DIRECT = {"cwd": "chdir", "error_file": "error", "job_name": "job-name", "output_file": "output",
                "queue_name": "partition", "time": "time"}


class WrapperOption(NamedTuple):
    """One sbatch option a #PBS/#BSUB line sets: ``words`` spell its value as written (empty when the
    value is derived, e.g. from ``-l nodes=2:gpus=1``, which a rewrite cannot change in place)."""

    name: str
    value: str | None
    line: int
    words: tuple[Word, ...] = ()


def ignored(cli: Mapping[str, object], env: Mapping[str, str]) -> bool:
    """--ignore-pbs (command line or script) or SBATCH_IGNORE_PBS set to anything but false (measured:
    '', 'yes' and '1' skip the lines; '0', '00', 'no' and 'false' do not)."""
    value = env.get("SBATCH_IGNORE_PBS")
    off = value is not None and not (value.lower() in ("no", "false") or (value.isdigit() and int(value) == 0))
    return off or "ignore-pbs" in cli


def translate(script: BatchScript, state: Mapping[str, str | None]) -> list[WrapperOption]:
    """The sbatch options the script's #PBS or #BSUB lines set, in sbatch's order; ``state`` holds the
    values already set (a few translations extend them). Raises InputError where sbatch refuses."""
    if not script.wrapper:
        return []
    words: list[tuple[int, Word]] = []
    for lineno, start, end in script.wrapper_lines:
        words.extend((lineno, w) for w in tokenize(script.text, start, end, script.path, lineno))
    texts = [w.text for _, w in words]
    pbs = script.wrapper == "#PBS"
    if not pbs:  # sbatch turns '-cwd' in an option's place into -c (getopt has no single-dash long names)
        texts = ["-c" if t == "-cwd" and i % 2 == 0 else t for i, t in enumerate(texts)]
    try:
        options, operand = split_options(texts, PBS if pbs else BSUB)
    except OptionError as exc:
        raise _refusal(script, words, str(exc)) from None
    if operand < len(texts):
        raise _refusal(script, words, f"Invalid argument: {texts[operand]}", words[operand][0])
    out: list[WrapperOption] = []
    current = dict(state)
    for o in options:
        line = words[o.first][0]
        if not o.known:
            raise _refusal(script, words, f"invalid option -- '{o.name.lstrip('-')}'", line)
        value_words = tuple(w for _, w in words[o.first: o.last + 1])[-1:]
        found = _pbs_option(o.name, o.value, line, value_words, current) if pbs else \
            _bsub_option(o.name, o.value, line, value_words)
        for opt in found:
            current[opt.name] = opt.value
        out.extend(found)
    return out


def _refusal(script: BatchScript, words: list[tuple[int, Word]], message: str, line: int | None = None) -> InputError:
    where = line if line is not None else (words[-1][0] if words else None)
    return InputError(f"{script.wrapper} {message}", file=script.path, line=where)


def _pbs_option(name: str, value: str | None, line: int, words: tuple[Word, ...],
                state: dict[str, str | None]) -> list[WrapperOption]:
    if name in _PBS_DIRECT:
        target = _PBS_DIRECT[name]
        return [WrapperOption(target, value, line, words)] if target else []
    if name == "hold":
        return [WrapperOption("hold", None, line)]
    if name == "mail_options":
        return [WrapperOption("mail-type", _mail_type(value or ""), line)]
    if name == "variable_list":
        return [WrapperOption("export", ",".join(v for v in (state.get("export"), value) if v), line)]
    if name == "attributes" and value:
        key, _, rest = value.partition("=")
        if key.lower() == "depend":
            return [WrapperOption("dependency", rest, line)]
        return []  # umask= sets what no request reads; other attributes are ignored by sbatch too
    if name == "resource_list":
        return _resource_list(value or "", line, state)
    return []  # interactive, all_env, no_std: read and dropped


def _bsub_option(name: str, value: str | None, line: int, words: tuple[Word, ...]) -> list[WrapperOption]:
    if name in _BSUB_DIRECT:
        return [WrapperOption(_BSUB_DIRECT[name], value, line, words)]
    if name == "exclusive":
        return [WrapperOption("exclusive", None, line)]
    value = value or ""
    if name == "hostname":
        return [WrapperOption("nodelist", value.replace(" ", ","), line)]
    if name == "memory_limit":  # LSF's default unit is KB
        return [WrapperOption("mem-per-cpu", value + "K" if value[-1:].isdigit() else value, line)]
    # -n MIN,MAX: sbatch takes the maximum
    tasks = value.split(",", 1)[1] if "," in value else value
    if not tasks:
        raise InputError(f"#BSUB -n format not correct given: '{value}'", line=line)
    return [WrapperOption("ntasks", tasks, line)]


def _mail_type(arg: str) -> str:
    low = arg.lower()
    if "n" in low:
        return "NONE"
    return ",".join(t for c, t in (("b", "BEGIN"), ("e", "END"), ("a", "FAIL")) if c in low)


def _leading_int(text: str) -> int:
    """C's strtol on a node spec part: the leading digits, 0 when none."""
    digits = len(text) - len(text.lstrip("0123456789"))
    return int(text[:digits]) if digits else 0


def _value(rl: str, i: int, sep: str) -> tuple[str, int]:
    """Text from i to the next sep, and the position after that sep."""
    end = rl.find(sep, i)
    return (rl[i:], len(rl)) if end < 0 else (rl[i:end], end + 1)


_SKIPPED = ("arch=", "host=", "opsys=", "other=", "pmem=", "pvmem=", "software=", "vmem=")
_TIMES = ("cput=", "pcput=", "walltime=")


def _resource_list(rl: str, line: int, state: dict[str, str | None]) -> list[WrapperOption]:
    """``-l`` as sbatch scans it: a key matched at any position (some case-insensitively), its value
    up to ',' (or ':' for PBS Pro's select chunk), anything else skipped a character at a time."""
    out: list[WrapperOption] = []
    gpus, pro = 0, 0  # pro: bits for select, ncpus and mpiprocs (PBS Pro's chunk)

    def put(name: str, value: str | None) -> None:
        out.append(WrapperOption(name, value, line))
        state[name] = value

    i = 0
    while i < len(rl):
        rest, low = rl[i:], rl[i:].lower()
        if low.startswith("accelerator="):
            i += 12
            if rl[i:i + 4].lower() == "true" and gpus < 1:
                gpus = 1
        elif key := next((k for k in _SKIPPED if rest.startswith(k)), None):
            i = _value(rl, i + len(key), ",")[1]
        elif key := next((k for k in _TIMES if rest.startswith(k)), None):
            value, i = _value(rl, i + len(key), ",")
            put("time", value)
        elif rest.startswith(("file=", "mem=")):
            key = rest[: rest.index("=") + 1]
            value, i = _value(rl, i + len(key), ",")
            put("tmp" if key == "file=" else "mem", value[:-1] if value[-1:].upper() == "B" else value)
        elif low.startswith(("mpiprocs=", "ncpus=", "select=")):
            key = low[: low.index("=") + 1]
            value, i = _value(rl, i + len(key), ":")
            pro |= {"select=": 1, "ncpus=": 2, "mpiprocs=": 4}[key]
            put({"select=": "nodes", "ncpus=": "mincpus", "mpiprocs=": "ntasks-per-node"}[key], value)
        elif low.startswith("naccelerators="):
            value, i = _value(rl, i + 14, ",")
            if not value.strip().isdigit():
                raise InputError(f'Invalid numeric value "{value}" for naccelerators.', line=line)
            gpus = int(value)
        elif rest.startswith("nice="):
            value, i = _value(rl, i + 5, ",")
            put("nice", value)
        elif rest.startswith("nodes="):
            value, i = _value(rl, i + 6, ",")
            for name, v in _nodes(value):
                put(name, v)
        elif rest.startswith("proc="):
            value, i = _value(rl, i + 5, ",")
            put("constraint", ",".join(v for v in (value, state.get("constraint")) if v))
            i = _value(rl, i, ",")[1]
        else:
            i += 1
    cpus, per_node = state.get("mincpus"), state.get("ntasks-per-node")
    if pro == 7 and cpus and per_node and cpus.isdigit() and per_node.isdigit() and int(per_node) \
            and int(cpus) > int(per_node):
        put("cpus-per-task", str(int(cpus) // int(per_node)))
    if gpus > 0:
        put("gres", ",".join(v for v in (state.get("gres"), f"gpu:{gpus}") if v))
    return out


def _nodes(spec: str) -> list[tuple[str, str]]:
    """``nodes=2:ppn=4:gpus=1`` (Torque): nodes, tasks (ppn per node), GPUs per node, named hosts."""
    out: list[tuple[str, str]] = []
    count = ppn = 0
    hosts: list[str] = []
    i = 0
    while i < len(spec):
        part = spec[i:]
        end = min((p for p in (part.find("+"), part.find(":")) if p >= 0), default=len(part))
        step = end + 1
        if part.startswith("gpus="):
            out.append(("gpus-per-node", part[5:end]))
        elif part.startswith("ppn="):
            ppn += _leading_int(part[4:])
        elif part[0].isdigit():
            count += _leading_int(part)
        elif part[0].isalpha():
            hosts.append(part[:end])
        else:
            step = 1
        i += step
    if count:
        out.append(("nodes", str(count)))
    if ppn:
        out.append(("ntasks", str(ppn * max(count, 1))))
    if hosts:
        out.append(("nodelist", ",".join(hosts)))
    return out
