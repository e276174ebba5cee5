#!/bin/bash

# ---------------------------------------------
#  Job: vit-b16   Owner: ml-team
# ---------------------------------------------

#SBATCH --job-name=vit-b16

#SBATCH --gres=gpu:a40:2
    # indented comment, still a comment
#SBATCH --time=08:00:00

python train_vit.py
