"""How few GPUs a job's launch can run on.

``torchrun --nproc_per_node=4`` on one GPU starts four processes on one card; ``srun -n 8`` with a
GPU per task needs eight GPUs. A launcher count written as a number is the fewest GPUs the job can
be given (more are consistent, if wasted: ``--nproc_per_node=2`` under ``--gres=gpu:8`` uses two).
A script that takes its process count from what Slurm gives it (``$SLURM_GPUS_ON_NODE``,
``CUDA_VISIBLE_DEVICES``, ``torch.cuda.device_count()``, ``--nproc_per_node=gpu``) can run on any
count. Anything else keeps its count; only the GPU type may change (unless the family's own runs
showed GPUs it left idle: the decider's evidence, not the script's, ``ModelDecider._busy``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from slurmgpu.pipeline.features import command_lines

if TYPE_CHECKING:
    from slurmgpu.pipeline.request import JobRequest

# A launcher's process count written as a number (not a variable): group "n" is the count.
_FIXED_COUNT = re.compile(
    r"(?:--nproc[_-]per[_-]node|--num[_-]processes|--num[_-]gpus|--nproc|--gpus|--devices)[= ]+(?P<n>\d+)\b"
    r"|(?:^|\s)(?:mpirun|mpiexec|horovodrun)\s.*?-(?:np|n)\s+(?P<m>\d+)\b"
    r"|(?:^|\s)srun\s.*?(?:-n\s*|--ntasks[= ])(?P<s>\d+)\b"
    r"|(?:^|\s)(?:python3?|torchrun|accelerate|deepspeed)\s.*?--(?:world[_-]size|n[_-]gpus?)[= ]+(?P<w>\d+)\b",
    re.MULTILINE)
# Ways a script reads the GPUs Slurm gave it.
_ADAPTS = re.compile(
    r"\$\{?(?:SLURM_GPUS_ON_NODE|SLURM_GPUS|SLURM_GPUS_PER_NODE|SLURM_JOB_GPUS|SLURM_STEP_GPUS|"
    r"CUDA_VISIBLE_DEVICES|SLURM_NTASKS|SLURM_NPROCS)\b"
    r"|torch\.cuda\.device_count\(\)|nvidia-smi\s+(?:-L|--list-gpus)"
    r"|--nproc[_-]per[_-]node[= ]+(?:gpu|auto)\b")
_SRUN = re.compile(r"(?:^|[\s;&|(])srun\s")


class LaunchNeed(NamedTuple):
    """The fewest GPUs the launch runs correctly on (None: only the requested count), and why."""

    min_gpus: int | None
    why: str


def launch_need(script: str, per_task: bool = False) -> LaunchNeed:
    """What the script's launch needs of the GPU count.

    ``per_task``: the GPUs are asked per task (``--gpus-per-task``), so a changed count keeps the
    task count and changes each task's share; ``srun`` without a task count of its own then starts
    the same tasks, each on its new share."""
    commands = "\n".join(command_lines(script))
    fixed = [(int(next(g for g in m.groups() if g)), " ".join(m.group(0).split()))
             for m in _FIXED_COUNT.finditer(commands)]
    if fixed:
        n, written = max(fixed)
        return LaunchNeed(n, f"the script starts {n} processes ({written}): at least {n} GPUs")
    if _ADAPTS.search(commands):
        return LaunchNeed(1, "the script reads the GPUs Slurm gives it")
    if per_task and _SRUN.search(commands):
        return LaunchNeed(1, "srun starts the job's tasks, each on its GPUs per task")
    return LaunchNeed(None, "the script does not show that it adapts to another GPU count; only the GPU type "
                            "may change")


def request_launch_need(request: JobRequest) -> LaunchNeed:
    """``launch_need`` of a job's script (none: nothing shows it adapts), its GPUs asked per task or not."""
    gpus = request.main.gpus
    return launch_need(request.script.text if request.script else "", per_task=bool(gpus) and gpus[0].per == "task")
