#!/bin/bash
#SBATCH --job-name=commented
#SBATCH --partition=gpu
##SBATCH --gres=gpu:4
#SBATCH --gres=gpu:1
# SBATCH --time=48:00:00
#sbatch --mem=500G
  #SBATCH --nodes=8
#SBATCH --time=01:00:00
#SBATCH --mem=20G

python run.py
