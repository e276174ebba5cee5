#!/bin/bash
#SBATCH --job-name=llama-lora
#SBATCH --gres=gpu:2
#SBATCH --constraint=a100            # picks A100 nodes, but not A100 GPUs on a mixed node
#SBATCH --ntasks-per-node=1 --cpus-per-task=16
#SBATCH --time=1-00:00:00
torchrun --nproc_per_node=2 finetune_lora.py --model meta-llama/Llama-2-7b-hf --bf16 --gradient-checkpointing
