"""How few GPUs a job's launch can run on.

``torchrun --nproc_per_node=4`` on one GPU starts four processes on one card; ``srun -n 8`` with a
GPU per task needs eight GPUs. Each launch in the script (torchrun, ``python -m
torch.distributed.run``, accelerate, deepspeed, mpirun, horovodrun, srun, or a program's own
``--devices``/``--gpus`` count) is read for its process count, from the launcher's own options only:

- a number, written there or in a plain ``N=4`` earlier in the script: the fewest GPUs the job can
  be given (more are consistent, if wasted: ``--nproc_per_node=2`` under ``--gres=gpu:8`` uses two);
- what Slurm gives the job (``$SLURM_GPUS_ON_NODE``, a variable set from it or from ``nvidia-smi -L``,
  ``CUDA_VISIBLE_DEVICES`` or ``torch.cuda.device_count()``, ``--nproc_per_node=gpu``, deepspeed
  without a count): any count;
- anything else (another variable, a launch in the background, a launcher inside ``srun``, a
  count from a config file): the count the job asked for, and only the GPU type may change.

A script with no launcher keeps its count (unless the family's own runs showed GPUs it left idle:
the decider's evidence, not the script's, ``FamilyEvidence.busy``); reading ``$CUDA_VISIBLE_DEVICES``
elsewhere in the script says nothing of how many processes the program starts.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from slurmgpu.pipeline.features import command_lines, shell_words
from slurmgpu.pipeline.sbatch_options import BY_SHORT, Arg, OptionError, lookup_long

if TYPE_CHECKING:
    from slurmgpu.pipeline.request import JobRequest

# Where a launch starts on a line: its launcher, after a line start or a shell separator.
_LAUNCHER = re.compile(
    r"(?:^|(?<=[\s;&|(`'\"]))(?P<name>torchrun|python3?\s+-m\s+torch\.distributed\.(?:run|launch)"
    r"|accelerate\s+launch|python3?\s+-m\s+accelerate\.commands\.launch|deepspeed|mpirun|mpiexec|horovodrun|srun)"
    r"(?=\s|$)")
# Each launcher's process-count options.
_COUNT_OPTIONS: dict[str, tuple[str, ...]] = {
    "torchrun": ("--nproc_per_node", "--nproc-per-node"),
    "accelerate": ("--num_processes", "--num-processes"),
    "deepspeed": ("--num_gpus", "--num-gpus"),
    "mpirun": ("-np", "-n", "--np", "-c", "--n"),
    "horovodrun": ("-np", "--num-proc"),
    "srun": ("-n", "--ntasks"),
}
# Options that make the count come from elsewhere (hosts, slots, layouts): the count is unknown.
_OTHER_LAYOUT = ("--include", "-i", "--hostfile", "-H", "--hosts", "-npernode", "--npernode", "--map-by",
                 "-N", "--nodes", "--ntasks-per-node", "--ntasks-per-gpu", "-npersocket", "--ntasks-per-socket")
# A program's own GPU-count option (PyTorch Lightning's --devices, many scripts' --gpus).
_PROGRAM_COUNT = re.compile(r"(?:^|\s)(?:--devices|--gpus|--num[_-]gpus|--n[_-]gpus|--nproc|--world[_-]size)(?:=|\s+)"
                            r"(?P<v>\S+)")
# What follows the GPUs Slurm gives the job, in a count or in a variable a count reads: one of
# _GPU_SOURCE, or $CUDA_VISIBLE_DEVICES with a counting word after it (_COUNTED after _CVD). Two
# searches, not one ``CUDA_VISIBLE_DEVICES.*(?:wc|...)``: that backtracks over the rest of the line
# at every mention, quadratic in a line that repeats it (a 242 KB line took 9 s).
_GPU_SOURCE = re.compile(r"\$\{?SLURM_GPUS_ON_NODE\b|nvidia-smi\s+(?:-L|--list-gpus)|torch\.cuda\.device_count\(\)"
                         r"|\$\{#CUDA_VISIBLE_DEVICES")
_CVD = re.compile(r"\$\{?CUDA_VISIBLE_DEVICES\b")
_COUNTED = re.compile(r"wc|tr|awk|#|len")
_ASSIGN = re.compile(r"^(?:export\s+)?(?P<var>[A-Za-z_]\w*)=(?P<val>.*)$")
_VAR = re.compile(r"^\$(?:\{(?P<a>\w+)(?::-(?P<d>[^}]*))?\}|(?P<b>\w+))$")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(?P<end>\w+)['\"]?")

FOLLOWS = 0  # a count that follows the GPUs Slurm gives (any count runs)


class LaunchNeed(NamedTuple):
    """The fewest GPUs the launch runs correctly on (None: only the requested count), and why."""

    min_gpus: int | None
    why: str


_KEEP = LaunchNeed(None, "the script does not show that it adapts to another GPU count; only the GPU type may change")


def _lines(script: str) -> list[str]:
    """Command lines, heredoc bodies (another file's text) and trailing comments left out."""
    out, end = [], None
    for line in command_lines(script):
        if end is not None:
            end = None if line == end else end
            continue
        if m := _HEREDOC.search(line):
            end = m.group("end")
        out.append(re.sub(r"(?:^|\s)#.*$", "", line).strip())
    return [ln for ln in out if ln]


def _reads_gpus(text: str) -> bool:
    """Whether TEXT counts the GPUs Slurm gives the job (linear time: see _GPU_SOURCE)."""
    if _GPU_SOURCE.search(text):
        return True
    mention = _CVD.search(text)
    return mention is not None and _COUNTED.search(text, mention.end()) is not None


def _value(text: str, variables: dict[str, int | None]) -> int | None:
    """A count as written: a number, FOLLOWS, or None (unknown); quotes and plain variables read."""
    text = text.strip("'\"")
    if text.isdigit():
        return int(text)
    if text in ("gpu", "auto") or _reads_gpus(text):
        return FOLLOWS
    m = _VAR.match(text)
    if m:
        name = m.group("a") or m.group("b")
        if name in variables:
            return variables[name]
        default = m.group("d")
        return int(default) if default and default.isdigit() and name == "SLURM_GPUS_ON_NODE" else None
    return None


def _options(kind: str, words: list[str]) -> list[str] | None:
    """The launcher's own words, the program and its arguments left out: a Python launcher's end at
    the script (``x.py``) or module (``-m mod``), srun's at the first word no option of its takes,
    an MPI launcher's at the first word that is not an option."""
    if kind in ("torchrun", "accelerate", "deepspeed"):
        for i, word in enumerate(words):
            if word.endswith(".py") or word in ("-m", "--module", "--no_python", "--no-python"):
                return words[:i]
        return None  # no program found: nothing can be read of its options
    out: list[str] = []
    for word in words:
        last = out[-1] if out else ""
        if not word.startswith("-") and not ("=" not in last and last and (
                last in _COUNT_OPTIONS[kind] or last in _OTHER_LAYOUT or kind == "srun" and _takes_value(last))):
            break  # not the value of the option before it: the program
        out.append(word)
    return out


def _takes_value(word: str) -> bool:
    """Whether srun's option ``word`` (sbatch's table: srun shares it) takes the next word as its value."""
    try:
        spec = lookup_long(word[2:]) if word.startswith("--") else BY_SHORT.get(word[-1:]) if len(word) == 2 else None
    except OptionError:
        return False
    return spec is not None and spec.arg is Arg.REQUIRED


def _launch_count(kind: str, rest: str, variables: dict[str, int | None]) -> tuple[int | None, str] | None:
    """The count a launcher's own options give (value, as written); None where it has none of its
    own (srun without -n, deepspeed without --num_gpus); (None, ...) where it cannot be known."""
    words = _options(kind, shell_words(rest, posix=False))
    if words is None:
        return None, ""
    names = _COUNT_OPTIONS[kind]
    for i, word in enumerate(words):
        name, eq, attached = word.partition("=")
        if name in _OTHER_LAYOUT:
            return None, word
        short = next((n for n in names if len(n) == 2 and word.startswith(n) and word[2:].isdigit()), None)
        if short:  # -n4
            return int(word[2:]), word
        if name in names:
            raw = attached if eq else (words[i + 1] if i + 1 < len(words) else "")
            return _value(raw, variables), f"{name} {raw}" if not eq else word
    return None


def _kind(name: str) -> str:
    return "torchrun" if "torch" in name else "accelerate" if "accelerate" in name else name


def _read(line: str, variables: dict[str, int | None], per_task: bool) -> tuple[str, int, str]:
    """One command line's launch: ("none"|"fixed"|"follows"|"tasks"|"unknown", count, as written);
    "tasks": srun starting the job's tasks, each on its share of GPUs per task."""
    launches = list(_LAUNCHER.finditer(line))
    program = _PROGRAM_COUNT.search(line) if not launches and re.match(r"(?:\S*/)?python3?\s", line) else None
    if not launches and program is None:
        return "none", 0, ""
    if line.endswith("&"):
        return "unknown", 0, ""  # launches side by side: their counts add up in ways not read here
    if program is not None:
        got: tuple[int | None, str] | None = (_value(program.group("v"), variables), " ".join(program.group(0).split()))
    else:
        kind = _kind(launches[-1].group("name"))
        got = _launch_count(kind, line[launches[-1].end():], variables)
        if len(launches) > 1:
            # a launcher under srun: tasks times its count; only one that adapts, under srun per task
            outer = _launch_count("srun", line[launches[0].end():launches[-1].start()], variables) \
                if launches[0].group("name") == "srun" else (None, "")
            adapts = got is not None and got[0] == FOLLOWS and outer is None and per_task
            return ("follows", 0, "") if adapts else ("unknown", 0, "")
        if got is None:
            if kind == "torchrun":
                got = (1, "torchrun")  # its default: one process per node
            elif kind == "deepspeed":
                got = (FOLLOWS, "deepspeed")  # every GPU it is given
            elif kind == "srun" and per_task and not re.search(r"devices|gpus|nproc|num_processes|world_size",
                                                                line[launches[0].end():]):
                return "tasks", 0, ""  # each task on its share, unless its program counts GPUs of its own
            else:
                return "unknown", 0, ""  # mpirun's slots, accelerate's config file: not the GPU count
        elif kind in ("srun", "mpirun", "mpiexec", "horovodrun"):
            got = (got[0], f"{kind} {got[1]}")
    assert got is not None
    n, written = got
    if n is None:
        return "unknown", 0, ""
    return ("follows", 0, "") if n == FOLLOWS else ("fixed", n, written)


def launch_need(script: str, per_task: bool = False) -> LaunchNeed:
    """What the script's launch needs of the GPU count.

    ``per_task``: the GPUs are asked per task (``--gpus-per-task``), so a changed count keeps the
    task count and changes each task's share; ``srun`` without a task count of its own then starts
    the same tasks, each on its new share."""
    variables: dict[str, int | None] = {}
    found: dict[str, list[tuple[int, str]]] = {}
    for line in _lines(script):
        if (m := _ASSIGN.match(line)) and not _LAUNCHER.search(line):
            value = m.group("val").strip().strip("'\"")
            variables[m.group("var")] = int(value) if value.isdigit() else \
                FOLLOWS if _reads_gpus(value) else None
            continue
        what, n, written = _read(line, variables, per_task)
        found.setdefault(what, []).append((n, written))
    if "unknown" in found:
        return _KEEP
    if "fixed" in found:
        n, written = max(found["fixed"])
        return LaunchNeed(n, f"the script starts {n} processes ({written}): at least {n} GPUs")
    if "follows" in found:
        return LaunchNeed(1, "the script reads the GPUs Slurm gives it")
    if "tasks" in found:
        return LaunchNeed(1, "srun starts the job's tasks, each on its GPUs per task")
    return _KEEP


def request_launch_need(request: JobRequest) -> LaunchNeed:
    """``launch_need`` of a job's script (none: nothing shows it adapts), its GPUs asked per task or not."""
    gpus = request.main.gpus
    return launch_need(request.script.text if request.script else "", per_task=bool(gpus) and gpus[0].per == "task")
