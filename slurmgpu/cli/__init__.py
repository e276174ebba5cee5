"""The slurmgpu click commands, one module per command group."""
