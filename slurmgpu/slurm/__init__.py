"""Slurm backends (command line, pyslurm) and parsers of Slurm's output."""
