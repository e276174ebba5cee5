#!/bin/bash
#SBATCH --job-name="BERT large #3 (fine-tune)"
#SBATCH --gres=gpu:2   # two GPUs, see wiki #42
#SBATCH --comment='owner: J. Doe # team NLP'
#SBATCH --time=1:30:00#no space before this comment
python run_glue.py
