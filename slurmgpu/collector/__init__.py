"""The NVML collector (slurmgpu-monitor): device layer and per-job records."""
