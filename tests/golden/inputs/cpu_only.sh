#!/bin/bash
#SBATCH -c 16 --mem=32G
#SBATCH -p gpu-small
make -j16
