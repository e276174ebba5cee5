#!/bin/bash
#SBATCH --time=7-00:00
#SBATCH --gpus-per-node=1
python long_run.py
