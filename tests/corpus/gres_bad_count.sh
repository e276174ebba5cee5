#!/bin/bash
#SBATCH --job-name=bad-gres
#SBATCH --gres=gpu:a100:x
python train.py
