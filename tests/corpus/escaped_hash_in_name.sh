#!/bin/bash
#SBATCH --job-name=run\#7
#SBATCH --comment="tuned\ by\ \"ops\""
#SBATCH --gres=gpu:1
#SBATCH --time=00:20:00
python final.py
