"""A workload model for GPU clusters: what jobs need, how long they run, and who submits them.

Synthetic histories made with it go through the real ingest path (sacct text, collector spool
records, batch scripts), so demos and tests exercise the same code as production. The numbers,
each with its source or named assumption, are in ``data.toml`` in this package.
"""

from __future__ import annotations

from slurmgpu.simulation.workload.catalog import Catalog, Family, GpuSpec, ModelSpec, load_catalog
from slurmgpu.simulation.workload.cluster import (
    CLUSTERS,
    DEFAULT_CLUSTER,
    LARGE_CLUSTER,
    ClusterSpec,
    NodePool,
    PartitionSpec,
)
from slurmgpu.simulation.workload.emit import emit
from slurmgpu.simulation.workload.generate import generate
from slurmgpu.simulation.workload.jobs import JobSpec
from slurmgpu.simulation.workload.perf import fits, peak_mem_mib, run_model, runtime_s, used_gpus
from slurmgpu.simulation.workload.schedule import Outcome, Run, simulate

__all__ = [
    "CLUSTERS", "DEFAULT_CLUSTER", "LARGE_CLUSTER", "Catalog", "ClusterSpec", "Family", "GpuSpec", "JobSpec",
    "ModelSpec", "NodePool", "Outcome", "PartitionSpec", "Run", "emit", "fits", "generate", "load_catalog",
    "peak_mem_mib", "run_model", "runtime_s", "simulate", "used_gpus",
]
