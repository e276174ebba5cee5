#!/bin/bash
#SBATCH --gres=gpu:1
#SBATCH --time=01:00:00

module load cuda
python train.py --pasted-from-windows
echo done
