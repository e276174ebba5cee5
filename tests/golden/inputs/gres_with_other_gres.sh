#!/bin/bash
#SBATCH --partition=gpu-small
#SBATCH --gres=gpu:a100:1,tmpdisk:100   # GPU plus local scratch
python train.py --data "$TMPDIR/data"
