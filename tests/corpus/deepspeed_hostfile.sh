#!/bin/bash
#SBATCH --job-name=ds-zero3
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:v100:8
#SBATCH --cpus-per-task=40
#SBATCH --mem=350G
#SBATCH --time=12:00:00
#SBATCH --partition=v100

# DeepSpeed wants a hostfile with slots=<gpus per node>
scontrol show hostnames $SLURM_JOB_NODELIST | sed 's/$/ slots=8/' > hostfile
deepspeed --hostfile hostfile --num_gpus 8 train.py --deepspeed ds_config.json
