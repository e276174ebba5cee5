#!/bin/bash
#SBATCH --job-name=lr-sweep
#SBATCH --array=0-9%2
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=02:00:00
#SBATCH --output=sweep_%A_%a.out

LRS=(1e-2 5e-3 1e-3 5e-4 1e-4 5e-5 1e-5 5e-6 1e-6 5e-7)
python train.py --lr ${LRS[$SLURM_ARRAY_TASK_ID]}
