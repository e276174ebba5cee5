#!/bin/bash
#SBATCH --job-name=h100-node
#SBATCH --nodes=1
#SBATCH --gpus=h100:8
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=06:00:00

srun python train_ddp.py
