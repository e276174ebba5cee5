"""``slurmgpu seff JOBID``: a job's GPU efficiency, as ``seff`` reports CPU and memory efficiency."""

from __future__ import annotations

import os

import click

from slurmgpu.cli.common import current_user, fail, history_engine, site_config
from slurmgpu.pipeline.errors import InputError


@click.command("seff")
@click.argument("job_ids", metavar="JOBID...", nargs=-1, required=True)
@click.option("--cluster", help="The job's cluster (default: the config's site.cluster, else any).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON (a list, one object per job).")
@click.pass_context
def seff_cmd(ctx: click.Context, job_ids: tuple[str, ...], cluster: str | None, as_json: bool) -> None:
    """GPU efficiency of finished jobs from the history database: per-GPU peak memory against the
    card, utilisation, idle GPUs, GPU-hours used and wasted, what was asked and what slurmgpu
    chose, and advice. Users see their own jobs; root sees all."""
    from slurmgpu.reporting import queries, seff

    config = site_config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None)
    engine = history_engine(ctx)
    me = None if os.geteuid() == 0 else current_user()
    results = []
    for job_id in job_ids:
        found = queries.find_job(engine, job_id.strip(), cluster)
        if found is None:
            fail(InputError(f"job {job_id} is not in the history database (running jobs and jobs the nightly "
                            "ingest has not loaded yet are not there)"))
        if me is not None and found.job.user != me:
            fail(InputError(f"job {job_id} belongs to another user: you may only see your own jobs"))
        results.append(seff.build(found, config))
    if as_json:
        click.echo(seff.to_json(results))
    else:
        click.echo("\n".join(seff.to_text(r) for r in results), nl=False)
