"""The batch script a user would write for a synthetic job: ``#SBATCH`` directives and a launch line.

Scripts are what gsbatch and the learner read, so they carry the request in the forms users
really write (``--gres``, ``--gpus``, ``--gpus-per-node``, ``-G``) and a command line whose flags
(``--model``, ``--batch-size``, ``--seq-len``, ``--bf16``, ``--lora``, ``--gradient-checkpointing``,
``--nproc_per_node``) say what the program does. Environment set-up lines are cosmetic.
"""

from __future__ import annotations

from typing import NamedTuple

from slurmgpu.simulation.workload.catalog import Catalog
from slurmgpu.simulation.workload.jobs import JobSpec
from slurmgpu.slurm.sacct import format_duration


class ScriptStyle(NamedTuple):
    """One user's way of writing scripts, kept across their jobs (the flags are cosmetic, drawn evenly)."""

    gpu_option: str  # gres | gpus | gpus-per-node | G
    conda: bool  # `conda activate` rather than a venv
    explicit_partition: bool  # writes --partition even for the default partition
    explicit_account: bool


def _gpu_directive(option: str, gres: str, count: int) -> str:
    if option == "gres":
        return f"--gres=gpu:{gres}:{count}"
    if option == "G":
        return f"-G {gres}:{count}"
    return f"--{option}={gres}:{count}"


def _launch(job: JobSpec, entry: str) -> str:
    p = job.params
    n = p["nproc"]
    launcher = p["launcher"]
    if launcher == "deepspeed":
        return f"deepspeed --num_gpus={n} {entry}"
    if launcher == "torchrun":
        return f"torchrun --nproc_per_node={n} {entry}"
    if launcher == "accelerate":
        return f"accelerate launch --num_processes={n} {entry}"
    if launcher == "srun":
        return f"srun python {entry}"
    return f"python {entry}"


def _program_flags(job: JobSpec, cat: Catalog, lrs: tuple[float, ...] | None) -> list[str]:
    p = job.params
    fam = cat.families[job.family]
    flags = [f"--model {cat.models[p['model']].cli_name}", f"--dataset {fam.dataset}",
             f"--batch-size {p['batch_size']}"]
    if "seq_len" in p:
        flags.append(f"--seq-len {p['seq_len']}")
    if "image_size" in p:
        flags.append(f"--image-size {p['image_size']}")
    if p["precision"] != "fp32":
        flags.append(f"--{p['precision']}")
    if p.get("lora"):
        flags.append(f"--lora --lora-r {p['lora_r']}")
    if p.get("grad_ckpt"):
        flags.append("--gradient-checkpointing")
    if fam.mode == "generate":
        flags.append(f"--max-new-tokens {p['gen_tokens']}")
    flags.append(f"--max-steps {p['steps']}" if fam.mode == "train" else f"--num-batches {p['steps']}")
    if fam.mode == "train":
        flags.append('--lr "${LRS[$SLURM_ARRAY_TASK_ID]}" --seed "$SLURM_ARRAY_TASK_ID"' if lrs
                     else f"--lr {p['lr']:g}")
    if p.get("zero"):
        flags.append(f"--deepspeed ds_zero{p['zero']}.json")
    return flags


def render(job: JobSpec, gres: str, style: ScriptStyle, default_partition: str, cat: Catalog,
           lrs: tuple[float, ...] | None = None) -> str:
    """The script text for ``job``; ``lrs``: an array's learning rates, indexed by task id."""
    fam = cat.families[job.family]
    ntasks = job.params["nproc"] if job.params["launcher"] == "srun" else 1
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job.job_name}"]
    if style.explicit_account:
        lines.append(f"#SBATCH --account={job.account}")
    if style.explicit_partition or job.partition != default_partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    lines.append(f"#SBATCH {_gpu_directive(style.gpu_option, gres, job.req_gpus)}")
    if ntasks > 1:
        lines.append(f"#SBATCH --ntasks-per-node={ntasks}")
    lines += [f"#SBATCH --cpus-per-task={job.cpus // ntasks}",
              f"#SBATCH --mem={job.mem_mb // 1024}G",
              f"#SBATCH --time={format_duration(job.time_limit_s)}"]
    if job.array:
        lines += [f"#SBATCH --array={job.array}", "#SBATCH --output=logs/%x-%A_%a.out"]
    else:
        lines.append("#SBATCH --output=logs/%x-%j.out")
    lines += ["", "module load cuda/12.1",
              f"conda activate {fam.account}" if style.conda else f"source ~/venvs/{fam.account}/bin/activate"]
    if lrs:
        lines.append(f"LRS=({' '.join(f'{lr:g}' for lr in lrs)})")
    lines.append(" ".join([_launch(job, fam.entry), *_program_flags(job, cat, lrs)]))
    return "\n".join(lines) + "\n"
