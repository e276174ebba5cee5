"""Expected wait per GPU type from the queue: when each GPU frees up, and what waits before.

A constant "busy" wait makes every type look the same once none is idle, so the decider cannot
tell a type with one short job ahead from one with a day of queued demand. This ledger holds,
per node of each type, the time each GPU becomes free; running jobs fill it up to their expected
end, pending jobs in priority order take the earliest GPUs after them (first come, first served,
as Slurm's main scheduler does for jobs of equal priority), and a new job's wait is when a node
first has enough GPUs free.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from slurmgpu.pipeline.capacity import Capacity


class Waits(Protocol):
    """Expected seconds until GPUS of GPU_TYPE start a job (GpuLedger.wait's terms, less ``now``)."""

    def __call__(self, gpu_type: str, gpus: int, *, tasks: int = 1, runtime_s: float = 0.0,
                 at_once: int = 0) -> float: ...


MAX_TASKS = 512  # array tasks booked for an array's mean wait


class GpuLedger:
    """Per GPU type, per node, the times (s, any common origin) its GPUs become free."""

    def __init__(self, nodes: Mapping[str, Iterable[int]]) -> None:
        """``nodes``: GPU type -> GPUs per node of each node holding that type."""
        self.free = {t: [[0.0] * n for n in per_node] for t, per_node in nodes.items()}
        # What the nodes can start at all, by partition and node state (None: not read with the queue).
        self.capacity: Capacity | None = None

    @classmethod
    def from_queue(cls, nodes: Sequence[Any], jobs: Sequence[Any]) -> GpuLedger:
        """The ledger of a live cluster: ``nodes`` as the Slurm backend lists them (name,
        partitions, gpus per type), ``jobs`` as its queue gives them (slurm.backend.QueuedJob,
        highest priority first). A running job holds its GPUs on its nodes for its time left; each
        pending job then takes the earliest GPUs of its type (an untyped one: of whichever type of
        its partition frees first) for its time limit. Times are seconds from now. The same nodes
        give the ledger's ``capacity``."""
        ledger = cls({})
        ledger.capacity = Capacity.from_nodes(nodes)
        where: dict[tuple[str, str], list[float]] = {}
        types_of: dict[str, set[str]] = {}
        for node in nodes:
            for gtype, count in node.gpus.items():
                if gtype and count > 0 and (node.name, gtype) not in where:
                    where[(node.name, gtype)] = [0.0] * count
                    ledger.free.setdefault(gtype, []).append(where[(node.name, gtype)])
                    for part in node.partitions:
                        types_of.setdefault(part, set()).add(gtype)
        for job in jobs:
            per_node = {t: -(-n // max(job.num_nodes, 1)) for t, n in job.gpus.items()}
            if job.running:  # a running job's allocation names its types (Slurm records what it got)
                for name in job.nodes:
                    for gtype, n in per_node.items():
                        slots = where.get((name, gtype), [])
                        for i in sorted(range(len(slots)), key=slots.__getitem__)[:n]:
                            slots[i] = max(slots[i], job.seconds)
                continue
            for gtype, n in per_node.items():
                if not gtype:
                    choices = sorted(types_of.get(job.partition, ()))
                    if not choices:
                        continue
                    waits = {t: ledger.wait(t, n) for t in choices}
                    gtype = min(choices, key=waits.__getitem__)
                if not math.isinf(ledger.wait(gtype, n)):
                    ledger.reserve(gtype, n, 0.0, job.seconds)
        return ledger

    def _earliest(self, gpu_type: str, gpus: int) -> tuple[float, list[float] | None]:
        best, where = math.inf, None
        for node in self.free.get(gpu_type, ()):
            if len(node) >= gpus:
                ready = sorted(node)[gpus - 1]
                if ready < best:
                    best, where = ready, node
        return best, where

    def wait(self, gpu_type: str, gpus: int, now: float = 0.0, tasks: int = 1, runtime_s: float = 0.0,
             at_once: int = 0) -> float:
        """Seconds from NOW until one node has GPUS of GPU_TYPE free (inf: no node that large). For
        an array of TASKS, each running RUNTIME_S and at most AT_ONCE at a time (0: no limit), the
        mean over its tasks, booked in turn after what is queued: a sweep of 32 tasks does not wait
        as one job does (measured in the scenario: arrays sent whole to the one type free at their
        submit waited 433 hours there). ``MAX_TASKS`` are booked; later ones follow at the steady pace."""
        ready, _ = self._earliest(gpu_type, gpus)
        if tasks <= 1 or math.isinf(ready):
            return max(0.0, ready - now)
        nodes = [sorted(node) for node in self.free.get(gpu_type, ()) if len(node) >= gpus]
        heap = [(node[gpus - 1], i) for i, node in enumerate(nodes)]
        heapq.heapify(heap)
        starts: list[float] = []
        for k in range(min(tasks, MAX_TASKS)):
            ready, i = heapq.heappop(heap)
            start = max(now, ready, starts[k - at_once] + runtime_s if at_once and k >= at_once else now)
            node = nodes[i]
            node[:gpus] = [start + runtime_s] * gpus
            node.sort()
            heapq.heappush(heap, (node[gpus - 1], i))
            starts.append(start)
        total = sum(starts) - now * len(starts)
        if tasks > len(starts):  # the rest at the steady pace: RUNTIME_S per set of tasks the nodes hold at once
            slots = sum(len(node) // gpus for node in nodes)
            pace = runtime_s / max(min(slots, at_once or slots), 1)
            rest = tasks - len(starts)
            total += rest * (starts[-1] - now) + pace * rest * (rest + 1) / 2
        return total / tasks

    def reserve(self, gpu_type: str, gpus: int, now: float, duration: float) -> float:
        """Book GPUS of GPU_TYPE on the node that frees them first, from then for DURATION;
        returns the start. Nothing is booked where no node is that large."""
        ready, node = self._earliest(gpu_type, gpus)
        if node is None:
            return math.inf
        start = max(now, ready)
        order = sorted(range(len(node)), key=node.__getitem__)[:gpus]
        for i in order:
            node[i] = start + duration
        return start
