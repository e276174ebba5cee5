"""Admin commands for the decision daemon and its slurmctld hook: ``serve``, ``lua render``, ``render serve``.

"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from typing import Any

import click

from slurmgpu.apps.serve import DEFAULT_SOCKET
from slurmgpu.cli.common import db_url, fail, site_config, write_file
from slurmgpu.pipeline.errors import InputError

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]*$")  # partitions, accounts, users, groups
_PATH = re.compile(r"^/[A-Za-z0-9_./@+-]+$")


def _check(option: str, value: str, pattern: re.Pattern[str] = _PATH) -> str:
    if not pattern.match(value) or "/../" in value + "/":
        fail(InputError(f"unsafe or malformed value {value!r}", option=option))
    return value


def _names(option: str, value: str | None) -> list[str]:
    return [_check(option, v.strip(), _NAME) for v in (value or "").split(",") if v.strip()]


def lua_string(value: object) -> str:
    """A Lua 5.1 string literal of any text: printable ASCII as is, every other byte as ``\\ddd``."""
    return '"' + "".join(chr(b) if 0x20 <= b < 0x7F and chr(b) not in '"\\' else f"\\{b:03d}"
                         for b in str(value).encode("utf-8", "surrogateescape")) + '"'


def lua_set(names: list[str]) -> str:
    return "{" + ", ".join(f"[{lua_string(n)}] = true" for n in names) + "}"


def lua_site(config: Any) -> str:
    """The config's GPU types and partitions as a Lua table (every name an escaped string)."""
    parts = ",\n".join(
        f"        [{lua_string(p.name)}] = {{ types = {lua_set(list(p.gpu_types))}, per_node = {int(p.gpus_per_node)}, "
        f"total = {int(p.gpus_per_node) * int(p.nodes)} }}" for p in config.partitions.values())
    return (f"{{\n    types = {lua_set(list(config.gpu_types))},\n    partitions = {{\n{parts},\n    }},\n}}"
            if parts else f"{{ types = {lua_set(list(config.gpu_types))}, partitions = {{}} }}")


def _uid(name: str) -> str | None:
    import pwd

    try:
        return str(pwd.getpwnam(name).pw_uid)
    except KeyError:
        return None


def lua_modes(config: Any) -> str:
    """The config's modes as a Lua table; users by uid (slurmctld's authenticated one), resolved now."""
    modes = config.modes
    uids = {}
    for name, mode in modes.users.items():
        uid = _uid(name)
        if uid is None:
            click.echo(f"warning: user {name} in [policy.modes] users is unknown here: the hook cannot match it "
                       "(render on a host with the cluster's users)", err=True)
        else:
            uids[uid] = mode

    def table(entries: dict[str, str]) -> str:
        return "{" + ", ".join(f"[{lua_string(k)}] = {lua_string(v)}" for k, v in sorted(entries.items())) + "}"

    return (f"{{\n    default = {lua_string(modes.default)},\n    uids = {table(uids)},\n"
            f"    accounts = {table(dict(modes.accounts))},\n    partitions = {table(dict(modes.partitions))},\n}}")


def lua_waivers(config: Any) -> str:
    """The config's waivers as a Lua list (a user's by uid; the text is the reason the hook logs)."""
    rows = []
    for w in config.waivers:
        who = f"account = {lua_string(w.account)}" if w.account is not None else None
        if w.user is not None:
            uid = _uid(w.user)
            if uid is None:
                click.echo(f"warning: waiver for user {w.user} is unknown here: the hook cannot match it", err=True)
                continue
            who = f"uid = {lua_string(uid)}"
        rows.append(f"    {{ {who}, family = {lua_string(w.family)}, expires = {lua_string(w.expires.isoformat())}, "
                    f"text = {lua_string(w.text())} }},")
    return "{\n" + "\n".join(rows) + "\n}" if rows else "{}"


NO_MODES = '{ default = "rewrite", uids = {}, accounts = {}, partitions = {} }'


def render(template: str, **values: Any) -> str:
    import jinja2

    from slurmgpu.pipeline.rewrite import templates_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters.update(lua=lua_string, lua_set=lua_set)
    return env.get_template(template).render(**values)


def _write(path: str, text: str) -> None:
    write_file(path, text.encode())


@click.command("serve")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True, envvar="SLURMGPU_SOCKET",
              help="Unix socket to listen on (its directory is made root-owned 0755 if missing).")
@click.option("--mode", default="0660", show_default=True, help="Socket file mode, octal.")
@click.option("--group", default="slurm", show_default=True,
              help="Group of the socket file: its members may ask ('' for none).")
@click.option("--slurm-user", default="slurm", show_default=True,
              help="slurmctld's SlurmUser, always allowed to ask ('' for none).")
@click.option("--model", metavar="PATH",
              help="Model bundle (default: $SLURMGPU_MODEL, the config's site.model_path, then the personal one).")
@click.option("--run-as", metavar="USER", help="Once the socket is bound, drop root and run as USER.")
@click.option("--reload-s", type=click.FloatRange(0.2, 300), default=2.0, show_default=True,
              help="How often the model file is checked for a new version.")
@click.option("--workers", type=click.IntRange(1, 256), default=None,
              help="Worker processes answering on the socket (default: one per core; 1: a single process).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), metavar="N",
              help="Serve Prometheus metrics at http://ADDRESS:N/metrics (docs/admins/metrics.md).")
@click.option("--metrics-address", default="127.0.0.1", show_default=True,
              help="Address the metrics port listens on.")
@click.option("--metrics-dir", metavar="DIR",
              help="Where each process keeps its metric values (made 0700; emptied at start). "
                   "Default: a new private temporary directory.")
@click.pass_context
def serve_cmd(ctx: click.Context, socket_path: str, mode: str, group: str, slurm_user: str, model: str | None,
              run_as: str | None, reload_s: float, workers: int | None, metrics_port: int | None,
              metrics_address: str, metrics_dir: str | None) -> None:
    """Answer GPU decisions on a Unix socket, for job_submit.lua and gsbatch (until SIGTERM).

    One JSON object per line: {"op": "decide", "job": {...}} or {"op": "health"}; see
    `pydoc slurmgpu.apps.serve` for the fields. One log line per decision goes to stderr.
    With several workers, SIGHUP reloads the model and replaces them without dropping a request.
    """
    from slurmgpu.apps import serve, serve_socket, serve_workers
    from slurmgpu.apps.site import model_path
    from slurmgpu.pipeline.queue import GpuLedger
    from slurmgpu.pipeline.sbatch_options import release_of, use_slurm_version
    from slurmgpu.slurm.backend import SlurmError, select_backend
    from slurmgpu.slurm.partitions import read_partitions

    try:
        file_mode = int(mode, 8)
    except ValueError:
        file_mode = -1
    if not 0 <= file_mode <= 0o777:
        fail(InputError(f"invalid mode {mode!r} (expected octal, e.g. 0660)", option="--mode"))
    config = site_config(ctx)
    assert config is not None
    temporary = False  # the metrics directory is a temporary one of this run
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s slurmgpu serve: %(message)s")
    try:
        access = serve_socket.access_for(group, slurm_user, run_as)
        backend = select_backend()  # pyslurm when it matches the running Slurm (docs/admins/pyslurm.md)
        try:  # requests' options are read as this Slurm's sbatch reads them
            use_slurm_version(release_of(backend.version()))
        except SlurmError:
            use_slurm_version(None)
        # The hook's decisions are recorded in the site's submission spool (lineage), when there is one.
        spool = os.environ.get("SLURMGPU_SUBMISSION_SPOOL") or config.site.submission_spool
        service = serve.Service(config, model or model_path(config, os.environ), backend.free_gpus, reload_s,
                                partitions=read_partitions,
                                queue=lambda: GpuLedger.from_queue(backend.nodes(), backend.queue()),
                                record_spool=os.path.expanduser(spool) if spool else None,
                                database_url=db_url(ctx))  # seff, jobs, report for users who cannot read it
        workers = workers or serve_workers.default_workers()
        if workers > 1:
            supervisor = serve_workers.Supervisor(socket_path, service, access, file_mode, workers)
        else:
            server = serve_socket.Server(socket_path, service, access, file_mode)
        if metrics_port is not None:
            temporary = metrics_dir is None
            metrics_dir = _start_metrics(metrics_address, metrics_port, metrics_dir, run_as)
        elif metrics_dir is not None:
            raise InputError("needs --metrics-port", option="--metrics-dir")
    except (InputError, OSError) as exc:
        fail(exc)
    try:
        if workers > 1:
            supervisor.run(run_as)  # metrics, when on, are enabled above: before any worker is forked
        else:
            serve_socket.run(server, run_as)
    finally:
        if temporary and metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _start_metrics(address: str, port: int, directory: str | None, run_as: str | None) -> str:
    """Count decisions and serve them on ADDRESS:PORT, bound now (before --run-as drops root); the
    values' directory, a private temporary one unless given."""
    import pwd
    import tempfile

    from slurmgpu.apps import metrics

    owner = pwd.getpwnam(run_as).pw_uid if run_as else None
    directory = os.path.abspath(directory) if directory else tempfile.mkdtemp(prefix="slurmgpu-metrics-")
    metrics.enable(directory, owner)
    try:
        metrics.serve_http(address, port)
    except OSError as exc:
        raise InputError(f"cannot listen on {address}:{port}: {exc.strerror or exc}", option="--metrics-port") \
            from None
    logging.getLogger("slurmgpu.apps.serve").info("metrics on http://%s:%d/metrics", address, port)
    return directory


@click.group("lua")
def lua_group() -> None:
    """The job_submit.lua hook: slurmctld asks `slurmgpu serve` about each GPU batch job."""


@lua_group.command("render")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="File to write: /etc/slurm/job_submit.lua.")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True, help="The daemon's socket.")
@click.option("--timeout-ms", type=click.IntRange(10, 5000), default=200, show_default=True,
              help="Longest slurmctld waits for the daemon, per job.")
@click.option("--backoff-s", type=click.IntRange(0, 3600), default=10, show_default=True,
              help="After a failure, jobs pass through without asking for this long.")
@click.option("--dry-run", is_flag=True, help="Log what would change; change no job.")
@click.option("--partitions", metavar="P,Q", help="Only jobs in these partitions (default: all).")
@click.option("--accounts", metavar="A,B", help="Only jobs of these accounts (default: all).")
@click.option("--users", metavar="U,V", help="Only jobs of these users, names or uids (default: all).")
@click.option("--disabled", is_flag=True, help="Render a hook that passes every job through.")
@click.pass_context
def lua_render(ctx: click.Context, out: str, socket_path: str, timeout_ms: int, backoff_s: int, dry_run: bool,
               partitions: str | None, accounts: str | None, users: str | None, disabled: bool) -> None:
    """Write job_submit.lua for slurmctld (needs Debian's lua-socket on the slurmctld host).

    The site config's GPU types and partitions are written into the hook, which checks every
    answer of the daemon against them; render again when they change. Without a config the hook
    applies no answer."""
    from slurmgpu.apps.site import DECIDED_MARKER, DECIDED_WINDOW_S
    from slurmgpu.pipeline.config import find_config, load_config

    root = ctx.find_root().obj
    path = find_config(root.get("config_path") if isinstance(root, dict) else None)
    site, modes, waivers = "nil", NO_MODES, "{}"
    if path is None:
        click.echo("warning: no slurmgpu config found: the hook will apply no answer (pass --config)", err=True)
    else:
        try:
            config = load_config(path)
        except InputError as exc:
            fail(exc)
        site, modes, waivers = lua_site(config), lua_modes(config), lua_waivers(config)
    text = render("lua/job_submit.lua.j2", site=site, modes=modes, waivers=waivers,
                  enabled=str(not disabled).lower(), dry_run=str(dry_run).lower(),
                  socket=_check("--socket", socket_path), timeout_ms=timeout_ms, backoff_s=backoff_s,
                  marker=DECIDED_MARKER, marker_window_s=DECIDED_WINDOW_S,
                  partitions=_names("--partitions", partitions), accounts=_names("--accounts", accounts),
                  users=_names("--users", users))
    _write(out, text)


@click.command("serve")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Directory to write into.")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True)
@click.option("--group", default="slurm", show_default=True, help="Group whose members may ask.")
@click.option("--run-as", default="slurmgpu", show_default=True, help="Account the daemon runs as once bound.")
@click.option("--config-path", default="/etc/slurmgpu/slurmgpu.toml", show_default=True)
@click.option("--bin", "bin_path", help="The slurmgpu executable (default: the one on PATH).")
@click.option("--spool", default="/var/spool/slurmgpu/submissions", show_default=True,
              help="The config's submission spool, where the daemon records the hook's decisions ('' for none).")
def render_serve_cmd(out: str, socket_path: str, group: str, run_as: str, config_path: str,
                     bin_path: str | None, spool: str) -> None:
    """Write slurmgpu-serve.service, the systemd unit of the decision daemon."""
    socket_dir = os.path.dirname(_check("--socket", socket_path))
    runtime = socket_dir.removeprefix("/run/") if re.fullmatch(r"/run/[A-Za-z0-9_.-]+", socket_dir) else None
    text = render("systemd/slurmgpu-serve.service.j2", socket=socket_path, socket_dir=socket_dir,
                  runtime_dir=runtime, group=_check("--group", group, _NAME),
                  run_as=_check("--run-as", run_as, _NAME), config=_check("--config-path", config_path),
                  bin=_check("--bin", bin_path or os.path.abspath(shutil.which("slurmgpu") or sys.argv[0])),
                  spool=_check("--spool", spool) if spool else None)
    os.makedirs(out, exist_ok=True)
    _write(os.path.join(out, "slurmgpu-serve.service"), text)
