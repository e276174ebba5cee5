#!/bin/bash
#SBATCH --gpus-per-node=four
python train.py
