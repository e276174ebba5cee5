#!/bin/bash
# tiny smoke test; Slurm rounds K up to whole MB
#SBATCH --mem=1000K
#SBATCH --time=1
hostname
