#!/bin/bash
#SBATCH --job-name=bert-finetune
#SBATCH --partition=gpu-small        # asks for the small partition...
#SBATCH --gres=gpu:a100:1            # ...but for a card only `gpu` has
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=04:00:00
module load cuda/12.1
python finetune.py --model bert-base-uncased --batch-size 32 --fp16
