#!/bin/bash
#SBATCH -p gpu-small -G t4:1 -t 30
python evaluate.py --checkpoint best.pt --batch-size 64
