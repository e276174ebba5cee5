#!/bin/bash
#SBATCH--gres=gpu:1
#SBATCH--time=00:15:00
python quick_test.py
