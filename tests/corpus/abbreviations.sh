#!/bin/bash
#SBATCH --part=gpu
#SBATCH --acco=ml-lab
#SBATCH --job-n=abbrev-test
#SBATCH --gpus-per-n=2
#SBATCH --cpus-per-t=6
#SBATCH --ntasks-per-n=2
#SBATCH --mem-per-c=3G
#SBATCH --time=00:45:00
srun python train.py
