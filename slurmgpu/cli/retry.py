"""`slurmgpu retry`: run GPU out-of-memory jobs again once, as new jobs, on a card that holds them (opt-in)."""

from __future__ import annotations

import os
import sys

import click

from slurmgpu.cli.common import fail, history_engine, model_path, site_config
from slurmgpu.cli.history import database_errors
from slurmgpu.pipeline.errors import InputError


@click.command("retry")
@click.option("--since-hours", type=click.FloatRange(min=0), default=24.0, show_default=True,
              help="Look at jobs that ended this long ago at most.")
@click.option("--cluster", default=None, help="Cluster name in the history (default: the config's).")
@click.pass_context
def retry_cmd(ctx: click.Context, since_hours: float, cluster: str | None) -> None:
    """Submit each job that ran out of GPU memory (the collector's finding, after `slurmgpu ingest`)
    again once, as a new job of its owner's, on the smallest larger card the model says holds it,
    when `[policy] oom_retry = true`. Run it as root (it submits as the job's owner), after each ingest."""
    from slurmgpu.apps import retry
    from slurmgpu.pipeline.bundle import Bundle
    from slurmgpu.slurm.partitions import read_partitions

    config = site_config(ctx)
    assert config is not None
    if not config.policy.oom_retry:
        click.echo("slurmgpu retry: [policy] oom_retry is off in the config; nothing done", err=True)
        return
    if os.geteuid() != 0:
        fail(InputError("must run as root (it submits each job again as its owner)"))
    cluster = cluster or config.site.cluster or "slurmgpu"
    try:
        admits = retry.slurm_admits(read_partitions())
    except (OSError, ValueError) as exc:
        fail(InputError(f"cannot read Slurm's partitions: {exc}"))
    with database_errors(ctx):
        engine = history_engine(ctx)
        try:
            fits_for = retry.model_fits(config, Bundle.load(model_path(ctx)), engine, cluster)
        except (OSError, ValueError):
            fits_for = None  # no usable model: the next larger card
        actions = retry.retry(engine, config, cluster, since_hours, partition_ok=admits, fits_for=fits_for)
    for a in actions:
        click.echo(f"slurmgpu retry: job {a.job_id}: {a.message}")
    sys.exit(1 if any(not a.done and "failed" in a.message for a in actions) else 0)
