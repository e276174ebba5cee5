#!/bin/bash
# Trainingslauf für das Übersetzungsmodell — 训练翻译模型
#SBATCH --job-name=Überprüfung-模型
#SBATCH --gres=gpu:a100:1       # eine GPU / 一块GPU
#SBATCH --comment="naïve café ☕"
#SBATCH --time=03:00:00
echo "Start: $(date)  ✓"
python übersetzen.py
