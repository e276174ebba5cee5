"""The ``slurmgpu`` admin and user command (click)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, NoReturn

import click

from slurmgpu import __version__
from slurmgpu.config import Config, find_config, load_config
from slurmgpu.errors import InputError
from slurmgpu.request import build_request
from slurmgpu.script import read_script
from slurmgpu.slurm import SlurmError, select_backend


def fail(exc: Exception) -> NoReturn:
    click.echo(f"slurmgpu: error: {exc}", err=True)
    sys.exit(1 if isinstance(exc, InputError) else 2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurmgpu")
@click.option("--config", "config_path", metavar="PATH", envvar=None,
              help="Config file (default: $SLURMGPU_CONFIG, then /etc/slurmgpu/slurmgpu.toml).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """Put the right GPUs under every Slurm job."""
    ctx.obj = {"config_path": config_path}


def _config(ctx: click.Context, required: bool = True) -> Config | None:
    path = find_config(ctx.obj["config_path"])
    if path is None:
        if required:
            fail(InputError("no config: pass --config, set SLURMGPU_CONFIG or install /etc/slurmgpu/slurmgpu.toml"))
        return None
    try:
        return load_config(path)
    except InputError as exc:
        fail(exc)


@main.command("parse")
@click.argument("script", type=click.Path(dir_okay=True, allow_dash=False))
@click.argument("sbatch_options", nargs=-1, type=click.UNPROCESSED)
@click.option("--json", "as_json", is_flag=True, help="Print the normalised request as JSON.")
@click.pass_context
def parse_cmd(ctx: click.Context, script: str, sbatch_options: tuple[str, ...], as_json: bool) -> None:
    """Show the GPU request SCRIPT makes, as sbatch would read it.

    SBATCH_OPTIONS (after --) are applied as command-line options, and SBATCH_* variables
    from the environment are honoured, with sbatch's precedence.
    """
    config = _config(ctx, required=False)
    try:
        request = build_request(read_script(script), sbatch_options, os.environ,
                                config.gpu_features() if config else ())
    except InputError as exc:
        fail(exc)
    data = request.to_json()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    _print_request(data)


def _print_request(data: dict[str, Any]) -> None:
    for key in ("script", "gpu_type", "gpus_total", "gpus_per_node", "nodes", "partition", "time_limit_s", "hetjob"):
        click.echo(f"{key:14} {data[key]}")
    for item in data["ignored_directives"]:
        click.echo(f"ignored line {item['line']}: {item['text']}  ({item['reason']})")


@main.group("config")
def config_group() -> None:
    """Inspect and validate the admin config."""


@config_group.command("check")
@click.option("--offline", is_flag=True, help="Validate the file only; do not ask the cluster.")
@click.pass_context
def config_check(ctx: click.Context, offline: bool) -> None:
    """Validate the config, then compare it with the live cluster's partitions and GPUs."""
    config = _config(ctx)
    assert config is not None
    click.echo(f"{config.path}: valid ({len(config.gpu_types)} GPU types, {len(config.partitions)} partitions)")
    if offline:
        return
    try:
        nodes = select_backend().nodes()
    except SlurmError as exc:
        fail(exc)
    problems = compare_with_cluster(config, nodes)
    for p in problems:
        click.echo(f"mismatch: {p}")
    if problems:
        sys.exit(1)
    click.echo("matches the live cluster")


def compare_with_cluster(config: Config, nodes: list[Any]) -> list[str]:
    """Differences an admin must fix: configured partitions/types the cluster does not have,
    per-node counts larger than any node offers, and GPU types the config does not know."""
    problems: list[str] = []
    live_parts: dict[str, dict[str, int]] = {}
    for n in nodes:
        for part in n.partitions:
            offered = live_parts.setdefault(part, {})
            for gtype, count in n.gpus.items():
                offered[gtype] = max(offered.get(gtype, 0), count)
    for p in config.partitions.values():
        live = live_parts.get(p.name)
        if live is None:
            problems.append(f"partition {p.name} is configured but does not exist in the cluster")
            continue
        for gtype in p.gpu_types:
            if gtype not in live:
                problems.append(f"partition {p.name}: GPU type {gtype} is configured but no node offers it")
            elif live[gtype] < p.gpus_per_node and len(p.gpu_types) == 1:
                problems.append(f"partition {p.name}: gpus_per_node = {p.gpus_per_node} but nodes have "
                                f"{live[gtype]} {gtype}")
    for part, offered in live_parts.items():
        for gtype in offered:
            if gtype and gtype not in config.gpu_types:
                problems.append(f"partition {part}: the cluster offers GPU type {gtype}, unknown to the config")
    return problems


@main.command("demo")
def demo_cmd() -> None:
    """Show gsbatch's decisions on the example scripts (nothing is submitted)."""
    from slurmgpu import demo

    sys.exit(demo.run())


if __name__ == "__main__":
    main()
