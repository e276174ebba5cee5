#!/bin/bash
#SBATCH --job-name=run\#7\ final
#SBATCH --gres=gpu:1
python final.py
