#!/bin/bash
#SBATCH --job-name=diffusion
#SBATCH --gres=gpu:rtx_3090:1
#SBATCH --cpus-per-task=6
#SBATCH --mem=24G
#SBATCH --time=18:00:00

# conda in a batch job
source "$(conda info --base)/etc/profile.d/conda.sh"
conda activate diffusers
python train_unet.py --resolution 512
