#!/bin/bash
#SBATCH --mem=1T
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
python train.py
