#!/bin/bash
#SBATCH --partition=gpu --cpus-per-task=2 --time=02:00:00
#SBATCH hetjob --partition=gpu-small --gres=gpu:2
#SBATCH --nodes=1
srun hostname
