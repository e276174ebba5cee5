#!/bin/bash
#SBATCH --job-name=hetjob-demo
#SBATCH --partition=gpu
#SBATCH --gres=gpu:2
#SBATCH --time=00:30:00
srun python demo.py
