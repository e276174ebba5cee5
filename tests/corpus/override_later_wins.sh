#!/bin/bash
#SBATCH --gres=gpu:1
#SBATCH --time=01:00:00
#SBATCH --partition=gpu-small
# on second thought:
#SBATCH --gres=gpu:v100:2   # two V100s after all
#SBATCH --time=02:00:00
#SBATCH --partition=gpu
python train.py
