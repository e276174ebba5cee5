#!/bin/bash
#SBATCH --job-name=lammps-kokkos
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=1
#SBATCH --gpu-bind=closest
#SBATCH --cpus-per-task=8
#SBATCH --time=0-06:30
#SBATCH --partition=gpu
#SBATCH --account=chem123

module load lammps/2Aug2023-kokkos-cuda
srun lmp -k on g 1 -sf kk -pk kokkos gpu/aware on -in in.lj
