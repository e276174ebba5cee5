#!/bin/bash
#SBATCH --job-name=serve-and-train
#SBATCH --partition=cpu
#SBATCH --account=nlp-lab
#SBATCH --time=04:00:00
#SBATCH --mem=32G
#SBATCH --constraint=a100
#SBATCH --gres=gpu:1
#SBATCH hetjob
#SBATCH --gres=gpu:2
srun --het-group=0 ./server : --het-group=1 ./trainer
