#!/bin/bash
#SBATCH --gres=gpu:2
#SBATCH --constraint=a100
#SBATCH --time=05:00:00
#SBATCH --mem=64G
python train.py
