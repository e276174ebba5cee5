#!/bin/bash
#SBATCH -p debug
#SBATCH --gres=gpu:a100:1
python debug.py
