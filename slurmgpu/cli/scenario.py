"""``slurmgpu scenario``: GPU-allocation policies compared on a synthetic workload (cli.py registers it).

``slurmgpu.simulation.scenario`` (numpy, the simulator, the trainer) is imported inside the command so that
other ``slurmgpu`` commands do not pay for it at start-up.
"""

from __future__ import annotations

import click


@click.command("scenario")
@click.option("--scenario", "name", type=click.Choice(["default", "small"]), default="default", show_default=True,
              help="default: ~50,000 jobs on the 336-GPU, 12-type simulation cluster (a few minutes); "
                   "small: ~2,000 jobs on the same cluster (seconds).")
@click.option("--jobs", type=click.IntRange(min=100), help="About this many jobs (default: the scenario's).")
@click.option("--seed", type=int, help="Workload seed (default: 1).")
@click.option("--report-dir", type=click.Path(file_okay=False), default="scenario-report", show_default=True,
              help="Where results.json, results.md, jct_cdf.svg and allocated_gpus.svg are written.")
def scenario_cmd(name: str, jobs: int | None, seed: int | None, report_dir: str) -> None:
    """Run four policies on the same generated jobs through the cluster simulator and compare them.

    The policies: the user's request; a static rule (smallest card holding 1.2x an analytic memory
    estimate); slurmgpu's model decider, trained on the first 30% of the jobs; an oracle that knows
    true memory and runtime. Prints a markdown table (one row per policy) on stdout.
    """
    from slurmgpu.simulation import scenario, scenario_report

    chosen = scenario.SCENARIOS[name]
    chosen = chosen._replace(jobs=jobs or chosen.jobs, seed=chosen.seed if seed is None else seed)
    evaluation = scenario.evaluate(chosen, progress=lambda msg: click.echo(f"slurmgpu: {msg}", err=True))
    click.echo(scenario_report.markdown_table(evaluation), nl=False)
    for path in scenario_report.write_report(evaluation, report_dir):
        click.echo(f"slurmgpu: wrote {path}", err=True)
