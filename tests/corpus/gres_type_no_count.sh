#!/bin/bash
#SBATCH --gres=gpu:a100
#SBATCH --time=00:10:00
nvidia-smi
