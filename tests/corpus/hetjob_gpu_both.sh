#!/bin/bash
# Inference server on T4s + trainer on A100s, one heterogeneous job
#SBATCH --job-name=rl-actor-learner
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --gpus-per-node=t4:2
#SBATCH --time=12:00:00
#SBATCH hetjob
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --gpus=4
#SBATCH --constraint=a100

srun --het-group=0 python actor.py : --het-group=1 python learner.py
