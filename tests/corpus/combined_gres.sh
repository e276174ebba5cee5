#!/bin/bash
#SBATCH --gres=gpu:a100:2,nvme:1
#SBATCH --time=04:00:00
#SBATCH --partition=gpu
python train.py --cache /local/nvme
