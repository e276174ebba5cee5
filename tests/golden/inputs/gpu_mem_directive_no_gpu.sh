#!/bin/bash
#SBATCH -J embed
#GSBATCH --gpu-mem=40GB   # the embedding table
#SBATCH -t 30
python embed.py
