#!/bin/bash
#SBATCH -J resnet-sweep
#SBATCH --array=0-7%4
#SBATCH --gpus-per-node=v100:1
#SBATCH -c 4 --mem=16G -t 2:00:00
LRS=(0.1 0.05 0.02 0.01 0.005 0.002 0.001 0.0005)
python train_resnet.py --arch resnet50 --batch-size 256 --lr "${LRS[$SLURM_ARRAY_TASK_ID]}"
