#!/bin/bash
#SBATCH --array=1-10%2
#SBATCH --partition=gpu
#SBATCH --gres=gpu:t4:1
#SBATCH -o logs/%A_%a.out
python sweep.py --seed "$SLURM_ARRAY_TASK_ID"
