#!/bin/bash
#SBATCH -p gpu-small -G v100:1 -t 10
python eval.py
