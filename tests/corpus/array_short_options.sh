#!/bin/bash
#SBATCH -a 1-100:10
#SBATCH -G 1
#SBATCH -c4
#SBATCH -t 30
#SBATCH -pgpu-short
#SBATCH -o out/%a.log
python eval.py --seed $SLURM_ARRAY_TASK_ID
