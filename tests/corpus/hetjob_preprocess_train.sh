#!/bin/bash
#SBATCH --job-name=etl-then-train
#SBATCH --partition=cpu
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=128G
#SBATCH --time=06:00:00
#SBATCH hetjob   # ---- GPU component ----
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --gres=gpu:a100:4
#SBATCH --cpus-per-task=16
#SBATCH --mem=200G

srun --het-group=0 python preprocess.py --out /scratch/$USER/shards &
srun --het-group=1 torchrun --nproc_per_node=4 train.py --data /scratch/$USER/shards
wait
