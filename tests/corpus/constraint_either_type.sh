#!/bin/bash
#SBATCH --gres=gpu:1
#SBATCH -C "a100|v100"
#SBATCH --time=01:00:00
python infer.py
