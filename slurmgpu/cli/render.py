"""`slurmgpu render`: admin files (nightly units, cron, the daemon's units) from the templates."""

from __future__ import annotations

import os
import sys

import click

from slurmgpu.cli.common import fail, write_file
from slurmgpu.pipeline.errors import InputError


@click.group("render")
def render_group() -> None:
    """Render admin files (nightly units, cron) from the templates."""


@render_group.command("nightly")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Directory to write into.")
@click.option("--user", default="slurmgpu", show_default=True, help="Account the nightly job runs as.")
@click.option("--config-path", default="/etc/slurmgpu/slurmgpu.toml", show_default=True)
@click.option("--at", "at", default="03:17", show_default=True, help="Local time of day, HH:MM.")
@click.option("--log", default="/var/log/slurmgpu/nightly.log", show_default=True)
@click.option("--timeout", default="4h", show_default=True,
              help="Stop a nightly run after this long (N, Ns, Nm or Nh): a hung sacct, database or spool "
                   "must not hold every later night.")
def render_nightly(out: str, user: str, config_path: str, at: str, log: str, timeout: str) -> None:
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
    for name, value in (("--user", user), ("--config-path", config_path), ("--log", log)):
        if not _re.fullmatch(r"[A-Za-z0-9_./@-]+", value):
            fail(InputError(f"unsafe characters in {value!r}", option=name))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    values = {"user": user, "config": config_path, "bin": os.path.abspath(shutil.which("slurmgpu") or sys.argv[0]),
              "on_calendar": f"*-*-* {int(m.group(1)):02d}:{m.group(2)}:00", "hour": int(m.group(1)),
              "minute": int(m.group(2)), "log": log, "timeout": timeout}
    os.makedirs(out, exist_ok=True)
    for template, target in (("slurmgpu-nightly.service.j2", "slurmgpu-nightly.service"),
                             ("slurmgpu-nightly.timer.j2", "slurmgpu-nightly.timer"),
                             ("slurmgpu.cron.j2", "slurmgpu.cron")):
        path = os.path.join(out, target)
        write_file(path, env.get_template(f"nightly/{template}").render(**values).encode())
