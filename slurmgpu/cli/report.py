"""``slurmgpu report`` and ``slurmgpu doctor``; cli.py registers them on the main command."""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timedelta
from typing import Any

import click

from slurmgpu.apps.doctor import DEFAULT_SOCKET, MODEL_MAX_AGE_DAYS, SPOOL_MAX_AGE_HOURS, compare_with_cluster
from slurmgpu.cli.common import ask_daemon, fail, open_history, site_config, to_utc, write_file
from slurmgpu.pipeline.errors import InputError


@click.command("report")
@click.option("--since", type=click.DateTime(),
              help="Start of the window, local time (default: 30 days before --until).")
@click.option("--until", type=click.DateTime(), help="End of the window, local time (default: now).")
@click.option("--user", help="Only this user's jobs (a user who is not root only ever sees their own).")
@click.option("--account", help="Only this account's jobs.")
@click.option("--cluster", help="Only this cluster's jobs (default: the config's site.cluster, else all).")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]),
              help="What to print on stdout (default: table; nothing but a note when --html is given).")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("--html", "html_path", metavar="FILE", type=click.Path(dir_okay=False),
              help="Write a self-contained HTML page (inline CSS and SVG) to FILE.")
@click.option("--alerts", "only_alerts", is_flag=True,
              help="Only the alerts: per user and account, jobs on too big a card, idle GPUs, out-of-memory "
                   "kills and over-requested counts, each with the fix to tell the user.")
@click.option("--wide", is_flag=True, help="Every column, however wide the terminal (default: fit $COLUMNS, else 80).")
@click.pass_context
def report_cmd(ctx: click.Context, since: Any, until: Any, user: str | None, account: str | None,
               cluster: str | None, fmt: str | None, as_json: bool, html_path: str | None, only_alerts: bool,
               wide: bool) -> None:
    """GPU use over a time window: allocated vs used per GPU type, over-requests and OOMs per
    user and account, what slurmgpu changed with the GPU-hours and queue time it saved, and
    alerts an admin can act on (--alerts for those alone)."""
    from slurmgpu.apps import userview
    from slurmgpu.history.db import utcnow
    from slurmgpu.reporting import render, report

    end = to_utc(until) or utcnow()
    start = to_utc(since) or end - timedelta(days=30)
    if start >= end:
        fail(InputError("the window is empty: --since must be before --until", option="--since"))
    config = site_config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None)
    engine, why = open_history(ctx)
    model = None
    if engine is None:  # the database is the nightly account's: the daemon answers what this user may see
        answer = ask_daemon({"op": "report", "since": start.isoformat(), "until": end.isoformat(), "user": user,
                             "account": account, "cluster": cluster}, why)
        jobs, user = userview.jobs_from_json(answer["jobs"]), answer["user"]
    else:
        from slurmgpu.learning import registry

        try:
            jobs, user = userview.report_jobs(engine, userview.Viewer.this_process(),
                                              start, end, user, account, cluster)
        except InputError as exc:
            fail(exc)
        model = registry.installed(engine)
    result = report.build(jobs, config, start, end, user, model)
    if html_path:
        write_file(html_path, render.to_html(result, utcnow()).encode(), f": {len(jobs)} GPU jobs")
    if as_json:
        if fmt not in (None, "json"):
            fail(InputError(f"--json and --format {fmt} ask for different outputs", option="--json"))
        fmt = "json"
    if fmt == "json":
        click.echo(render.alerts_json(result) if only_alerts else render.to_json(result))
    elif fmt == "csv":
        click.echo(render.to_csv(result, only_alerts), nl=False)
    elif fmt == "table" or not html_path:
        render.print_tables(result, render.console_for(wide), wide, only_alerts)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--socket", "socket_path", metavar="PATH", envvar="SLURMGPU_SOCKET", default=DEFAULT_SOCKET,
              show_default=True, help="The prediction daemon's Unix socket (or $SLURMGPU_SOCKET).")
@click.option("--model-max-age-days", type=click.FloatRange(min=0), default=MODEL_MAX_AGE_DAYS, show_default=True,
              help="Warn when the model was trained longer ago than this.")
@click.option("--spool-max-age-hours", type=click.FloatRange(min=0), default=SPOOL_MAX_AGE_HOURS, show_default=True,
              help="Fail when a spool holds a record older than this (the ingest is not emptying it).")
@click.pass_context
def doctor_cmd(ctx: click.Context, as_json: bool, socket_path: str, model_max_age_days: float,
               spool_max_age_hours: float) -> None:
    """Check the installation (config, cluster, database, model, daemon, lua hook, spools) and
    say what to fix. Exit status 1 when any check FAILs."""
    from slurmgpu.apps import doctor
    from slurmgpu.apps.site import model_path
    from slurmgpu.history import db
    from slurmgpu.pipeline.bundle import Bundle
    from slurmgpu.pipeline.config import find_config, load_config
    from slurmgpu.pipeline.spool import gpu_spool, submission_spool
    from slurmgpu.slurm.backend import choose_backend, select_backend

    first, config = doctor.check_config(find_config(ctx.obj["config_path"]), load_config)
    url = db.resolve_url(ctx.obj["db_url"] or os.environ.get("SLURMGPU_DB_URL")
                         or (config.site.database_url if config else None))
    database = doctor.check_database(url, db.current_revision, db.head_revision(), _sqlite_file(url))
    site = config.site if config else None
    subs, gpus = (site.submission_spool, site.gpu_spool) if site else (None, None)  # the site's, not personal
    checks = [
        first,
        doctor.check_cluster(config, lambda: select_backend().nodes(), compare_with_cluster),
        doctor.check_backend(os.environ, choose_backend),
        database,
        doctor.check_model(model_path(config, os.environ), config, Bundle.load,
                           _trained_at(url) if database.status == doctor.OK else None, db.utcnow(),
                           model_max_age_days),
        doctor.check_daemon(socket_path),
        doctor.check_lua_hook(doctor.run_text),
        *doctor.check_slurm_config(doctor.run_text, config),
        *(doctor.check_spool(name, path, time.time(), spool_max_age_hours, site=path == configured)
          for name, path, configured in (
              ("submission", submission_spool(subs, os.environ), subs),
              ("GPU", gpu_spool(gpus, os.environ), gpus))),
    ]
    click.echo(doctor.to_json(checks) if as_json else doctor.render(checks, color=sys.stdout.isatty()))
    sys.exit(doctor.exit_status(checks))


def _sqlite_file(url: str) -> str | None:
    """The SQLite file behind URL: the doctor must not create it by connecting."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return parsed.database


def _trained_at(url: str) -> datetime | None:
    """When the registry's active model version was made (naive UTC); None when it has none."""
    from sqlalchemy import select
    from sqlalchemy.exc import SQLAlchemyError

    from slurmgpu.history.db import ModelVersion, make_engine
    from slurmgpu.learning.registry import NAME

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(select(ModelVersion.created_at)
                                .where(ModelVersion.name == NAME, ModelVersion.active.is_(True))
                                .order_by(ModelVersion.version.desc()).limit(1)).scalar()
    except SQLAlchemyError:
        return None
    finally:
        engine.dispose()
