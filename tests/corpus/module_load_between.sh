#!/bin/bash
#SBATCH --partition=gpu
#SBATCH --time=3:00:00
module load cuda/11.8
#SBATCH --gres=gpu:a100:2
#SBATCH --mem=64G
source ~/miniconda3/etc/profile.d/conda.sh
conda activate env
python x.py
