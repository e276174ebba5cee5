#!/bin/bash
#SBATCH --job-name=driver
#SBATCH --time=00:05:00
#SBATCH --partition=debug

# generate and submit a follow-up job
cat > followup.sh <<'EOF'
#!/bin/bash
#SBATCH --gres=gpu:8
#SBATCH --time=2-00:00:00
python train.py
EOF
sbatch followup.sh
