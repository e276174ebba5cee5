#!/bin/bash
#SBATCH -p gpu-small
#GSBATCH --no-rewrite   # this job measures an a100 in gpu-small on purpose
#SBATCH --gres=gpu:v100:1
#GSBATCH --gpu-mem=24G
python pinned.py
