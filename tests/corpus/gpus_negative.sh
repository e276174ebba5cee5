#!/bin/bash
#SBATCH --partition=gpu
#SBATCH --gpus=-1
python train.py
