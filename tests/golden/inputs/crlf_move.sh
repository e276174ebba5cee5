#!/bin/bash
#SBATCH -p gpu-small
#SBATCH --gres=gpu:v100:1
#SBATCH --time=01:00:00
python train.py
