#!/bin/bash
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
python train.py
