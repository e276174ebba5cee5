#!/bin/bash
#SBATCH --job-name=mig-notebook
#SBATCH --gres=gpu:1g.10gb:1
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=02:00:00
jupyter lab --no-browser --port=8888
