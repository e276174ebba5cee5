"""Click commands for history import and synthetic workloads (wired into ``slurmgpu`` by cli.py).

``slurmgpu.cli.main`` is imported inside the commands: it will import this module to register them.
"""

from __future__ import annotations

import collections
import os
import sys
from datetime import datetime

import click

from slurmgpu.pipeline.errors import InputError


@click.group("history")
def history_group() -> None:
    """Bring job history from other sources into the history database."""


@history_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--cluster", help="Cluster the jobs belong to (default: the config's site.cluster, else 'default').")
@click.pass_context
def history_import_cmd(ctx: click.Context, file: str, cluster: str | None) -> None:
    """Load a CSV or Parquet table of jobs (see slurmgpu.history.imports for its columns).

    Idempotent. Bad rows are reported with their row number (exit status 1) while the good ones load.
    """
    from slurmgpu.cli.main import _config, _engine, fail
    from slurmgpu.history.imports import import_history

    config = _config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None) or "default"
    engine = _engine(ctx)
    try:
        report = import_history(engine, file, cluster)
    except (ValueError, OSError) as exc:
        fail(InputError(str(exc), file=file))
    errors = report.jobs.errors
    for err in errors[:20]:
        click.echo(f"slurmgpu: rejected {file}: row {err.line}: {err.message}", err=True)
    if len(errors) > 20:
        click.echo(f"slurmgpu: ... and {len(errors) - 20} more rejected rows", err=True)
    click.echo(report.summary())
    if errors:
        sys.exit(1)


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
    from slurmgpu.cli.main import fail
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
