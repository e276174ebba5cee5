#!/bin/bash
set -euo pipefail
#SBATCH --job-name=strict
#SBATCH --gres=gpu:2
#SBATCH --time=04:00:00
#SBATCH --partition=gpu

python train.py
