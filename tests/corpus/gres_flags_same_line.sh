#!/bin/bash
#SBATCH --gres=gpu:tesla_v100-sxm2-16gb:2 --gres-flags=enforce-binding
#SBATCH --time=02:00:00
python train.py
