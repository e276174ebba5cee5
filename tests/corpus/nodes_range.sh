#!/bin/bash
#SBATCH --nodes=2-4
#SBATCH --gpus-per-node=4
#SBATCH --time=08:00:00
#SBATCH --partition=gpu
srun python elastic_train.py
