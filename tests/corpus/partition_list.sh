#!/bin/bash
#SBATCH --partition=gpu,gpu-small
#SBATCH --gres=gpu:1
#SBATCH --time=00:30:00
python train.py
