#!/bin/bash
#SBATCH -p gpu
#SBATCH --gres=gpu:a100:1
python train.py
