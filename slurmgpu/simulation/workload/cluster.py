"""The clusters synthetic workloads run on: partitions, their GPU nodes, and Slurm's names for them.

``DEFAULT_CLUSTER`` is the project's local test cluster as ``contrib/slurmgpu.toml`` describes it
(one node ``localhost`` with a100:4, v100:4 and t4:4; partitions ``gpu`` and ``gpu-small``);
``LARGE_CLUSTER`` is a heterogeneous site with every catalog GPU type, for simulation.
"""

from __future__ import annotations

from typing import NamedTuple

from slurmgpu.slurm.backend import NodeInfo


class NodePool(NamedTuple):
    """Identical nodes of one GPU type. Pools may share hosts (a node with several types), each
    with its own block of GPU indices starting at ``first_index``."""

    gpu_type: str  # catalog name, e.g. "A100-80"
    gres: str  # Slurm's type name (gres.conf Type=), e.g. "a100"
    hosts: tuple[str, ...]
    gpus_per_node: int
    first_index: int = 0


class PartitionSpec(NamedTuple):
    name: str
    pools: tuple[NodePool, ...]
    max_time_s: int
    default: bool = False


class ClusterSpec(NamedTuple):
    name: str  # ClusterName in slurm.conf
    partitions: tuple[PartitionSpec, ...]
    users: int
    jobs_per_day: float
    first_job_id: int = 1000
    extern_steps: bool = False  # PrologFlags=Contain: sacct lists an .extern step per job

    def gpu_types(self) -> list[str]:
        """Catalog names of the GPU types offered, in partition order."""
        return list(dict.fromkeys(pool.gpu_type for part in self.partitions for pool in part.pools))

    def gres_name(self, gpu_type: str) -> str:
        return self.pool(gpu_type).gres

    def pool(self, gpu_type: str, partition: str | None = None) -> NodePool:
        """The pool of ``gpu_type`` in ``partition`` (any partition when None)."""
        for part in self.partitions:
            if partition in (None, part.name):
                for pool in part.pools:
                    if pool.gpu_type == gpu_type:
                        return pool
        raise KeyError(f"cluster {self.name}: no {gpu_type} in {partition or 'any partition'}")

    def partition_for(self, gpu_type: str, preferred: str | None = None) -> PartitionSpec:
        """``preferred`` when it offers ``gpu_type``, else the first partition that does."""
        offering = [p for p in self.partitions if any(pool.gpu_type == gpu_type for pool in p.pools)]
        if not offering:
            raise KeyError(f"cluster {self.name}: no partition offers {gpu_type}")
        return next((p for p in offering if p.name == preferred), offering[0])

    def slurm_nodes(self) -> list[NodeInfo]:
        """The nodes as Slurm's backend lists them (name, partitions, GPUs per type): what the
        queue ledger (pipeline/queue.py) is built on, for the demo and the scenario as live."""
        hosts: dict[str, NodeInfo] = {}
        for part in self.partitions:
            for pool in part.pools:
                for host in pool.hosts:
                    node = hosts.get(host, NodeInfo(host, ()))
                    hosts[host] = node._replace(partitions=tuple(dict.fromkeys((*node.partitions, part.name))),
                                                gpus={**node.gpus, pool.gres: pool.gpus_per_node})
        return list(hosts.values())


_DAY = 86400

DEFAULT_CLUSTER = ClusterSpec(
    name="slurmgpu",
    partitions=(
        PartitionSpec("gpu", (NodePool("A100-80", "a100", ("localhost",), 4, 0),
                              NodePool("V100-32", "v100", ("localhost",), 4, 4)), 3 * _DAY, default=True),
        PartitionSpec("gpu-small", (NodePool("T4", "t4", ("localhost",), 4, 8),), 3 * _DAY),
    ),
    users=12,
    jobs_per_day=20,  # ~1.7 jobs per GPU a day; Helios and Philly run 0.6-3 (Hu et al. SC'21, Jeon et al. ATC'19)
)


def _hosts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02d}" for i in range(1, count + 1))


LARGE_CLUSTER = ClusterSpec(
    name="simcluster",
    partitions=(
        PartitionSpec("gpu", (NodePool("A100-40", "a100_40g", _hosts("a100a", 8), 4),
                              NodePool("A100-80", "a100_80g", _hosts("a100b", 16), 4),
                              NodePool("V100-32", "v100_32g", _hosts("v100b", 8), 4),
                              NodePool("V100-16", "v100_16g", _hosts("v100a", 8), 4)), 2 * _DAY, default=True),
        PartitionSpec("gpu-small", (NodePool("T4", "t4", _hosts("t4n", 8), 4),
                                    NodePool("A10", "a10", _hosts("a10n", 4), 4)), 1 * _DAY),
        PartitionSpec("gpu-ada", (NodePool("A40", "a40", _hosts("a40n", 4), 4),
                                  NodePool("L40S", "l40s", _hosts("l40s", 4), 4)), 2 * _DAY),
        PartitionSpec("gpu-large", (NodePool("H100", "h100", _hosts("h100n", 4), 8),
                                    NodePool("H200", "h200", _hosts("h200n", 2), 8)), 3 * _DAY),
        PartitionSpec("gpu-legacy", (NodePool("K80", "k80", _hosts("k80n", 4), 8),
                                     NodePool("P100", "p100", _hosts("p100n", 4), 4)), 3 * _DAY),
    ),
    users=150,
    jobs_per_day=400,
    first_job_id=100000,
    extern_steps=True,
)

CLUSTERS = {"default": DEFAULT_CLUSTER, "large": LARGE_CLUSTER}
