#!/bin/bash
#SBATCH -p gpu-small
#SBATCH --gres=gpu:v100:1
#SLURMGPU keep
python legacy.py
