#!/bin/bash
#SBATCH -p gpu-small
#SBATCH --nodes=1 --gpus-per-node=t4:6
srun python eval.py
