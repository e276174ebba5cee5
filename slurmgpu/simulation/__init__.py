"""Workload model, cluster simulator, real-cluster replay and policy scenarios."""
