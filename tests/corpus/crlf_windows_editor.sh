#!/bin/bash
#SBATCH --gres=gpu:1
#SBATCH --time=01:00:00
python train.py
