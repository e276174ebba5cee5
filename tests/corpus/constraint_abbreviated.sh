#!/bin/bash
#SBATCH --cons=l40s
#SBATCH --gpus-per-node=2
#SBATCH --time=3:00:00
python render.py
