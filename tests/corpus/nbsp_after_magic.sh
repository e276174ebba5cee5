#!/bin/bash
#SBATCH --gres=gpu:1
#SBATCH --time=00:10:00
python x.py
