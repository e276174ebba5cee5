#!/bin/bash
#SBATCH -N 4
#SBATCH --ntasks-per-node=128
#SBATCH --mem-per-cpu=1G
#SBATCH -t 12:00:00
srun ./wrf.exe
