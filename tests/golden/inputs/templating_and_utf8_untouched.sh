#!/bin/bash
# Prüfung — résumé ✓ {{ not_a_template }} {% raw %}
#SBATCH --job-name="lr {{ lr }}"
#SBATCH --partition=gpu-small
#SBATCH --gres=gpu:a100:1
echo "{{ lr }} ünïcödé"
