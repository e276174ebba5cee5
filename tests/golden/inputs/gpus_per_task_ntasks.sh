#!/bin/bash
#SBATCH -n 2
#SBATCH --gpus-per-task=a100:1
#SBATCH -p gpu-small
srun python ddp.py
