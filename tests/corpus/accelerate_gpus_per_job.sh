#!/bin/bash
#SBATCH --job-name=accel-sdxl
#SBATCH --gpus=4
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --mem-per-gpu=40G
#SBATCH --time=08:00:00
#SBATCH --partition=gpu
#SBATCH --qos=normal

accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 train_sdxl.py
