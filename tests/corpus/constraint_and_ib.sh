#!/bin/bash
#SBATCH --nodes=2
#SBATCH --gpus-per-node=4
#SBATCH --constraint="a100&ib"
#SBATCH --time=12:00:00
srun python train.py
