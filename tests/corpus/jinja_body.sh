#!/bin/bash
#SBATCH --job-name={{job_name}}
#SBATCH --gres=gpu:2
#SBATCH --time=02:00:00

python train.py --lr {{ lr }} --batch-size {{ batch_size }} {% if fp16 %}--fp16{% endif %}
