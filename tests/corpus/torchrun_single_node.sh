#!/bin/bash -l
#SBATCH -J llama-ft
#SBATCH -p gpu
#SBATCH -N 1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=a100:4
#SBATCH -c 32
#SBATCH --mem=256G
#SBATCH -t 1-00:00:00
#SBATCH -A proj-ml

set -euo pipefail
export OMP_NUM_THREADS=8
conda activate llm
torchrun --standalone --nproc_per_node=4 finetune.py --config configs/llama7b.yaml
