#!/bin/bash
#SBATCH --time=01:00:00 --partition=cpu -n 1 -c 4
#SBATCH packjob
#SBATCH --partition=gpu -N 2 --gpus-per-node=v100:2
#SBATCH packjob
#SBATCH --partition=gpu --gres=gpu:a100:1 -n 1

srun --pack-group=0 ./param_server : --pack-group=1 ./worker : --pack-group=2 ./evaluator
