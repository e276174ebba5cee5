#!/bin/bash
#SBATCH --gres=gpu:a100:1
python train.py
