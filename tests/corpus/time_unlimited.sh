#!/bin/bash
#SBATCH --partition=long
#SBATCH --time=UNLIMITED
#SBATCH --gres=gpu:1
python serve.py
