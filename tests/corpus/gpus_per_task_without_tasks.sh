#!/bin/bash
#SBATCH --gpus-per-task=1
#SBATCH --time=01:00:00
srun python worker.py
