#!/bin/bash
#SBATCH --gpus=1
#SBATCH --constraint=v100
python bench.py
