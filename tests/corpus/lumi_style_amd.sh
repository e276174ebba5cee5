#!/bin/bash -l
#SBATCH --job-name=mi250x-bench   # Job name
#SBATCH --output=bench.o%j        # Name of stdout output file
#SBATCH --partition=standard-g    # partition name
#SBATCH --nodes=4                 # Total number of nodes
#SBATCH --ntasks-per-node=8       # 8 MPI ranks per node, 16 total (2x8)
#SBATCH --gpus-per-node=8         # Allocate one gpu per MPI rank
#SBATCH --time=1-12:00:00         # Run time (d-hh:mm:ss)
#SBATCH --account=project_465000123

srun --cpu-bind=${CPU_BIND} ./select_gpu ./my_app
