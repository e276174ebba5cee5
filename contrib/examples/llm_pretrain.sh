#!/bin/bash
#SBATCH --job-name=gpt-pretrain
#SBATCH --nodes=1
#SBATCH --gpus-per-node=a100:8       # more than any node in `gpu` holds
#SBATCH --time=3-00:00:00
srun torchrun --nproc_per_node=8 pretrain.py --config gpt-1.3b.yaml --deepspeed ds_zero2.json
