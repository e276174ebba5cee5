"""`slurmgpu train`, `evaluate`, `predict` and `nightly`: the models."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from slurmgpu.cli.common import current_user, fail, history_engine, model_path, site_config, status
from slurmgpu.cli.history import ingest_cmd
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import read_script


@click.command("train")
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

    config = site_config(ctx)
    assert config is not None
    engine = history_engine(ctx)
    rows = train.history_rows(engine)
    train_rows, test_rows = train.split_by_time(rows, test_days) if test_days else (rows, [])
    click.echo(f"{len(rows)} GPU jobs with script features: {len(train_rows)} to train, {len(test_rows)} held out")
    try:
        with status("training") as say:
            bundle, _ = train.fit(train_rows, config, quantile, iterations, progress=say)
    except ValueError as exc:
        fail(InputError(str(exc)))
    metrics = registry.metrics(bundle, train_rows, test_rows, config) if test_rows else {}
    bundle.data["metrics"] = metrics
    path = model_path(ctx)
    evaluated = metrics.get("memory_under_prediction_rate") is not None or metrics.get("runtime_mdape") is not None
    if keep_better and not evaluated and os.path.exists(path):
        # A model never measured on held-out jobs does not replace one in use (it may be worse).
        registry.register(engine, bundle, path, active=False)
        click.echo(f"new model not evaluated (no held-out jobs with outcomes to measure it on: --test-days): "
                   f"kept {path}")
        return
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
                     f"{metrics['memory_jobs']} jobs"
                     + (f" (bound's median error {metrics['memory_bound_median_error']:.1%})"
                        if metrics.get("memory_bound_median_error") is not None else ""))
    if metrics.get("runtime_mdape") is not None:
        parts.append(f"runtime MdAPE {metrics['runtime_mdape']:.1%} on {metrics['runtime_jobs']} jobs")
    decided = metrics.get("decider") or {}
    if decided.get("replayed"):
        parts.append(f"decisions replayed on {decided['replayed']} jobs: {decided['placed_no_fit']} placed where "
                     f"they do not fit, {decided['oom_decided']} GPU OOM ({decided['oom_as_asked']} as asked)")
    return ", ".join(parts)


@click.command("evaluate")
@click.option("--test-days", type=click.FloatRange(min=0.01), default=7, show_default=True,
              help="The held-out window: the last N days of history.")
@click.option("--model", "model_file", type=click.Path(dir_okay=False), default=None,
              help="A model file to score instead of the installed one (e.g. a past version's).")
@click.option("--version", "version", type=click.IntRange(min=1), default=None,
              help="Score this registered model version (see the model_versions table).")
@click.option("--hold-out-families", "family_share", type=click.FloatRange(0.0, 0.9, min_open=True), default=None,
              help="Also train a model without this share of the families (drawn by their key) and replay "
                   "the decider on their jobs: how it decides work it has never seen.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def evaluate_cmd(ctx: click.Context, test_days: float, model_file: str | None, version: int | None,
                 family_share: float | None, as_json: bool) -> None:
    """Evaluate a model on the last N days of history (held out by time): its numbers, the deployed
    decider replayed on each held-out job and judged by what the history measured, and how the
    decisions this version actually made (recorded by gsbatch and the hook) ended."""
    from slurmgpu.learning import evaluation, registry, train
    from slurmgpu.pipeline.bundle import Bundle

    config = site_config(ctx)
    assert config is not None
    engine = history_engine(ctx)
    if model_file and version:
        fail(InputError("--model and --version name two models: give one"))
    path = model_file or model_path(ctx)
    if version:
        found = registry.version_path(engine, version)
        if found is None:
            fail(InputError(f"--version {version}: no such registered model version"))
        path = str(found)
    try:
        bundle = Bundle.load(path)
    except (OSError, ValueError) as exc:
        fail(InputError(f"model unusable: {exc}", file=path))
    train_rows, test_rows = train.split_by_time(train.history_rows(engine), test_days)
    from slurmgpu.history.queries import decision_rows

    made = evaluation.recorded(decision_rows(engine, model_version=bundle.digest, limit=1_000_000))
    metrics = {**train.evaluate(bundle, train_rows, test_rows, config), "model_version": bundle.digest,
               "decider": evaluation.replay(bundle, config, train_rows, test_rows), "recorded": made}
    lines = [f"model {bundle.digest} ({path})",
             _fmt({k: v for k, v in metrics.items() if k != "decider"}) or "no held-out jobs",
             *evaluation.summary(metrics["decider"]), *evaluation.recorded_summary(made)]
    if family_share is not None:
        metrics["unseen_families"] = unseen = _unseen_families(config, [*train_rows, *test_rows], family_share)
        lines += [f"families held out of a model trained without them: {unseen['families']} of "
                  f"{unseen['families_in_history']}", *evaluation.summary(unseen["decider"])]
    click.echo(json.dumps(metrics, indent=2) if as_json else "\n".join(lines))


def _unseen_families(config: Any, rows: list[dict[str, Any]], share: float) -> dict[str, Any]:
    """The deployed decider on families its model never saw: a model trained (as ``train`` does)
    on the other families' jobs, replayed on the held-out families' jobs (``train.split_by_family``)."""
    from slurmgpu.learning import evaluation, train

    seen_rows, unseen_rows, held = train.split_by_family(rows, share)
    try:
        with status("training without the held-out families") as say:
            bundle, _ = train.fit(seen_rows, config, progress=say)
    except ValueError as exc:
        fail(InputError(f"--hold-out-families: {exc}"))
    return {"families": len(held), "families_in_history": len({r["script"]["family"] for r in rows}),
            "jobs": len(unseen_rows), "held_out": held,
            "decider": evaluation.replay(bundle, config, seen_rows, unseen_rows)}


@click.command("predict", context_settings={"ignore_unknown_options": True})
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("sbatch_options", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def predict_cmd(ctx: click.Context, script: str, sbatch_options: tuple[str, ...]) -> None:
    """Print (JSON) what the model decides for SCRIPT, with its numbers per candidate type."""
    from slurmgpu.apps.site import cached_queue
    from slurmgpu.pipeline.bundle import Bundle
    from slurmgpu.pipeline.policy import ModelDecider
    from slurmgpu.slurm.backend import CliBackend

    config = site_config(ctx)
    assert config is not None
    path = model_path(ctx)
    try:
        bundle = Bundle.load(path)
        request = build_request(read_script(script), sbatch_options, os.environ, config.gpu_features())
    except (OSError, ValueError) as exc:
        fail(exc if isinstance(exc, InputError) else InputError(f"model unusable: {exc}", file=path))
    wait, capacity = cached_queue(CliBackend(), os.environ)
    decision = ModelDecider(config, bundle, lambda: {}, current_user(), wait=wait, capacity=capacity).decide(request)
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


@click.command("nightly")
@click.option("--metrics-textfile", metavar="PATH.prom", type=click.Path(dir_okay=False),
              help="Write the run's Prometheus metrics here for node_exporter's textfile collector "
                   "(0644, replaced atomically; docs/admins/metrics.md).")
@click.pass_context
def nightly_cmd(ctx: click.Context, metrics_textfile: str | None) -> None:
    """Ingest (sacct and spools), then retrain, keeping the old model if the new one is worse."""
    import time

    started, ok = time.time(), False
    try:
        _nightly(ctx)
        ok = True
    finally:
        if metrics_textfile:
            _nightly_metrics(ctx, metrics_textfile, ok, started)


def _nightly_metrics(ctx: click.Context, path: str, ok: bool, started: float) -> None:
    """The run's outcome and the installed model's version and evaluation, as a textfile."""
    import time

    from slurmgpu.apps import metrics
    from slurmgpu.pipeline.bundle import Bundle

    try:
        model = Bundle.load(model_path(ctx))
    except (OSError, ValueError, KeyError):
        model = None  # none installed yet: the run's outcome alone
    try:
        metrics.write_textfile(path, metrics.nightly_registry(ok, started, time.time(), model))
    except OSError as exc:
        fail(InputError(f"cannot write: {exc.strerror}", file=path))


def _nightly(ctx: click.Context) -> None:
    from datetime import datetime

    def log(msg: str) -> None:
        click.echo(f"{datetime.now().isoformat(timespec='seconds')} slurmgpu nightly: {msg}")

    log("ingest")
    try:
        ctx.invoke(ingest_cmd, spool=True, delimiter="|")
    except SystemExit as exc:
        if exc.code not in (0, None, 1):  # 2: the store is locked or unreachable, nothing to train on
            log(f"ingest failed (exit {exc.code}); not training")
            raise
        if exc.code == 1:
            log("ingest finished with rejected rows (exit 1); training on what landed")
    log("train")
    ctx.invoke(train_cmd, test_days=7, quantile=0.995, iterations=400, keep_better=True)
    log("done")
