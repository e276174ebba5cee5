"""`slurmgpu parse` and `slurmgpu config`: the request as sbatch reads it, and the config against the cluster."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from slurmgpu.apps.doctor import compare_with_cluster
from slurmgpu.cli.common import fail, site_config, write_file
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import read_script
from slurmgpu.slurm.backend import SlurmError, select_backend


@click.command("parse")
@click.argument("script", type=click.Path(dir_okay=True, allow_dash=False))
@click.argument("sbatch_options", nargs=-1, type=click.UNPROCESSED)
@click.option("--json", "as_json", is_flag=True, help="Print the normalised request as JSON.")
@click.pass_context
def parse_cmd(ctx: click.Context, script: str, sbatch_options: tuple[str, ...], as_json: bool) -> None:
    """Show the GPU request SCRIPT makes, as sbatch would read it.

    SBATCH_OPTIONS (after --) are applied as command-line options, and SBATCH_* variables
    from the environment are honoured, with sbatch's precedence.
    """
    config = site_config(ctx, required=False)
    try:
        request = build_request(read_script(script), sbatch_options, os.environ,
                                config.gpu_features() if config else ())
    except InputError as exc:
        fail(exc)
    data = request.to_json()
    if request.script is not None:  # the job family key, as [[waivers]] name it
        from slurmgpu.pipeline.features import script_features

        try:
            data["family"] = script_features(request.script.text)["family"]
        except ValueError:
            data["family"] = None
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    _print_request(data)


def _print_request(data: dict[str, Any]) -> None:
    for key in ("script", "gpu_type", "gpus_total", "gpus_per_node", "nodes", "partition", "time_limit_s", "hetjob"):
        click.echo(f"{key:14} {data[key]}")
    for item in data["ignored_directives"]:
        click.echo(f"ignored line {item['line']}: {item['text']}  ({item['reason']})")


@click.group("config")
def config_group() -> None:
    """Inspect and validate the admin config."""


@config_group.command("check")
@click.option("--offline", is_flag=True, help="Validate the file only; do not ask the cluster.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (errors, warnings, matches).")
@click.pass_context
def config_check(ctx: click.Context, offline: bool, as_json: bool) -> None:
    """Validate the config, then compare it with the live cluster: partitions and GPUs (sinfo), and
    every partition, user and account its modes and waivers name (sinfo, sacctmgr). Every problem
    found is listed in one run; exit 1 when there is any."""
    from datetime import date

    from slurmgpu.apps.doctor import cluster_names, expired_waivers, name_problems, run_text

    config = site_config(ctx)
    assert config is not None
    errors: list[str] = []
    warnings = expired_waivers(config, date.today())
    if not offline:
        try:
            errors += compare_with_cluster(config, select_backend().nodes())
            names = cluster_names(run_text)
        except (SlurmError, RuntimeError) as exc:
            fail(exc if isinstance(exc, SlurmError) else SlurmError(str(exc)))
        errors += name_problems(config, names)
        if names.unasked:
            warnings.append(f"users and accounts not checked: {names.unasked}")
    valid = f"{config.path}: valid ({len(config.gpu_types)} GPU types, {len(config.partitions)} partitions)"
    if as_json:
        click.echo(json.dumps({"config": config.path, "valid": True, "errors": errors, "warnings": warnings,
                               "matches": None if offline else not errors}, indent=2))
    else:
        click.echo(valid)
        for line in warnings:
            click.echo(f"warning: {line}")
        for line in errors:
            click.echo(f"mismatch: {line}")
        if not offline and not errors:
            click.echo("matches the live cluster")
    if errors:
        sys.exit(1)


@config_group.command("init")
@click.option("--out", default="-", show_default=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="File to write (- for standard output).")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
def config_init(out: str, force: bool) -> None:
    """Write a starting config from the live cluster: GPU types and counts per node, partitions,
    the default partition; memory, speed and cost from known GPU datasheets, marked for review."""
    from slurmgpu.apps.config_init import config_text

    if out != "-" and os.path.exists(out) and not force:
        fail(InputError("exists; pass --force to replace it", file=out))
    try:
        backend = select_backend()
        text = config_text(backend.nodes(), backend.default_partition(), backend.cluster_name())
    except SlurmError as exc:
        fail(exc)
    if out == "-":
        click.echo(text, nl=False)
        return
    write_file(out, text.encode(), f": review the lines marked 'review', then run "
                                   f"`slurmgpu --config {out} config check`")
