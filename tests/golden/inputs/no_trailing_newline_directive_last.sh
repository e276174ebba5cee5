#!/bin/bash
#SBATCH --gres=gpu:a100:1
#SBATCH -p gpu-small