"""`slurmgpu render`: admin files (nightly units, cron, the daemon's units) from the templates."""

from __future__ import annotations

import os
import sys

import click

from slurmgpu.cli.common import fail, site_config, write_file
from slurmgpu.pipeline.errors import InputError


@click.group("render")
def render_group() -> None:
    """Render admin files (nightly units, cron) from the templates."""


@render_group.command("nightly")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Directory to write into.")
@click.option("--user", default="slurmgpu", show_default=True, help="Account the nightly job runs as.")
@click.option("--config-path", help="Config the nightly run reads (default: the one this command was given, "
                                    "else /etc/slurmgpu/slurmgpu.toml).")
@click.option("--at", "at", default="03:17", show_default=True, help="Local time of day, HH:MM.")
@click.option("--log", default="/var/log/slurmgpu/nightly.log", show_default=True)
@click.option("--timeout", default="4h", show_default=True,
              help="Stop a nightly run after this long (N, Ns, Nm or Nh): a hung sacct, database or spool "
                   "must not hold every later night.")
@click.pass_context
def render_nightly(ctx: click.Context, out: str, user: str, config_path: str | None, at: str, log: str,
                   timeout: str) -> None:
    """Write slurmgpu-nightly.service, slurmgpu-nightly.timer and slurmgpu.cron."""
    import re as _re
    import shutil

    import jinja2

    from slurmgpu.pipeline.rewrite import templates_dir

    m = _re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", at)
    if not m:
        fail(InputError(f"invalid time of day {at!r} (expected HH:MM)", option="--at"))
    if not _re.fullmatch(r"[1-9]\d{0,5}[smh]?", timeout):
        fail(InputError(f"invalid duration {timeout!r} (expected N, Ns, Nm or Nh)", option="--timeout"))
    if config_path is None:
        config = site_config(ctx, required=False)
        config_path = os.path.realpath(config.path) if config else "/etc/slurmgpu/slurmgpu.toml"
    # The installed command: beside this interpreter (a venv's bin/), else on PATH; never argv[0],
    # which is "-c" or a temporary file when slurmgpu was started another way.
    beside = os.path.join(os.path.dirname(sys.executable), "slurmgpu")
    program = beside if os.access(beside, os.X_OK) else shutil.which("slurmgpu")
    if program is None:
        fail(InputError("cannot find the installed slurmgpu command (not beside this Python, not on PATH)"))
    for name, value in (("--user", user), ("--config-path", config_path), ("--log", log)):
        if not _re.fullmatch(r"[A-Za-z0-9_./@-]+", value):
            fail(InputError(f"unsafe characters in {value!r}", option=name))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    values = {"user": user, "config": config_path, "bin": os.path.abspath(program),
              "on_calendar": f"*-*-* {int(m.group(1)):02d}:{m.group(2)}:00", "hour": int(m.group(1)),
              "minute": int(m.group(2)), "log": log, "timeout": timeout}
    os.makedirs(out, exist_ok=True)
    for template, target in (("slurmgpu-nightly.service.j2", "slurmgpu-nightly.service"),
                             ("slurmgpu-nightly.timer.j2", "slurmgpu-nightly.timer"),
                             ("slurmgpu.cron.j2", "slurmgpu.cron")):
        path = os.path.join(out, target)
        write_file(path, env.get_template(f"nightly/{template}").render(**values).encode())
