"""A GPU count changes only when the job's launch stays consistent with it."""

from __future__ import annotations

import pytest

from slurmgpu.pipeline.launch import count_may_change, fixed_count

HEAD = "#!/bin/bash\n#SBATCH --gres=gpu:v100:4\n#SBATCH -t 8:00:00\n"


@pytest.mark.parametrize(("command", "fixed"), [
    ("torchrun --nproc_per_node=4 train.py --arch resnet152", "--nproc_per_node=4"),
    ("python -m torch.distributed.run --nproc-per-node 4 train.py", "--nproc-per-node 4"),
    ("accelerate launch --num_processes 4 --mixed_precision bf16 sft.py", "--num_processes 4"),
    ("deepspeed --num_gpus 4 train.py --deepspeed ds_zero2.json", "--num_gpus 4"),
    ("srun -n 4 python train.py", None),  # reported as the srun task count below
    ("mpirun -np 4 python train.py", None),
    ("python train.py --devices 4 --strategy ddp", "--devices 4"),
])
def test_fixed_launcher_counts_keep_the_count(command: str, fixed: str | None) -> None:
    script = HEAD + command + "\n"
    ok, why = count_may_change(script)
    assert not ok and "fixed number of processes" in why
    if fixed:
        assert fixed_count(script) == fixed


@pytest.mark.parametrize("command", [
    "torchrun --nproc_per_node=$SLURM_GPUS_ON_NODE train.py",
    "torchrun --nproc_per_node=gpu train.py",
    'NGPU=$(nvidia-smi -L | wc -l)\ntorchrun --nproc_per_node="$NGPU" train.py',
    'python -c "import torch; print(torch.cuda.device_count())"\npython train.py',
    "srun --ntasks=${SLURM_GPUS} python train.py",
    'echo "$CUDA_VISIBLE_DEVICES"\npython train.py',
])
def test_scripts_that_read_their_gpus_may_change_count(command: str) -> None:
    ok, why = count_may_change(HEAD + command + "\n")
    assert ok and why == "the script reads the GPUs Slurm gives it"


def test_a_plain_script_keeps_its_count() -> None:
    ok, why = count_may_change(HEAD + "python train.py --batch-size 64\n")
    assert not ok and "does not show that it adapts" in why


def test_comments_and_directives_do_not_count() -> None:
    script = HEAD + "# torchrun --nproc_per_node=8 was too many\n#SBATCH --ntasks=4\n" \
        "torchrun --nproc_per_node=gpu t.py\n"
    assert count_may_change(script)[0]


def test_srun_follows_a_per_task_count_but_not_a_per_node_one() -> None:
    script = HEAD + "srun python train.py\n"
    assert count_may_change(script, per_task=True) == (True, "srun starts the job's tasks, each on its GPUs per task")
    assert not count_may_change(script, per_task=False)[0]  # 4 tasks per node on 2 GPUs would share cards
    assert not count_may_change(HEAD + "srun -n 4 python train.py\n", per_task=True)[0]
