"""Helpers every command group shares: errors, the site config, the database, the model path."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from typing import Any, NoReturn

import click

from slurmgpu.pipeline.config import Config, find_config, load_config
from slurmgpu.pipeline.errors import InputError, one_line


def fail(exc: Exception) -> NoReturn:
    """One error line; exit 1 for the user's input, 2 for anything else."""
    click.echo(f"slurmgpu: error: {exc}", err=True)
    sys.exit(1 if isinstance(exc, InputError) else 2)


def write_file(path: str, data: bytes, note: str = "") -> None:
    """Write a file the user named (0644): a regular file or new path is replaced atomically (a web
    server or reader never sees half of it); a device, FIFO or symlink such as /dev/stdout is
    written in place. Says so on stderr, so the file's text alone goes to a redirected stdout."""
    from slurmgpu.pipeline.spool import write_output

    try:
        write_output(path, data, 0o644)
    except OSError as exc:
        fail(InputError(f"cannot write: {exc.strerror}", file=path))
    click.echo(f"wrote {path}{note}", err=True)


def site_config(ctx: click.Context, required: bool = True) -> Config | None:
    """The config named by --config, $SLURMGPU_CONFIG or the system path; exits when unusable."""
    path = find_config(ctx.obj["config_path"])
    if path is None:
        if required:
            fail(InputError("no config: pass --config, set SLURMGPU_CONFIG or install /etc/slurmgpu/slurmgpu.toml"))
        return None
    try:
        return load_config(path)
    except InputError as exc:
        fail(exc)


def db_url(ctx: click.Context) -> str:
    from slurmgpu.history.db import resolve_url

    if ctx.obj["db_url"] or os.environ.get("SLURMGPU_DB_URL"):
        return resolve_url(ctx.obj["db_url"])
    config = site_config(ctx, required=False)
    return resolve_url(config.site.database_url if config else None)


def history_engine(ctx: click.Context, migrated: bool = True) -> Any:
    """An engine on the history database; exits with one line when it is unreachable or not migrated."""
    from slurmgpu.history import db

    if not migrated:
        return db.make_engine(db_url(ctx))
    engine, why = open_history(ctx)
    if engine is None:
        fail(InputError(why))
    return engine


def open_history(ctx: click.Context) -> tuple[Any, str]:
    """(an engine, "") or (None, why this user cannot use the database): a user who may not read it
    (it is 0600 to the nightly account) asks the daemon instead (``ask_daemon``)."""
    from slurmgpu.history import db

    url = db_url(ctx)
    try:
        current, head = db.current_revision(url), db.head_revision()
    except Exception as exc:  # noqa: BLE001 - any driver error is the same message to the user
        return None, f"database {safe_url(url)} unreachable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if current != head:
        return None, (f"database {safe_url(url)} is at revision {current or 'none'}, code needs {head}: "
                      "run `slurmgpu db upgrade`")
    return db.make_engine(url), ""


def ask_daemon(message: dict[str, Any], why: str) -> dict[str, Any]:
    """The daemon's answer to a history request (``slurmgpu serve`` reads the database and answers
    only what this user may see); exits with one line when it gives none."""
    from slurmgpu.apps.daemon_client import DEFAULT_SOCKET, call

    path = os.environ.get("SLURMGPU_SOCKET") or DEFAULT_SOCKET
    reply = call(path, message, HISTORY_TIMEOUT_S)
    if reply is None:
        fail(InputError(f"{why}; the daemon at {path} did not answer either (is `slurmgpu serve` running, "
                        "and may you use its socket?)"))
    if not reply.get("ok"):
        fail(InputError(one_line(str(reply.get("error")))[:500]))
    return reply


HISTORY_TIMEOUT_S = 10.0  # the daemon reads the database and runs sacct for a history request


def safe_url(url: str) -> str:
    """URL with its password hidden, for messages."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def to_utc(t: Any) -> Any:
    """A naive local time typed by the user, as naive UTC."""
    return t.astimezone(UTC).replace(tzinfo=None) if t else None


def current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def model_path(ctx: click.Context) -> str:
    from slurmgpu.apps.site import model_path as site_model_path

    return site_model_path(site_config(ctx, required=False), os.environ)


@contextmanager
def progress() -> Iterator[Any]:
    """A rich progress counter on a terminal; silent in cron and tests."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.completed:,} jobs loaded"), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task("ingest", total=None)
        yield lambda n: bar.advance(task, n)


@contextmanager
def status(what: str) -> Iterator[Any]:
    """A rich spinner with a changing message on a terminal; silent otherwise."""
    if not sys.stderr.isatty():
        yield lambda s: None
        return
    from rich.console import Console

    with Console(stderr=True).status(what) as bar:
        yield lambda s: bar.update(f"{what}: {s}")
