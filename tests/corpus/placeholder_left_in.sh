#!/bin/bash
#SBATCH --job-name=template
#SBATCH --mail-user=<your email>
#SBATCH --gres=gpu:1
python train.py
