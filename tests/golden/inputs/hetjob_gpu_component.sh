#!/bin/bash
#SBATCH --job-name=prep-train
#SBATCH -p gpu -c 4 --mem=8G
#SBATCH hetjob
#SBATCH -p gpu-small --gres=gpu:a100:1 -c 8
srun --het-group=0 python prep.py : --het-group=1 python train.py
