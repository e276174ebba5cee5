"""``slurmgpu scenario``: GPU-allocation policies compared on a synthetic workload (cli.py registers it).

``slurmgpu.simulation.scenario`` (numpy, the simulator, the trainer) is imported inside the command so that
other ``slurmgpu`` commands do not pay for it at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from slurmgpu.simulation.scenario import Scenario


@click.command("scenario")
@click.option("--scenario", "name", type=click.Choice(["default", "small"]), default="default", show_default=True,
              help="default: ~50,000 jobs on the 336-GPU, 12-type simulation cluster (a few minutes); "
                   "small: ~2,000 jobs on the same cluster (seconds).")
@click.option("--jobs", type=click.IntRange(min=100), help="About this many jobs (default: the scenario's).")
@click.option("--seed", type=int, help="Workload seed (default: 1).")
@click.option("--load", "loads", callback=lambda ctx, param, value: _loads(value),
              help="Comma-separated shares of the GPUs to keep allocated, e.g. 0.3,0.6,0.85: the arrival rate is "
                   "calibrated to each (pilot runs) and the policies are compared at every load, each in "
                   "REPORT_DIR/load-<share>/, with REPORT_DIR/load-summary.md over all.")
@click.option("--days", type=click.FloatRange(min=1.0), default=7.0, show_default=True,
              help="With --load: the period submitted over (the rate follows from the load).")
@click.option("--report-dir", type=click.Path(file_okay=False), default="scenario-report", show_default=True,
              help="Where results.json, results.md, jct_cdf.svg and allocated_gpus.svg are written.")
def scenario_cmd(name: str, jobs: int | None, seed: int | None, loads: tuple[float, ...], days: float,
                 report_dir: str) -> None:
    """Run four policies on the same generated jobs through the cluster simulator and compare them.

    The policies: the user's request; a static rule (smallest card holding 1.2x an analytic memory
    estimate); slurmgpu's model decider, trained on the first 30% of the jobs; an oracle that knows
    true memory and runtime. Prints a markdown table (one row per policy) on stdout; with --load,
    the summary table over the loads.
    """
    from slurmgpu.simulation import scenario, scenario_report

    def progress(msg: str) -> None:
        click.echo(f"slurmgpu: {msg}", err=True)

    chosen = scenario.SCENARIOS[name]
    chosen = chosen._replace(seed=chosen.seed if seed is None else seed)
    if loads:
        if jobs is not None:
            raise click.UsageError("--jobs and --load exclude each other: with --load, --days sets the period")
        _load_sweep(chosen, loads, days, report_dir, progress)
        return
    evaluation = scenario.evaluate(chosen._replace(jobs=jobs or chosen.jobs), progress=progress)
    click.echo(scenario_report.markdown_table(evaluation), nl=False)
    for path in scenario_report.write_report(evaluation, report_dir):
        progress(f"wrote {path}")


def _loads(value: str | None) -> tuple[float, ...]:
    if not value:
        return ()
    try:
        loads = tuple(float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers", param_hint="--load") from None
    bad = [v for v in loads if not 0.0 < v < 1.0]
    if bad:
        raise click.BadParameter(f"{bad[0]:g} is not a share of the GPUs between 0 and 1", param_hint="--load")
    return tuple(sorted(set(loads)))


def _load_sweep(chosen: Scenario, loads: tuple[float, ...], days: float, report_dir: str,
                progress: Callable[[str], None]) -> None:
    """Calibrate, evaluate and report each load; the summary table on stdout and in REPORT_DIR."""
    from slurmgpu.simulation import load, load_report, scenario

    runs = []
    for share in loads:
        cal = load.calibrate(chosen.cluster, share, chosen.start, chosen.seed, days=days, progress=progress)
        sc = chosen._replace(jobs=max(1, round(cal.jobs_per_day * days)), jobs_per_day=cal.jobs_per_day, load=share)
        run = load_report.LoadRun(cal, scenario.evaluate(sc, progress=progress))
        for path in load_report.write_load(run, report_dir):
            progress(f"wrote {path}")
        runs.append(run)
    progress(f"wrote {load_report.write_summary(runs, report_dir)}")
    click.echo(load_report.summary_markdown(runs), nl=False)
