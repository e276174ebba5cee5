#!/bin/bash
#SBATCH --gres=gpu:a100:2,gpu:v100:1
#SBATCH --time=00:30:00
python mixed.py
