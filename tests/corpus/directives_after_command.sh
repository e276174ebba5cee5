#!/bin/bash
#SBATCH --job-name=late
#SBATCH --partition=gpu
echo "starting at $(date)"
#SBATCH --gres=gpu:4
#SBATCH --time=10:00:00
python train.py
