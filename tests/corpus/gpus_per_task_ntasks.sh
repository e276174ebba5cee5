#!/bin/bash
#SBATCH --ntasks=4
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=10
#SBATCH --mem-per-cpu=4G
#SBATCH --time=10:00:00
srun python -m mpi4py ./md_sim.py
