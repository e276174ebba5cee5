#!/bin/bash
#SBATCH --gpus-per-node=2
#SBATCH --gres=nvme:1
#SBATCH --time=01:00:00
python train.py
