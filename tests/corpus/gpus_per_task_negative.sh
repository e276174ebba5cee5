#!/bin/bash
#SBATCH --ntasks=4
#SBATCH --gpus-per-task=-2
srun ./app
