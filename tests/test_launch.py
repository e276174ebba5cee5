"""A GPU count changes only when the job's launch stays consistent with it."""

from __future__ import annotations

import pytest

from slurmgpu.pipeline.launch import launch_need

HEAD = "#!/bin/bash\n#SBATCH --gres=gpu:v100:4\n#SBATCH -t 8:00:00\n"


@pytest.mark.parametrize(("command", "n", "written"), [
    ("torchrun --nproc_per_node=4 train.py --arch resnet152", 4, "--nproc_per_node=4"),
    ("python -m torch.distributed.run --nproc-per-node 2 train.py", 2, "--nproc-per-node 2"),
    ("accelerate launch --num_processes 4 --mixed_precision bf16 sft.py", 4, "--num_processes 4"),
    ("deepspeed --num_gpus 3 train.py --deepspeed ds_zero2.json", 3, "--num_gpus 3"),
    ("srun -n 4 python train.py", 4, "srun -n 4"),
    ("mpirun -np 8 python train.py", 8, "mpirun -np 8"),
    ("python train.py --devices 4 --strategy ddp", 4, "--devices 4"),
])
def test_a_fixed_launcher_count_is_the_fewest_gpus(command: str, n: int, written: str) -> None:
    need = launch_need(HEAD + command + "\n")
    assert need.min_gpus == n and f"({written})" in need.why


@pytest.mark.parametrize("command", [
    "torchrun --nproc_per_node=$SLURM_GPUS_ON_NODE train.py",
    "torchrun --nproc_per_node=gpu train.py",
    'NGPU=$(nvidia-smi -L | wc -l)\ntorchrun --nproc_per_node="$NGPU" train.py',
    'python -c "import torch; print(torch.cuda.device_count())"\npython train.py',
    "srun --ntasks=${SLURM_GPUS} python train.py",
    'echo "$CUDA_VISIBLE_DEVICES"\npython train.py',
])
def test_scripts_that_read_their_gpus_may_change_count(command: str) -> None:
    assert launch_need(HEAD + command + "\n") == (1, "the script reads the GPUs Slurm gives it")


def test_a_plain_script_keeps_its_count() -> None:
    need = launch_need(HEAD + "python train.py --batch-size 64\n")
    assert need.min_gpus is None and "does not show that it adapts" in need.why


def test_comments_and_directives_do_not_count() -> None:
    script = HEAD + "# torchrun --nproc_per_node=8 was too many\n#SBATCH --ntasks=4\n" \
        "torchrun --nproc_per_node=gpu t.py\n"
    assert launch_need(script).min_gpus == 1


def test_srun_follows_a_per_task_count_but_not_a_per_node_one() -> None:
    script = HEAD + "srun python train.py\n"
    assert launch_need(script, per_task=True) == (1, "srun starts the job's tasks, each on its GPUs per task")
    assert launch_need(script, per_task=False).min_gpus is None  # 4 tasks per node on 2 GPUs would share cards
    assert launch_need(HEAD + "srun -n 4 python train.py\n", per_task=True).min_gpus == 4
