"""Whether a job still launches correctly with another GPU count.

``torchrun --nproc_per_node=4`` on one GPU starts four processes on one card; ``srun -n 8`` with
``--gpus-per-task=1`` needs eight GPUs. A count change is only safe when the script takes its
process count from what Slurm gives it (``$SLURM_GPUS_ON_NODE``, ``CUDA_VISIBLE_DEVICES``,
``torch.cuda.device_count()``, ``--nproc_per_node=gpu``) and writes no fixed count of its own.
Everything else keeps its count; only the GPU type may change.
"""

from __future__ import annotations

import re

# A launcher's process count written as a number (not a variable): the count the job was built for.
_FIXED_COUNT = re.compile(
    r"(?:--nproc[_-]per[_-]node|--num[_-]processes|--num[_-]gpus|--nproc|--gpus|--devices)[= ]+\d+\b"
    r"|(?:^|\s)(?:mpirun|mpiexec|horovodrun)\s.*?-(?:np|n)\s+\d+\b"
    r"|(?:^|\s)srun\s.*?(?:-n\s*|--ntasks[= ])\d+\b"
    r"|(?:^|\s)(?:python3?|torchrun|accelerate|deepspeed)\s.*?--(?:world[_-]size|n[_-]gpus?)[= ]+\d+\b")
# Ways a script reads the GPUs Slurm gave it.
_ADAPTS = re.compile(
    r"\$\{?(?:SLURM_GPUS_ON_NODE|SLURM_GPUS|SLURM_GPUS_PER_NODE|SLURM_JOB_GPUS|SLURM_STEP_GPUS|"
    r"CUDA_VISIBLE_DEVICES|SLURM_NTASKS|SLURM_NPROCS)\b"
    r"|torch\.cuda\.device_count\(\)|nvidia-smi\s+(?:-L|--list-gpus)"
    r"|--nproc[_-]per[_-]node[= ]+(?:gpu|auto)\b")


def _command_text(script: str) -> str:
    text = script.replace("\\\n", " ")
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))


def fixed_count(script: str) -> str | None:
    """The first launcher option that fixes a process count, as written (None when there is none)."""
    m = _FIXED_COUNT.search(_command_text(script))
    return " ".join(m.group(0).split()) if m else None


_SRUN = re.compile(r"(?:^|[\s;&|(])srun\s")


def count_may_change(script: str, per_task: bool = False) -> tuple[bool, str]:
    """(True, why) when the script adapts to the GPUs it gets; else (False, why).

    ``per_task``: the GPUs are asked per task (``--gpus-per-task``), so a changed count keeps the
    task count and changes each task's share; ``srun`` without a task count of its own then starts
    the same tasks, each on its new share."""
    commands = _command_text(script)
    fixed = fixed_count(script)
    if fixed:
        return False, f"the script launches a fixed number of processes ({fixed}); only the GPU type may change"
    if _ADAPTS.search(commands):
        return True, "the script reads the GPUs Slurm gives it"
    if per_task and _SRUN.search(commands):
        return True, "srun starts the job's tasks, each on its GPUs per task"
    return False, "the script does not show that it adapts to another GPU count; only the GPU type may change"
