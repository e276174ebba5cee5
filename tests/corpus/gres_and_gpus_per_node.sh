#!/bin/bash
#SBATCH --gres=gpu:2
#SBATCH --gpus-per-node=2
python train.py
