"""sbatch's option table, so scripts and command lines are split exactly as sbatch splits them.

sbatch parses both its command line and each ``#SBATCH`` line with getopt_long: a long option
may be abbreviated to any unambiguous prefix, an option with a required argument takes the
next word when no ``=`` is given, and an optional argument must be attached.
"""

from __future__ import annotations

from enum import Enum

from slurmgpu.typing_lite import NamedTuple


class Arg(Enum):
    NONE = 0
    REQUIRED = 1
    OPTIONAL = 2


class OptionSpec(NamedTuple):
    name: str
    arg: Arg
    short: str | None = None


_REQ = Arg.REQUIRED
_OPT = Arg.OPTIONAL
_NO = Arg.NONE

# sbatch's options in Slurm 22.05 and 24.11 (slurm_opt.c's common_options with an sbatch setter),
# the union; ``table_for`` drops those the running version lacks, since a prefix unambiguous in one
# version may be ambiguous in the other (``--res``: reservation, or also resv-ports in 24.11).
SPECS: tuple[OptionSpec, ...] = (
    OptionSpec("account", _REQ, "A"),
    OptionSpec("acctg-freq", _REQ),
    OptionSpec("autocomplete", _REQ),
    OptionSpec("array", _REQ, "a"),
    OptionSpec("batch", _REQ),
    OptionSpec("bb", _REQ),
    OptionSpec("bbf", _REQ),
    OptionSpec("begin", _REQ, "b"),
    OptionSpec("chdir", _REQ, "D"),
    OptionSpec("cluster-constraint", _REQ),
    OptionSpec("clusters", _REQ, "M"),
    OptionSpec("comment", _REQ),
    OptionSpec("constraint", _REQ, "C"),
    OptionSpec("context", _REQ),
    OptionSpec("container", _REQ),
    OptionSpec("container-id", _REQ),
    OptionSpec("contiguous", _NO),
    OptionSpec("core-spec", _REQ, "S"),
    OptionSpec("cores-per-socket", _REQ),
    OptionSpec("cpu-freq", _REQ),
    OptionSpec("cpus-per-gpu", _REQ),
    OptionSpec("cpus-per-task", _REQ, "c"),
    OptionSpec("deadline", _REQ),
    OptionSpec("delay-boot", _REQ),
    OptionSpec("dependency", _REQ, "d"),
    OptionSpec("distribution", _REQ, "m"),
    OptionSpec("error", _REQ, "e"),
    OptionSpec("exclude", _REQ, "x"),
    OptionSpec("exclusive", _OPT),
    OptionSpec("export", _REQ),
    OptionSpec("export-file", _REQ),
    OptionSpec("extra", _REQ),
    OptionSpec("extra-node-info", _REQ, "B"),
    OptionSpec("get-user-env", _OPT),
    OptionSpec("gid", _REQ),
    OptionSpec("gpu-bind", _REQ),
    OptionSpec("gpu-freq", _REQ),
    OptionSpec("gpus", _REQ, "G"),
    OptionSpec("gpus-per-node", _REQ),
    OptionSpec("gpus-per-socket", _REQ),
    OptionSpec("gpus-per-task", _REQ),
    OptionSpec("gres", _REQ),
    OptionSpec("gres-flags", _REQ),
    OptionSpec("help", _NO, "h"),
    OptionSpec("hint", _REQ),
    OptionSpec("hold", _NO, "H"),
    OptionSpec("ignore-pbs", _NO),
    OptionSpec("input", _REQ, "i"),
    OptionSpec("job-name", _REQ, "J"),
    OptionSpec("kill-on-invalid-dep", _REQ),
    OptionSpec("licenses", _REQ, "L"),
    OptionSpec("mail-type", _REQ),
    OptionSpec("mail-user", _REQ),
    OptionSpec("mcs-label", _REQ),
    OptionSpec("mem", _REQ),
    OptionSpec("mem-bind", _REQ),
    OptionSpec("mem-per-cpu", _REQ),
    OptionSpec("mem-per-gpu", _REQ),
    OptionSpec("mincpus", _REQ),
    OptionSpec("network", _REQ),
    OptionSpec("nice", _OPT),
    OptionSpec("no-kill", _OPT, "k"),
    OptionSpec("no-requeue", _NO),
    OptionSpec("nodefile", _REQ, "F"),
    OptionSpec("nodelist", _REQ, "w"),
    OptionSpec("nodes", _REQ, "N"),
    OptionSpec("ntasks", _REQ, "n"),
    OptionSpec("ntasks-per-core", _REQ),
    OptionSpec("ntasks-per-gpu", _REQ),
    OptionSpec("ntasks-per-node", _REQ),
    OptionSpec("ntasks-per-socket", _REQ),
    OptionSpec("oom-kill-step", _OPT),
    OptionSpec("open-mode", _REQ),
    OptionSpec("output", _REQ, "o"),
    OptionSpec("overcommit", _NO, "O"),
    OptionSpec("oversubscribe", _NO, "s"),
    OptionSpec("parsable", _NO),
    OptionSpec("partition", _REQ, "p"),
    OptionSpec("power", _REQ),
    OptionSpec("prefer", _REQ),
    OptionSpec("priority", _REQ),
    OptionSpec("profile", _REQ),
    OptionSpec("propagate", _OPT),
    OptionSpec("qos", _REQ, "q"),
    OptionSpec("quiet", _NO, "Q"),
    OptionSpec("reboot", _NO),
    OptionSpec("requeue", _NO),
    OptionSpec("reservation", _REQ),
    OptionSpec("resv-ports", _OPT),
    OptionSpec("segment", _REQ),
    OptionSpec("signal", _REQ),
    OptionSpec("sockets-per-node", _REQ),
    OptionSpec("spread-job", _NO),
    OptionSpec("stepmgr", _NO),
    OptionSpec("switches", _REQ),
    OptionSpec("test-only", _NO),
    OptionSpec("thread-spec", _REQ),
    OptionSpec("threads-per-core", _REQ),
    OptionSpec("time", _REQ, "t"),
    OptionSpec("time-min", _REQ),
    OptionSpec("tmp", _REQ),
    OptionSpec("tres-bind", _REQ),
    OptionSpec("tres-per-task", _REQ),
    OptionSpec("uid", _REQ),
    OptionSpec("usage", _NO),
    OptionSpec("use-min-nodes", _NO),
    OptionSpec("verbose", _NO, "v"),
    OptionSpec("version", _NO, "V"),
    OptionSpec("wait", _NO, "W"),
    OptionSpec("wait-all-nodes", _REQ),
    OptionSpec("wckey", _REQ),
    OptionSpec("wrap", _REQ),
)

BY_NAME: dict[str, OptionSpec] = {s.name: s for s in SPECS}
# Other names sbatch takes for an option (Slurm's slurm_opt.c: one option, two long names); a word
# with either name is read as the option under its canonical name.
ALIASES: dict[str, str] = {"cluster": "clusters", "tasks-per-node": "ntasks-per-node",
                           "ntasks-per-tres": "ntasks-per-gpu"}
BY_SHORT: dict[str, OptionSpec] = {s.short: s for s in SPECS if s.short}


class OptionTable(NamedTuple):
    """One getopt_long table: sbatch's own, or the #PBS/#BSUB ones sbatch translates with."""

    by_name: dict[str, OptionSpec]
    by_short: dict[str, OptionSpec]
    aliases: dict[str, str]

    @classmethod
    def of(cls, specs: tuple[OptionSpec, ...], aliases: dict[str, str] | None = None) -> OptionTable:
        return cls({s.name: s for s in specs}, {s.short: s for s in specs if s.short}, aliases or {})


SBATCH = OptionTable(BY_NAME, BY_SHORT, ALIASES)

# Options only one of the two versions has (the tables of slurm-22-05-8-1 and slurm-24-11-5-1).
ONLY_22_05 = frozenset({"power"})
ONLY_24_11 = frozenset({"autocomplete", "container-id", "extra", "oom-kill-step", "resv-ports", "segment", "stepmgr",
                        "tres-bind", "tres-per-task"})


def table_for(version: tuple[int, int] | None) -> OptionTable:
    """sbatch's table in this Slurm version: 22.05's up to 22.05, 24.11's from 24.11 on, else
    (unknown, or a release between the two) the union, which reads every option either knows."""
    if version is None or (22, 5) < version < (24, 11):
        return SBATCH
    drop = ONLY_24_11 if version <= (22, 5) else ONLY_22_05
    return OptionTable.of(tuple(s for s in SPECS if s.name not in drop), ALIASES)


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) from what ``sbatch --version`` or ``sinfo --version`` print ('slurm-wlm 22.05.8')."""
    import re

    m = re.search(r"(\d+)\.(\d+)\.\d+", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


_active = SBATCH


def use_slurm_version(version: tuple[int, int] | None) -> None:
    """Split every later option list as this Slurm version's sbatch does (gsbatch and the daemon
    call it once, for the Slurm they submit to)."""
    global _active
    _active = table_for(version)

# Input environment variables that sbatch reads as if they were options (man sbatch,
# "INPUT ENVIRONMENT VARIABLES"); only those that shape the resource request matter here.
ENV_OPTIONS: dict[str, str] = {
    "SBATCH_ACCOUNT": "account",
    "SBATCH_ARRAY_INX": "array",
    "SBATCH_CONSTRAINT": "constraint",
    "SBATCH_CPUS_PER_GPU": "cpus-per-gpu",
    "SBATCH_GPUS": "gpus",
    "SBATCH_GPUS_PER_NODE": "gpus-per-node",
    "SBATCH_GPUS_PER_SOCKET": "gpus-per-socket",
    "SBATCH_GPUS_PER_TASK": "gpus-per-task",
    "SBATCH_GRES": "gres",
    "SBATCH_JOB_NAME": "job-name",
    "SBATCH_MEM_PER_CPU": "mem-per-cpu",
    "SBATCH_MEM_PER_GPU": "mem-per-gpu",
    "SBATCH_MEM_PER_NODE": "mem",
    "SBATCH_PARTITION": "partition",
    "SBATCH_QOS": "qos",
    "SBATCH_THREADS_PER_CORE": "threads-per-core",  # one task per thread with -N and no -n
    "SBATCH_TIMELIMIT": "time",
}
ENV_BY_OPTION: dict[str, str] = {v: k for k, v in ENV_OPTIONS.items()}


def active_long_names() -> list[str]:
    """The long option names (and aliases) of the sbatch options are split for."""
    return [*_active.by_name, *_active.aliases]


class OptionError(ValueError):
    """An option sbatch would not accept as written (ambiguous, missing argument)."""

    def __init__(self, option: str, message: str, at: int | None = None) -> None:
        super().__init__(message)
        self.option = option
        self.at = at  # the index of the word it is about, where split_options knows it


def lookup_long(word: str, table: OptionTable | None = None) -> OptionSpec | None:
    """Resolve a long option name or unambiguous prefix, as getopt_long does (in ``table``, else
    the running Slurm's sbatch table)."""
    table = table or _active
    by_name, aliases = table.by_name, table.aliases
    exact = by_name.get(aliases.get(word, word))
    if exact is not None:
        return exact
    named = [n for n in (*by_name, *aliases) if n.startswith(word)]
    # getopt_long: prefixes of two names of one option are not ambiguous
    matches = list(dict.fromkeys(by_name[aliases.get(n, n)] for n in named))
    if len(matches) > 1:
        names = ", ".join("--" + n for n in named)
        raise OptionError("--" + word, f"option '--{word}' is ambiguous; possibilities: {names}")
    return matches[0] if matches else None


class ParsedOption(NamedTuple):
    """One option as found in a word list: canonical name, value, and which words it used."""

    name: str  # canonical long name, or the word itself for an unknown option
    value: str | None
    first: int  # index of the first word
    last: int  # index of the last word (== first unless the value was the next word)
    known: bool = True


def split_options(words: list[str], table: OptionTable | None = None) -> tuple[list[ParsedOption], int]:
    """Split sbatch-style words into options; return them and the index of the first operand.

    Stops at the first non-option word (the script), at ``--``, or at a lone ``:`` (the
    heterogeneous-job separator), like sbatch's getopt with a leading ``+``.
    """
    table = table or _active
    out: list[ParsedOption] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return out, i + 1
        if word == ":" or not word.startswith("-") or word == "-":
            return out, i
        if word.startswith("--"):
            body = word[2:]
            name, eq, attached = body.partition("=")
            try:
                spec = lookup_long(name, table)
            except OptionError as exc:
                exc.at = i
                raise
            if spec is None:
                out.append(ParsedOption(word.split("=", 1)[0], attached if eq else None, i, i, known=False))
                i += 1
                continue
            if spec.arg is Arg.NONE:
                if eq:
                    raise OptionError("--" + spec.name, f"option '--{spec.name}' doesn't allow an argument", i)
                out.append(ParsedOption(spec.name, None, i, i))
            elif eq or spec.arg is Arg.OPTIONAL:
                out.append(ParsedOption(spec.name, attached if eq else None, i, i))
            else:
                if i + 1 >= len(words):
                    raise OptionError("--" + spec.name, f"option '--{spec.name}' requires an argument", i)
                out.append(ParsedOption(spec.name, words[i + 1], i, i + 1))
                i += 1
            i += 1
            continue
        # A cluster of short options: -HN2 is -H -N 2.
        j = 1
        while j < len(word):
            spec = table.by_short.get(word[j])
            if spec is None:
                out.append(ParsedOption("-" + word[j], None, i, i, known=False))
                j += 1
                continue
            rest = word[j + 1 :]
            if spec.arg is Arg.NONE:
                out.append(ParsedOption(spec.name, None, i, i))
                j += 1
                continue
            if rest or spec.arg is Arg.OPTIONAL:
                out.append(ParsedOption(spec.name, rest or None, i, i))
            else:
                if i + 1 >= len(words):
                    raise OptionError("-" + word[j], f"option requires an argument -- '{word[j]}'", i)
                out.append(ParsedOption(spec.name, words[i + 1], i, i + 1))
                i += 1
            break
        i += 1
    return out, i
