#!/bin/bash
#SBATCH -N 2
#SBATCH --gpus-per-task=2
#SBATCH --time=1:00:00
# no --ntasks: Slurm runs one task per node
srun ./nbody -benchmark -numbodies=1048576
