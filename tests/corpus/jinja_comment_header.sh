#!/bin/bash
{# rendered by launcher.py; do not edit by hand #}
#SBATCH --gres=gpu:4
#SBATCH --partition=gpu
python train.py --epochs {{ epochs }}
