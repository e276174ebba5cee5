#!/bin/bash
#SBATCH -A m1234_g
#SBATCH -C "gpu&hbm80g"
#SBATCH -q regular
#SBATCH -t 6:00:00
#SBATCH -N 2
#SBATCH --ntasks-per-node=4
#SBATCH -c 32
#SBATCH --gpus-per-task=1
#SBATCH --gpu-bind=none

export SLURM_CPU_BIND="cores"
srun ./vasp_std
