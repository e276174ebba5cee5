#!/bin/bash
#SBATCH -N2 -n8 -c4
#SBATCH -G8
#SBATCH -t2-12
#SBATCH -Jshort-opts
#SBATCH -Aproj42
#SBATCH -pgpu
srun ./app
