#!/bin/bash
#SBATCH	--partition=gpu		# the GPU queue
#SBATCH	-N	1
#SBATCH --gres=gpu:v100:1	# one V100
#SBATCH	--time=00:30:00

	python train.py
