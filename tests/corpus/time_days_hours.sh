#!/bin/bash
#SBATCH -t 3-6
#SBATCH -G 1
python long_run.py
