"""`slurmgpu db`, `ingest`, `jobs` and `history import`: the history database."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from slurmgpu.cli.common import (
    ask_daemon,
    db_url,
    fail,
    history_engine,
    open_history,
    progress,
    safe_url,
    site_config,
    to_utc,
)
from slurmgpu.pipeline.errors import InputError


@contextmanager
def database_errors(ctx: click.Context) -> Iterator[None]:
    """A locked, lost or unreachable database ends the command with one line saying which and what to do."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        from slurmgpu.history.db import describe_error

        fail(RuntimeError(describe_error(db_url(ctx), exc)))


SHOWN_SPOOL_LINES = 50  # per kind of message: a hostile spool must not flood the nightly log


@click.group("db")
def db_group() -> None:
    """Create and migrate the history database."""


@db_group.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@click.pass_context
def db_upgrade(ctx: click.Context, revision: str) -> None:
    """Apply migrations up to REVISION (creates the database schema on first use)."""
    _migrate(ctx, "upgrade", revision)


def _migrate(ctx: click.Context, direction: str, revision: str) -> None:
    from slurmgpu.history import db

    url = db_url(ctx)
    with database_errors(ctx):
        getattr(db, direction)(url, revision)
    click.echo(f"{safe_url(url)}: at revision {db.current_revision(url) or 'base'}")


@db_group.command("downgrade")
@click.option("--revision", default="base", show_default=True)
@click.pass_context
def db_downgrade(ctx: click.Context, revision: str) -> None:
    """Revert migrations down to REVISION ('base' drops every slurmgpu table)."""
    _migrate(ctx, "downgrade", revision)


@db_group.command("current")
@click.pass_context
def db_current(ctx: click.Context) -> None:
    """Show the database's schema revision and the code's."""
    from slurmgpu.history import db

    url = db_url(ctx)
    current, head = db.current_revision(url), db.head_revision()
    click.echo(f"{safe_url(url)}: at revision {current or 'none'} (code: {head})")
    if current != head:
        sys.exit(1)


@click.command("ingest")
@click.option("--from-file", "from_file", metavar="FILE|-",
              help="Load saved `sacct --parsable`/`--parsable2` output instead of running sacct.")
@click.option("--format", "fields", metavar="FIELDS",
              help="Comma-separated sacct field names of --from-file's columns (default: its header line, "
                   "else the fields live ingest asks for).")
@click.option("--delimiter", default="|", show_default=True, help="Field delimiter of --from-file.")
@click.option("--cluster", help="Cluster name for rows without a Cluster field (default: the config's site.cluster).")
@click.option("--since", type=click.DateTime(), help="Live ingest: start (local time; default: the watermark).")
@click.option("--until", type=click.DateTime(), help="Live ingest: end (local time; default: now).")
@click.option("--spool/--no-spool", default=True, show_default=True,
              help="Also load gsbatch submission records and GPU collector records from the spools.")
@click.pass_context
def ingest_cmd(ctx: click.Context, from_file: str | None, fields: str | None, delimiter: str, cluster: str | None,
               since: Any, until: Any, spool: bool) -> None:
    """Load Slurm accounting (sacct) and spooled records into the history database.

    Idempotent: rows already stored unchanged are skipped, changed ones updated. Unreadable rows
    are reported with their line numbers (exit status 1) while the good ones still land.
    """
    from slurmgpu.history import ingest
    from slurmgpu.pipeline.spool import gpu_spool, submission_spool
    from slurmgpu.slurm import sacct

    config = site_config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None) or "default"
    engine = history_engine(ctx)
    try:
        columns = sacct.format_fields(fields) if fields else None
    except ValueError as exc:
        fail(InputError(str(exc), option="--format"))
    with database_errors(ctx):
        with progress() as advance:
            if from_file:
                report = _ingest_file(engine, from_file, columns, delimiter, cluster, advance)
            else:
                try:
                    report = ingest.ingest_sacct(engine, cluster, to_utc(since), to_utc(until), on_chunk=advance)
                except (RuntimeError, OSError) as exc:
                    fail(exc)
        if spool:
            site = config.site if config else None
            # a record's job missing from sacct's time window (cancelled while held) is asked for by id
            fetch = None if from_file else lambda keys: ingest.ingest_jobs_by_id(
                engine, cluster, [job for c, job in keys if c == cluster], report)
            ingest.load_submissions(engine, submission_spool(site.submission_spool if site else None, os.environ),
                                    report, fetch=fetch)
            ingest.load_gpu_records(engine, gpu_spool(site.gpu_spool if site else None, os.environ), report)
    for err in report.errors[:20]:
        click.echo(f"slurmgpu: rejected {from_file or 'sacct'}:{err.line}: {err.message}", err=True)
    if len(report.errors) > 20:
        click.echo(f"slurmgpu: ... and {len(report.errors) - 20} more rejected rows", err=True)
    _echo_some("set aside spool record", report.files_rejected)
    _echo_some("spool record", report.files_kept)
    if report.files_unreadable:
        _echo_some("cannot read spool record as this account (left in place)", report.files_unreadable)
        click.echo("slurmgpu: the ingest's account must be in the spool's group and records group-readable "
                   "(see docs/security.md, 'Spools and the nightly account'); "
                   "records written before that can be drained once by root", err=True)
    click.echo(report.summary())
    if report.errors or report.files_rejected or report.files_unreadable:
        sys.exit(1)


def _echo_some(label: str, lines: list[str]) -> None:
    for line in lines[:SHOWN_SPOOL_LINES]:
        click.echo(f"slurmgpu: {label} {line}", err=True)
    if len(lines) > SHOWN_SPOOL_LINES:
        click.echo(f"slurmgpu: ... and {len(lines) - SHOWN_SPOOL_LINES} more", err=True)


def _ingest_file(engine: Any, path: str, columns: Any, delimiter: str, cluster: str, advance: Any) -> Any:
    from slurmgpu.history import ingest
    from slurmgpu.slurm import sacct

    try:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
    except OSError as exc:
        fail(InputError(f"cannot read: {exc.strerror}", file=path))
    with stream:
        try:
            return ingest.load_jobs(engine, sacct.parse_lines(stream, columns, delimiter, cluster), on_chunk=advance)
        except ValueError as exc:
            fail(InputError(str(exc), file=path))


@click.command("jobs")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job, as a list.")
@click.option("--user", help="Only this user's jobs (non-root users can only ask for their own).")
@click.option("--since", type=click.DateTime(), help="Only jobs submitted at or after this local time.")
@click.option("--job", "job_ids", multiple=True, help="Only this job id (as sacct prints it); repeatable.")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Show at most this many jobs, the newest.")
@click.option("--wide", is_flag=True, help="Every column, however wide the terminal.")
@click.pass_context
def jobs_cmd(ctx: click.Context, as_json: bool, user: str | None, since: Any, job_ids: tuple[str, ...],
             limit: int, wide: bool) -> None:
    """Read the stored history back, newest first; says how many matching jobs the limit left out."""
    from slurmgpu.apps import userview

    engine, why = open_history(ctx)
    if engine is None:  # the database is the nightly account's: the daemon answers what this user may see
        answer = ask_daemon({"op": "jobs", "user": user, "since": to_utc(since).isoformat() if since else None,
                             "job_ids": list(job_ids), "limit": limit}, why)
    else:
        with database_errors(ctx):
            try:
                answer = userview.jobs_answer(engine, userview.Viewer.this_process(),
                                              user, to_utc(since), job_ids, limit)
            except InputError as exc:
                fail(exc)
    rows, left_out = answer["jobs"], answer["left_out"]
    if left_out:
        click.echo(f"slurmgpu: showing the newest {len(rows)} jobs; {left_out} older ones not shown "
                   "(--limit N, --since TIME)", err=True)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from slurmgpu.reporting import render
    from slurmgpu.slurm.sacct import format_duration

    header = ("job", "user", "partition", "state", "GPUs", "elapsed", "peak GiB/GPU", "max util %")
    cells: list[tuple[str, ...]] = [(r["job_id"], r["user"] or "", r["partition"] or "", r["state"],
              f"{r['gpu_count']} x {r['gpu_type'] or 'any'}" if r["gpu_count"] else "-",
              format_duration(r["elapsed_s"]) if r["elapsed_s"] is not None else "",
              f"{r['peak_gpu_mem_mib'] / 1024:.1f}" if r["peak_gpu_mem_mib"] is not None else "",
              f"{r['max_gpu_util']:.0f}" if r["max_gpu_util"] is not None else "") for r in rows]
    if render.print_table("Jobs", header, cells, render.console_for(wide), wide):
        click.echo("Columns left out to fit the terminal: --wide shows them all, --json every field.")



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
    from slurmgpu.history.imports import import_history

    config = site_config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None) or "default"
    engine = history_engine(ctx)
    try:
        with database_errors(ctx):
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
