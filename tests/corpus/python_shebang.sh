#!/usr/bin/env python3
#SBATCH --job-name=py-batch
#SBATCH --gpus-per-node=1
#SBATCH --time=00:20:00
"""A Slurm batch job written directly in Python."""
import os
import torch

print(os.environ.get("SLURM_JOB_ID"), torch.cuda.device_count())
