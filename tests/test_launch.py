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
    "srun --ntasks=$SLURM_GPUS_ON_NODE python train.py",
    "torchrun --nproc_per_node=${SLURM_GPUS_ON_NODE:-4} train.py",
    "deepspeed train.py --deepspeed ds.json",  # every GPU it is given
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


# Found by probing the decider with real launch lines: each once let the count fall below what the
# launch starts (a number elsewhere in the script, a variable merely mentioned, a program's own -n).
@pytest.mark.parametrize(("command", "per_task", "n"), [
    ("NGPUS=4\ntorchrun --nproc_per_node=$NGPUS train.py\nsrun -n 1 nvidia-smi", False, 4),  # a plain N=4 is read
    ("torchrun --nproc_per_node=$N train.py\nsrun -n 1 nvidia-smi", False, None),  # N unknown: not outvoted
    ("accelerate launch --num_processes 1 prep.py\ntorchrun --nproc_per_node=$NGPUS train.py", False, None),
    ('NGPUS=4\necho "GPUs: $CUDA_VISIBLE_DEVICES"\ntorchrun --nproc_per_node=$NGPUS train.py', False, 4),
    ('echo "$CUDA_VISIBLE_DEVICES"\npython train.py', False, None),  # mentioned, not a count
    ('[ -n "$SLURM_JOB_GPUS" ] || exit 1\npython train.py', False, None),
    ("python -c 'import torch; assert torch.cuda.device_count() == 4'\npython train.py", False, None),
    ("srun python train.py --exp-name bs256-n1", False, None),  # the program's words, not srun's
    ("srun python generate.py -n 1 --model big.pt", False, None),
    ("srun python generate.py -n 1 --model big.pt", True, 1),
    ('echo "world=$SLURM_NTASKS"\nsrun python train.py', False, None),  # tasks do not follow the GPUs
    ("mpirun -np $SLURM_NTASKS python train.py", False, None),
    ("CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=2 a.py &\n"
     "CUDA_VISIBLE_DEVICES=2,3 torchrun --nproc_per_node=2 b.py &\nwait", False, None),  # side by side
    ("srun torchrun --nproc_per_node=2 train.py", True, None),  # tasks times two
    ("srun torchrun --nproc_per_node=gpu train.py", True, 1),
    ("srun deepspeed --include localhost:0,1,2,3 train.py", True, None),
    ("srun python train.py --trainer.devices=4", True, None),
    ("python train.py --gpus 2,3", False, None),  # GPU ids, not a count
    ('torchrun --nproc_per_node "4" train.py', False, 4),
    ("torchrun --nproc_per_node=${NPROC:-4} train.py", False, None),
    ("cat > run.sh <<EOF\ntorchrun --nproc_per_node=8 x.py\nEOF\nbash run.sh", False, None),  # another file's text
    ("torchrun --nproc_per_node=4 train.py  # N = len($CUDA_VISIBLE_DEVICES)", False, 4),
    ("torchrun --nnodes 1 --nproc_per_node 4 train.py", False, 4),  # a value before the count
    ("deepspeed --master_port 29500 --num_gpus 2 train.py", False, 2),
    ("torchrun train.py", False, 1),  # torchrun's default: one process
    ("accelerate launch train.py", False, None),  # its config file's count
    ("mpirun --bind-to core -np 4 python x.py", False, None),
    ("srun --mpi=pmix -p gpu -n 8 python train.py", False, 8),
    ("torchrun --nproc_per_node=4 -m mypkg.train --lr 1", False, 4),
])
def test_each_launch_is_read_from_its_own_options(command: str, per_task: bool, n: int | None) -> None:
    assert launch_need(HEAD + command + "\n", per_task=per_task).min_gpus == n
