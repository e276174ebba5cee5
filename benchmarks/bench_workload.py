"""Workload generation and cluster simulation at scale: 100,000 jobs on a ~1,000-GPU cluster.

The cluster is the simulation cluster (``LARGE_CLUSTER``: 12 GPU types in 5 partitions) with three
times the nodes, users and submission rate, so its load is the same. Phases, each timed:
generating the jobs, the workload model's runtime and fit for every job on the GPUs it asked for,
and the simulator (EASY backfill) with its summary. Peak memory is the process's peak RSS at the
end of each phase (``resource.getrusage``; it only grows). Target: each phase under 60 s on the
2-core machine. Usage: make bench [JOBS=100000]
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from slurmgpu.simulation.scenario import honour, sim_cluster, sim_jobs
from slurmgpu.simulation.simulator import simulate, summarize
from slurmgpu.simulation.workload import LARGE_CLUSTER, ClusterSpec, generate

ROOT = Path(__file__).resolve().parent.parent
SCALE = 3
TARGET_S = 60.0


def scaled(cluster: ClusterSpec, factor: int) -> ClusterSpec:
    """``factor`` times the nodes of every pool, the users and the submission rate."""
    parts = tuple(p._replace(pools=tuple(pool._replace(hosts=tuple(f"{h}-{k}" for k in range(factor)
                                                                    for h in pool.hosts))
                                         for pool in p.pools))
                  for p in cluster.partitions)
    return cluster._replace(name=f"{cluster.name}x{factor}", partitions=parts, users=cluster.users * factor,
                            jobs_per_day=cluster.jobs_per_day * factor)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(label: str, what: Callable[[], Any], rows: list[dict[str, Any]]) -> Any:
    began = time.perf_counter()
    out = what()
    rows.append({"phase": label, "seconds": time.perf_counter() - began, "peak_rss_mib": _peak_mib()})
    return out


def main(jobs: int) -> dict[str, Any]:
    cluster = scaled(LARGE_CLUSTER, SCALE)
    sim = sim_cluster(cluster)
    gpus = sum(sim.capacity(t) for t in sim.gpu_types())
    rows: list[dict[str, Any]] = []
    generated = timed(f"generate {jobs:,} jobs", lambda: generate(cluster, datetime(2026, 11, 2),
                                                                    jobs / cluster.jobs_per_day, 1), rows)
    decided = timed("workload model: runtime and fit per job", lambda: sim_jobs(generated, honour(generated)), rows)
    summary = timed(f"simulate on {gpus:,} GPUs and summarise", lambda: summarize(simulate(decided, sim)), rows)
    return {"jobs": len(generated), "gpus": gpus, "gpu_types": len(sim.gpu_types()), "phases": rows,
            "mean_wait_s": summary.mean_wait_s, "gpu_hours": summary.gpu_hours, "target_s": TARGET_S}


def table(result: dict[str, Any]) -> str:
    lines = ["| phase | seconds | peak RSS (MiB) | under 60 s |", "|---|---|---|---|"]
    lines += [f"| {r['phase']} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | "
              f"{'yes' if r['seconds'] < TARGET_S else 'NO'} |" for r in result["phases"]]
    return "\n".join(lines)


if __name__ == "__main__":
    result = main(int(os.environ.get("JOBS", "100000")))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "workload.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['jobs']:,} jobs on {result['gpus']:,} GPUs of {result['gpu_types']} types "
          f"(mean wait {result['mean_wait_s'] / 3600:.2f} h, {result['gpu_hours']:,.0f} GPU-hours)\n")
    print(table(result))
