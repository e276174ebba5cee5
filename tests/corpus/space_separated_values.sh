#!/bin/bash
#SBATCH --partition gpu
#SBATCH --gres gpu:2
#SBATCH --time 0:30:00
#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=4
#SBATCH -J "two word"
srun python train.py
