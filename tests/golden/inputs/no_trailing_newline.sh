#!/bin/bash
#SBATCH -p gpu-small
#SBATCH --gres=gpu:a100:1
python train.py