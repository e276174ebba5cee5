#!/bin/bash
#SBATCH --gres=nvme:100,gpu:2
#SBATCH --time=04:00:00
python train.py
