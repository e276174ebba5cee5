"""``slurmgpu seff JOBID``: a job's GPU efficiency, as ``seff`` reports CPU and memory efficiency."""

from __future__ import annotations

import json

import click

from slurmgpu.cli.common import ask_daemon, fail, open_history, site_config
from slurmgpu.pipeline.errors import InputError


@click.command("seff")
@click.argument("job_ids", metavar="JOBID...", nargs=-1, required=True)
@click.option("--cluster", help="The job's cluster (default: the config's site.cluster, else any).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON (a list, one object per job).")
@click.pass_context
def seff_cmd(ctx: click.Context, job_ids: tuple[str, ...], cluster: str | None, as_json: bool) -> None:
    """GPU, CPU and host-memory efficiency of jobs: per-GPU peak memory against the card,
    utilisation, idle GPUs, GPU-hours used and wasted, what was asked and what slurmgpu chose, and
    advice, from the history database; CPU and memory from Slurm, a running job's so far. Users
    see their own jobs (through `slurmgpu serve` when they cannot read the database), account
    coordinators their accounts', root and Slurm administrators all."""
    from slurmgpu.apps import userview

    config = site_config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None)
    ids = [j.strip() for j in job_ids]
    if len(ids) > userview.MAX_SEFF_JOBS:
        fail(InputError(f"at most {userview.MAX_SEFF_JOBS} job ids at a time", option="JOBID"))
    engine, why = open_history(ctx)
    if engine is None:
        answers = ask_daemon({"op": "seff", "jobs": ids, "cluster": cluster}, why)["seff"]
    else:
        viewer = userview.Viewer.this_process()
        answers = userview.seff_answers(engine, ids, cluster, config, viewer)
    for answer in answers:
        if "error" in answer:
            fail(InputError(str(answer["error"])))
    if as_json:
        click.echo(json.dumps([a["json"] for a in answers], indent=2))
    else:
        click.echo("\n".join(a["text"] for a in answers), nl=False)
