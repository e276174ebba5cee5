#!/bin/bash
#SBATCH --job-name="unterminated name
#SBATCH --gres=gpu:1
python train.py
