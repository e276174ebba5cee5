#!/bin/bash
#SBATCH --cpus=8
#SBATCH --gres=gpu:1
python train.py
