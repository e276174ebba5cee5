#!/bin/bash
#SBATCH --gres=gpu:a100:1
echo starting
#SBATCH -p gpu-small
#SBATCH --gres=gpu:t4:8
python train.py
