#!/bin/bash
#SBATCH --gres=gpu:h100:1
python train.py
