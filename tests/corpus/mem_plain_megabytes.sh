#!/bin/bash
#SBATCH --mem=8000
#SBATCH --gres=gpu:1
python train.py
