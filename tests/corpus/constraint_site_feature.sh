#!/bin/bash
# della-style: gpu80 = the 80 GB cards; not a GPU model name
#SBATCH --gres=gpu:1
#SBATCH --constraint=gpu80
#SBATCH --time=00:59:00
python big_model.py
