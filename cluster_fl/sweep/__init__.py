"""Launching: grid files, their expansion, submitit/SLURM submission, packed tasks, status."""
