#!/bin/bash
#SBATCH --nodes=2
#SBATCH --sockets-per-node=2
#SBATCH --gpus-per-socket=2
#SBATCH --ntasks-per-socket=1
#SBATCH --time=03:00:00
srun ./gromacs_mdrun -nb gpu -pme gpu
