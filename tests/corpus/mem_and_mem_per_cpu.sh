#!/bin/bash
#SBATCH --mem=32G
#SBATCH --mem-per-cpu=4G
#SBATCH --gres=gpu:1
python train.py
