#!/bin/bash
#SBATCH --nodes=1
#SBATCH --partition=gpu-small
#SBATCH --gpus-per-node=2
srun python eval.py
