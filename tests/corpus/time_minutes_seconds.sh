#!/bin/bash
# NB: 12:00 is twelve MINUTES (MM:SS), not twelve hours
#SBATCH --time=12:00
#SBATCH --gres=gpu:1
python smoke.py
