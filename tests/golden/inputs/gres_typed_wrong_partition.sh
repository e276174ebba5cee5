#!/bin/bash
#SBATCH --job-name=vit-train
#SBATCH -p gpu-small
#SBATCH --gres=gpu:v100:2
#SBATCH --time=08:00:00
srun python train_vit.py --batch-size 128
