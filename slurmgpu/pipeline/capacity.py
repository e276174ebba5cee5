"""What the live cluster's nodes can start: a GPU type and count in a partition, or why not.

The admin config says what a partition should hold; Slurm's nodes say what it does. A decision
that moves a job to a type no node of the partition has, or to more GPUs per node than any node
holds, gets a job Slurm rejects ("Requested node configuration is not available") or leaves
pending for ever, and a comparison with such a shape has no finish time to compare. Read from the
node list the queue view is built from (``GpuLedger.from_queue``), so no extra Slurm call is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from slurmgpu.pipeline.request import ComponentRequest

# sinfo's %T for a node that starts no new job: down, drained or draining, failing, not yet in
# service, misconfigured; a trailing "*" is a node that does not respond.
_OUT = ("down", "drain", "fail", "future", "inval")


class NodeGpus(NamedTuple):
    """One node as the decision sees it: its partitions, GPUs per type, and whether it takes jobs."""

    partitions: tuple[str, ...]
    gpus: Mapping[str, int]  # type ("" untyped) -> count
    up: bool


class Need(NamedTuple):
    """How Slurm places a GPU count: ``per_node`` on each of ``nodes`` nodes when the request fixes
    a per-node count, else ``total`` spread over at least ``nodes`` nodes in whole ``chunk``s (a
    task's GPUs stay on one node; a per-job count splits anywhere)."""

    total: int
    per_node: int | None
    nodes: int = 1
    chunk: int = 1


def node_up(state: str) -> bool:
    """Whether a node in this sinfo state (``%T``) can start a job now or once its jobs end."""
    state = state.lower()
    return not state.endswith("*") and not any(s in state for s in _OUT)


def need_of(comp: ComponentRequest, total: int) -> Need:
    """Where Slurm would put TOTAL GPUs of COMP's request (same options, another count): a per-node,
    per-socket or ``-N`` ask fixes the GPUs of each node (as RuleDecider reads it), a per-task one
    places each task's share whole on a node, and a per-job one spreads over any nodes."""
    pers = {g.per for g in comp.gpus}
    asked = comp.gpus_total or total
    if pers == {"task"} and not comp.nodes_set and comp.tally.tasks:
        return Need(total, None, 1, max(total // comp.tally.tasks, 1))
    per_node = comp.gpus_per_node if (comp.nodes_set or pers - {"job"}) else None
    if per_node:
        return Need(total, max(per_node * total // asked, 1), max(comp.tally.nodes, 1))
    return Need(total, None, max(comp.tally.nodes, 1) if comp.nodes_set else 1)


def shape_words(gpus: int, gpu_type: str | None) -> str:
    return f"{gpus} x {gpu_type}" if gpu_type else f"{gpus} GPUs"


class Capacity:
    """The live nodes' GPUs by partition, and whether a shape can start in one."""

    def __init__(self, nodes: Iterable[NodeGpus]) -> None:
        self.nodes = list(nodes)
        self._in: dict[str, list[NodeGpus]] = {}  # by partition: a decision asks many shapes of a few
        # answers given: the daemon asks the same shapes of one node view for every job until it is read again
        self._said: dict[tuple[str, str | None, Need], str | None] = {}
        for node in self.nodes:
            for part in node.partitions:
                self._in.setdefault(part, []).append(node)

    @classmethod
    def from_nodes(cls, nodes: Iterable[Any]) -> Capacity:
        """From the Slurm backend's node list (``name``, ``partitions``, ``gpus``, ``state``)."""
        return cls(NodeGpus(tuple(n.partitions), dict(n.gpus), node_up(n.state)) for n in nodes)

    def to_json(self) -> list[list[Any]]:
        return [[list(n.partitions), dict(n.gpus), n.up] for n in self.nodes]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> Capacity:
        """The ``to_json`` form back (a cache file); ValueError/TypeError on anything else."""
        out = []
        for parts, gpus, up in data:
            if not isinstance(parts, list) or not isinstance(gpus, dict) or not isinstance(up, bool):
                raise ValueError("not a node")
            out.append(NodeGpus(tuple(str(p) for p in parts), {str(t): int(n) for t, n in gpus.items()}, up))
        return cls(out)

    def why_not(self, partition: str, gpu_type: str | None, need: Need) -> str | None:
        """Why no node set of PARTITION can start NEED GPUs of GPU_TYPE (any type when None: Slurm
        mixes a node's types), or None when one can. A partition without nodes here is left to Slurm."""
        key = (partition, gpu_type, need)
        if key not in self._said:
            self._said[key] = self._why_not(partition, gpu_type, need)
        return self._said[key]

    def _why_not(self, partition: str, gpu_type: str | None, need: Need) -> str | None:
        held = [(n.gpus.get(gpu_type, 0) if gpu_type else sum(n.gpus.values()), n.up)
                for n in self._in.get(partition, ())]
        if not held:
            return None
        if not any(h for h, _ in held):
            return f"no node in partition {partition} has {'a ' + gpu_type if gpu_type else 'a'} GPU"
        most = max(h for h, _ in held)
        if need.per_node is not None:
            big = [up for h, up in held if h >= need.per_node]
            shape = shape_words(need.per_node, gpu_type)
            if not big:
                return f"no node in partition {partition} has {shape} (most: {most})"
            if sum(big) >= need.nodes:
                return None
            if len(big) >= need.nodes:
                return f"the nodes in partition {partition} with {shape} are down, drained or not responding"
            return f"{len(big)} node(s) in partition {partition} have {shape}, not the {need.nodes} asked"
        usable = sum(h // need.chunk * need.chunk for h, up in held if up)
        if usable >= need.total and sum(1 for h, up in held if up and h >= need.chunk) >= need.nodes:
            return None
        everywhere = sum(h // need.chunk * need.chunk for h, _ in held)
        holding = sum(1 for h, _ in held if h >= need.chunk)
        if most < need.chunk:
            return f"no node in partition {partition} has {shape_words(need.chunk, gpu_type)} (most: {most})"
        if everywhere < need.total:
            return f"partition {partition} has {shape_words(everywhere, gpu_type)} in all, not {need.total}"
        if holding < need.nodes:
            return f"{holding} node(s) in partition {partition} have {gpu_type or 'GPUs'}, not the {need.nodes} asked"
        return (f"partition {partition} has {shape_words(need.total, gpu_type)} only on nodes that are down, "
                "drained or not responding")
