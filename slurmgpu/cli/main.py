"""The ``slurmgpu`` admin and user command (click)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from typing import Any, NoReturn

import click

from slurmgpu import __version__
from slurmgpu.pipeline.config import Config, find_config, load_config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import read_script
from slurmgpu.slurm.backend import SlurmError, select_backend


def fail(exc: Exception) -> NoReturn:
    click.echo(f"slurmgpu: error: {exc}", err=True)
    sys.exit(1 if isinstance(exc, InputError) else 2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurmgpu")
@click.option("--config", "config_path", metavar="PATH", envvar=None,
              help="Config file (default: $SLURMGPU_CONFIG, then /etc/slurmgpu/slurmgpu.toml).")
@click.option("--db", "db_url", metavar="URL",
              help="Database URL (default: $SLURMGPU_DB_URL, the config's site.database_url, "
                   "then ~/.local/share/slurmgpu/slurmgpu.db).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, db_url: str | None) -> None:
    """Put the right GPUs under every Slurm job."""
    ctx.obj = {"config_path": config_path, "db_url": db_url}


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


def _db_url(ctx: click.Context) -> str:
    from slurmgpu.history.db import resolve_url

    if ctx.obj["db_url"] or os.environ.get("SLURMGPU_DB_URL"):
        return resolve_url(ctx.obj["db_url"])
    config = _config(ctx, required=False)
    return resolve_url(config.site.database_url if config else None)


def _engine(ctx: click.Context, migrated: bool = True) -> Any:
    from slurmgpu.history import db

    url = _db_url(ctx)
    if migrated:
        try:
            current, head = db.current_revision(url), db.head_revision()
        except Exception as exc:  # noqa: BLE001 - any driver error is the same message to the user
            fail(InputError(f"database {_safe(url)} unreachable: {type(exc).__name__}: {str(exc).splitlines()[0]}"))
        if current != head:
            fail(InputError(f"database {_safe(url)} is at revision {current or 'none'}, code needs {head}: "
                            "run `slurmgpu db upgrade`"))
    return db.make_engine(url)


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@main.group("db")
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

    url = _db_url(ctx)
    getattr(db, direction)(url, revision)
    click.echo(f"{_safe(url)}: at revision {db.current_revision(url) or 'base'}")


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

    url = _db_url(ctx)
    current, head = db.current_revision(url), db.head_revision()
    click.echo(f"{_safe(url)}: at revision {current or 'none'} (code: {head})")
    if current != head:
        sys.exit(1)


@main.command("ingest")
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

    config = _config(ctx, required=False)
    cluster = cluster or (config.site.cluster if config else None) or "default"
    engine = _engine(ctx)
    try:
        columns = sacct.format_fields(fields) if fields else None
    except ValueError as exc:
        fail(InputError(str(exc), option="--format"))
    with _progress() as advance:
        if from_file:
            report = _ingest_file(engine, from_file, columns, delimiter, cluster, advance)
        else:
            try:
                report = ingest.ingest_sacct(engine, cluster, _to_utc(since), _to_utc(until), on_chunk=advance)
            except (RuntimeError, OSError) as exc:
                fail(exc)
    if spool:
        site = config.site if config else None
        ingest.load_submissions(engine, submission_spool(site.submission_spool if site else None, os.environ), report)
        ingest.load_gpu_records(engine, gpu_spool(site.gpu_spool if site else None, os.environ), report)
    for err in report.errors[:20]:
        click.echo(f"slurmgpu: rejected {from_file or 'sacct'}:{err.line}: {err.message}", err=True)
    if len(report.errors) > 20:
        click.echo(f"slurmgpu: ... and {len(report.errors) - 20} more rejected rows", err=True)
    for item in report.files_rejected:
        click.echo(f"slurmgpu: rejected spool record {item}", err=True)
    click.echo(report.summary())
    if report.errors or report.files_rejected:
        sys.exit(1)


def _to_utc(t: Any) -> Any:
    """A naive local time typed by the user, as naive UTC."""
    return t.astimezone(UTC).replace(tzinfo=None) if t else None


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


@contextmanager
def _progress() -> Iterator[Any]:
    """A rich progress counter on a terminal; silent in cron and tests."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.completed:,} jobs loaded"), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task("ingest", total=None)
        yield lambda n: bar.advance(task, n)


@main.command("jobs")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job, as a list.")
@click.option("--user", help="Only this user's jobs (non-root users can only ask for their own).")
@click.option("--since", type=click.DateTime(), help="Only jobs submitted at or after this local time.")
@click.option("--job", "job_ids", multiple=True, help="Only this job id (as sacct prints it); repeatable.")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True)
@click.pass_context
def jobs_cmd(ctx: click.Context, as_json: bool, user: str | None, since: Any, job_ids: tuple[str, ...],
             limit: int) -> None:
    """Read the stored history back."""
    from slurmgpu.history.queries import job_rows

    me = _current_user()
    if os.geteuid() != 0:
        if user and user != me:
            fail(InputError(f"you may only list your own jobs, not {user}'s", option="--user"))
        user = me
    rows = job_rows(_engine(ctx), user=user, since=_to_utc(since), job_ids=job_ids, limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("job_id", "user", "partition", "state", "gpus", "elapsed_s", "peak_gpu_mem_mib", "max_gpu_util")
    for r in rows:
        gpus = f"{r['gpu_count']} x {r['gpu_type'] or 'any'}" if r["gpu_count"] else "-"
        table.add_row(r["job_id"], r["user"] or "", r["partition"] or "", r["state"], gpus,
                      str(r["elapsed_s"] if r["elapsed_s"] is not None else ""),
                      f"{r['peak_gpu_mem_mib']:.0f}" if r["peak_gpu_mem_mib"] is not None else "",
                      f"{r['max_gpu_util']:.0f}" if r["max_gpu_util"] is not None else "")
    Console().print(table)


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _model_path(ctx: click.Context) -> str:
    from slurmgpu.apps.gsbatch import model_path

    return model_path(_config(ctx, required=False), os.environ)


@main.command("train")
@click.option("--test-days", type=click.FloatRange(min=0), default=7, show_default=True,
              help="Hold out the last N days of history for evaluation (0: none).")
@click.option("--quantile", type=click.FloatRange(0.5, 0.999), default=0.995, show_default=True,
              help="Quantile of peak GPU memory the memory model predicts.")
@click.option("--iterations", type=click.IntRange(min=10), default=400, show_default=True)
@click.option("--keep-better/--always-replace", default=True, show_default=True,
              help="Keep the current model when the new one evaluates worse on the same held-out jobs.")
@click.pass_context
def train_cmd(ctx: click.Context, test_days: float, quantile: float, iterations: int, keep_better: bool) -> None:
    """Train the memory and runtime models from the history database and register a version."""
    from slurmgpu.learning import registry, train

    config = _config(ctx)
    assert config is not None
    engine = _engine(ctx)
    rows = train.history_rows(engine)
    train_rows, test_rows = train.split_by_time(rows, test_days) if test_days else (rows, [])
    click.echo(f"{len(rows)} GPU jobs with script features: {len(train_rows)} to train, {len(test_rows)} held out")
    try:
        with _status("training") as say:
            bundle, _ = train.fit(train_rows, config, quantile, iterations, progress=say)
    except ValueError as exc:
        fail(InputError(str(exc)))
    metrics = train.evaluate(bundle, train_rows, test_rows, config) if test_rows else {}
    bundle.data["metrics"] = metrics
    path = _model_path(ctx)
    old = registry.current_metrics(path, train_rows, test_rows, config) if keep_better and test_rows else None
    if old is not None and registry.worse(metrics, old):
        click.echo(f"new model evaluates worse than the current one ({_fmt(metrics)} vs {_fmt(old)}): kept {path}")
        registry.register(engine, bundle, path, active=False)
        return
    version = registry.register(engine, bundle, path, active=True)
    click.echo(f"model version {version} written to {path}: {_fmt(metrics) or 'no held-out evaluation'}")


def _fmt(metrics: dict[str, Any]) -> str:
    parts = []
    if metrics.get("memory_under_prediction_rate") is not None:
        parts.append(f"memory under-predicted on {metrics['memory_under_prediction_rate']:.2%} of "
                     f"{metrics['memory_jobs']} jobs")
    if metrics.get("runtime_mdape") is not None:
        parts.append(f"runtime MdAPE {metrics['runtime_mdape']:.1%} on {metrics['runtime_jobs']} jobs")
    return ", ".join(parts)


@contextmanager
def _status(what: str) -> Iterator[Any]:
    if not sys.stderr.isatty():
        yield lambda s: None
        return
    from rich.console import Console

    with Console(stderr=True).status(what) as status:
        yield lambda s: status.update(f"{what}: {s}")


@main.command("evaluate")
@click.option("--test-days", type=click.FloatRange(min=0.01), default=7, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def evaluate_cmd(ctx: click.Context, test_days: float, as_json: bool) -> None:
    """Evaluate the current model on the last N days of history (held out by time)."""
    from slurmgpu.learning import train
    from slurmgpu.pipeline.bundle import Bundle

    config = _config(ctx)
    assert config is not None
    path = _model_path(ctx)
    try:
        bundle = Bundle.load(path)
    except (OSError, ValueError) as exc:
        fail(InputError(f"model unusable: {exc}", file=path))
    train_rows, test_rows = train.split_by_time(train.history_rows(_engine(ctx)), test_days)
    metrics = train.evaluate(bundle, train_rows, test_rows, config)
    click.echo(json.dumps(metrics, indent=2) if as_json else _fmt(metrics) or "no held-out jobs")


@main.command("predict", context_settings={"ignore_unknown_options": True})
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("sbatch_options", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def predict_cmd(ctx: click.Context, script: str, sbatch_options: tuple[str, ...]) -> None:
    """Print (JSON) what the model decides for SCRIPT, with its numbers per candidate type."""
    from slurmgpu.apps.gsbatch import cached_free_gpus
    from slurmgpu.pipeline.bundle import Bundle
    from slurmgpu.pipeline.policy import ModelDecider
    from slurmgpu.slurm.backend import CliBackend

    config = _config(ctx)
    assert config is not None
    path = _model_path(ctx)
    try:
        bundle = Bundle.load(path)
        request = build_request(read_script(script), sbatch_options, os.environ, config.gpu_features())
    except (OSError, ValueError) as exc:
        fail(exc if isinstance(exc, InputError) else InputError(f"model unusable: {exc}", file=path))
    decision = ModelDecider(config, bundle, cached_free_gpus(CliBackend(), os.environ), _current_user()) \
        .decide(request)
    change = decision.changes[0] if decision.changes else None
    main_req = request.main
    click.echo(json.dumps({
        "decision": {
            "gpu_type": (change.gpu_type if change and change.gpu_type else main_req.gpu_type),
            "gpu_count": (change.gpus_total if change and change.gpus_total else main_req.gpus_total),
            "partition": (change.partition if change and change.partition else main_req.partition),
            "changed": decision.changed, "refused": decision.refusal, "reasons": list(decision.reasons),
        },
        "per_type": [c._asdict() for c in decision.per_type],
    }, indent=2))


@main.command("nightly")
@click.pass_context
def nightly_cmd(ctx: click.Context) -> None:
    """Ingest (sacct and spools), then retrain, keeping the old model if the new one is worse."""
    from datetime import datetime

    def log(msg: str) -> None:
        click.echo(f"{datetime.now().isoformat(timespec='seconds')} slurmgpu nightly: {msg}")

    log("ingest")
    try:
        ctx.invoke(ingest_cmd, spool=True, delimiter="|")
    except SystemExit as exc:
        if exc.code not in (0, None):
            log(f"ingest finished with rejected rows (exit {exc.code}); training on what landed")
    log("train")
    ctx.invoke(train_cmd, test_days=7, quantile=0.995, iterations=400, keep_better=True)
    log("done")


@main.group("render")
def render_group() -> None:
    """Render admin files (nightly units, cron) from the templates."""


@render_group.command("nightly")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Directory to write into.")
@click.option("--user", default="slurmgpu", show_default=True, help="Account the nightly job runs as.")
@click.option("--config-path", default="/etc/slurmgpu/slurmgpu.toml", show_default=True)
@click.option("--at", "at", default="03:17", show_default=True, help="Local time of day, HH:MM.")
@click.option("--log", default="/var/log/slurmgpu/nightly.log", show_default=True)
def render_nightly(out: str, user: str, config_path: str, at: str, log: str) -> None:
    """Write slurmgpu-nightly.service, slurmgpu-nightly.timer and slurmgpu.cron."""
    import re as _re
    import shutil

    import jinja2

    from slurmgpu.pipeline.rewrite import templates_dir

    m = _re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", at)
    if not m:
        fail(InputError(f"invalid time of day {at!r} (expected HH:MM)", option="--at"))
    for name, value in (("--user", user), ("--config-path", config_path), ("--log", log)):
        if not _re.fullmatch(r"[A-Za-z0-9_./@-]+", value):
            fail(InputError(f"unsafe characters in {value!r}", option=name))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    values = {"user": user, "config": config_path, "bin": os.path.abspath(shutil.which("slurmgpu") or sys.argv[0]),
              "on_calendar": f"*-*-* {int(m.group(1)):02d}:{m.group(2)}:00", "hour": int(m.group(1)),
              "minute": int(m.group(2)), "log": log}
    os.makedirs(out, exist_ok=True)
    for template, target in (("slurmgpu-nightly.service.j2", "slurmgpu-nightly.service"),
                             ("slurmgpu-nightly.timer.j2", "slurmgpu-nightly.timer"),
                             ("slurmgpu.cron.j2", "slurmgpu.cron")):
        path = os.path.join(out, target)
        with open(path, "w") as fh:
            fh.write(env.get_template(f"nightly/{template}").render(**values))
        click.echo(f"wrote {path}")


@main.command("demo")
def demo_cmd() -> None:
    """Show gsbatch's decisions on the example scripts (nothing is submitted)."""
    from slurmgpu.apps import demo

    demo.run()


from slurmgpu.cli.report import doctor_cmd, report_cmd  # noqa: E402 - they use the helpers above
from slurmgpu.cli.scenario import scenario_cmd  # noqa: E402
from slurmgpu.cli.serve import lua_group, render_serve_cmd, serve_cmd  # noqa: E402
from slurmgpu.cli.workload import history_group, workload_group  # noqa: E402

main.add_command(serve_cmd)
main.add_command(scenario_cmd)
main.add_command(lua_group)
render_group.add_command(render_serve_cmd)
main.add_command(report_cmd)
main.add_command(doctor_cmd)
main.add_command(history_group)
main.add_command(workload_group)

if __name__ == "__main__":
    main()
