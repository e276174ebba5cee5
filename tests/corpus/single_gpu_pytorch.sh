#!/bin/bash
#SBATCH --job-name=resnet50-single
#SBATCH --partition=gpu
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out

module purge
module load cuda/12.1 cudnn/8.9
source activate pytorch
python train.py --arch resnet50 --epochs 90 --data /scratch/$USER/imagenet
