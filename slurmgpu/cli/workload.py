"""`slurmgpu workload`: seeded synthetic histories in the formats `slurmgpu ingest` reads."""

from __future__ import annotations

import collections
import os
from datetime import datetime

import click

from slurmgpu.cli.common import fail
from slurmgpu.pipeline.errors import InputError


@click.group("workload")
def workload_group() -> None:
    """Synthetic workloads for demos, tests and simulation."""


@workload_group.command("generate")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write scripts/, sacct.txt and spool/ into (must be empty or new).")
@click.option("--days", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--cluster-size", type=click.Choice(["default", "large"]), default="default", show_default=True,
              help="default: the local test cluster of contrib/slurmgpu.toml; large: every GPU type, for simulation.")
@click.option("--start", type=click.DateTime(formats=["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S"]),
              default="2026-11-02", show_default=True, help="First submission day (UTC).")
@click.option("--jobs-per-day", type=click.FloatRange(min=0, min_open=True),
              help="Default: the cluster's own rate.")
def workload_generate_cmd(out_dir: str, days: float, seed: int, cluster_size: str, start: datetime,
                          jobs_per_day: float | None) -> None:
    """Generate a seeded synthetic history in the formats `slurmgpu ingest` reads.

    Load it with `SLURMGPU_GPU_SPOOL=OUT/spool slurmgpu ingest --from-file OUT/sacct.txt`
    (sacct prints local time: generate and ingest in the same time zone).
    """
    from slurmgpu.simulation.workload import CLUSTERS, generate
    from slurmgpu.simulation.workload.emit import emit

    if os.path.isdir(out_dir) and os.listdir(out_dir):
        fail(InputError("not empty: choose a new or empty directory", option="--out"))
    cluster = CLUSTERS[cluster_size]
    jobs = generate(cluster, start, days, seed, jobs_per_day)
    emitted = emit(out_dir, jobs, cluster)
    states = collections.Counter(run.state for run in emitted.runs)
    click.echo(f"{len(jobs)} jobs on cluster {cluster.name} "
               f"({', '.join(f'{n} {s}' for s, n in states.most_common())}) written to {out_dir}: "
               "scripts/, sacct.txt, spool/")
