#SBATCH --job-name=noshebang
#SBATCH --gres=gpu:1
python train.py
