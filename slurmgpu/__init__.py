"""slurmgpu: put the right GPUs under every Slurm job."""

__version__ = "0.1.0"
