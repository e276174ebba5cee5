#!/bin/bash
#GSBATCH --no-rewrite
#SBATCH -p gpu-small
#SBATCH --gres=gpu:a100:1
python benchmark_a100_in_small.py
