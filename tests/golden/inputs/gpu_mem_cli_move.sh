#!/bin/bash
#SBATCH -p gpu-small
#SBATCH --gres=gpu:2
#SBATCH -t 2:00:00
srun python train.py --batch-size 16
