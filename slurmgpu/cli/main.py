"""The ``slurmgpu`` admin and user command: the top-level group; each command group lives in its own module."""

from __future__ import annotations

import click

from slurmgpu import __version__
from slurmgpu.cli.history import db_group, history_group, ingest_cmd, jobs_cmd
from slurmgpu.cli.models import evaluate_cmd, nightly_cmd, predict_cmd, train_cmd
from slurmgpu.cli.render import render_group
from slurmgpu.cli.report import doctor_cmd, report_cmd
from slurmgpu.cli.request import config_group, parse_cmd
from slurmgpu.cli.retry import retry_cmd
from slurmgpu.cli.scenario import scenario_cmd
from slurmgpu.cli.seff import seff_cmd
from slurmgpu.cli.serve import lua_group, render_serve_cmd, serve_cmd
from slurmgpu.cli.workload import workload_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurmgpu")
@click.option("--config", "config_path", metavar="PATH", envvar=None,
              help="Config file (default: $SLURMGPU_CONFIG, then /etc/slurmgpu/slurmgpu.toml).")
@click.option("--db", "db_url", metavar="URL",
              help="Database URL (default: $SLURMGPU_DB_URL, the config's site.database_url, "
                   "then ~/.local/share/slurmgpu/slurmgpu.db).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, db_url: str | None) -> None:
    """Put the right GPUs under every Slurm job."""
    ctx.obj = {"config_path": config_path, "db_url": db_url}


@click.command("demo")
def demo_cmd() -> None:
    """Show gsbatch's decisions on the example scripts (nothing is submitted)."""
    from slurmgpu.apps import demo

    demo.run()



for command in (parse_cmd, config_group, db_group, ingest_cmd, jobs_cmd, history_group, train_cmd, evaluate_cmd,
                predict_cmd, nightly_cmd, render_group, serve_cmd, lua_group, report_cmd, doctor_cmd, scenario_cmd,
                workload_group, demo_cmd, seff_cmd, retry_cmd):
    main.add_command(command)
render_group.add_command(render_serve_cmd)
