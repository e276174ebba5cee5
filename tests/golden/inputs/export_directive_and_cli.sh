#!/bin/bash
#SBATCH --export=NONE
#SBATCH -p gpu-small
#SBATCH --gres=gpu:v100:1
python train.py --lr "$LR"
