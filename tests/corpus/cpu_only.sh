#!/bin/bash
#SBATCH --job-name=tokenize
#SBATCH --partition=cpu
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=1-00:00:00
python tokenize_corpus.py --workers 64
