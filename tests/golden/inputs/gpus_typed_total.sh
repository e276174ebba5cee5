#!/bin/bash
#SBATCH --partition gpu-small
#SBATCH --gpus a100:2
#SBATCH -t 12:00:00
torchrun --nproc_per_node=2 train.py
