"""The demo: a month of local history, then training, then gsbatch's decisions on new scripts.

Everything goes through the production paths: the workload generator writes sacct text,
collector records and batch scripts; ``slurmgpu ingest``'s loaders fill an embedded SQLite
store; submission records are dropped in the spool as gsbatch would; the models are trained and
registered; and gsbatch plans (``--dry-run``) are shown for the example scripts and for new runs
of families the history knows. Nothing is submitted.

A second model is trained on the same rows with every GPU-memory measurement removed, as a site
whose sacct has no ``gres/gpumem`` field and no collector sees its history: it learns memory from
outcomes alone (``memory_source: "outcomes"``). It is saved beside the first, never registered or
installed, and the new runs' decisions of both models are shown side by side.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from slurmgpu.apps.gsbatch import Invocation, plan
from slurmgpu.apps.site import local_decider, site_decider
from slurmgpu.history import db, ingest
from slurmgpu.learning import registry, train
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.features import hexdigest, script_features
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.rewrite import describe
from slurmgpu.pipeline.script import parse_script
from slurmgpu.pipeline.spool import new_record, write_record
from slurmgpu.slurm import sacct
from slurmgpu.slurm.backend import CliBackend, NodeInfo, QueuedJob

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "contrib" / "examples"
SAMPLE_CONFIG = ROOT / "contrib" / "slurmgpu.toml"
DAYS = 30
JOBS_PER_DAY = 120
END = datetime(2026, 11, 1)


def demo_config(out: Path) -> Path:
    """The sample config with the model decider and every site path inside ``out``."""
    text = SAMPLE_CONFIG.read_text()
    start, end = text.index("[site]"), text.index("[policy]")
    site = (f'[site]\ncluster = "slurmgpu"\ndatabase_url = "sqlite:///{out / "slurmgpu.db"}"\n'
            f'submission_spool = "{out / "spool" / "submissions"}"\ngpu_spool = "{out / "history" / "spool"}"\n'
            f'model_path = "{out / "model.json"}"\n\n')
    text = text[:start] + site + text[end:].replace('decider = "rules"', 'decider = "model"', 1)
    path = out / "slurmgpu.toml"
    path.write_text(text)
    return path


class _AtTheCut(CliBackend):
    """The demo's cluster as Slurm would show it at the cut, without a cluster: the generated
    month's jobs still running then (for the time their limit leaves them) or still queued."""

    def __init__(self, jobs: Sequence[Any], cut: datetime) -> None:
        from slurmgpu.simulation.workload import DEFAULT_CLUSTER
        from slurmgpu.simulation.workload.schedule import simulate

        super().__init__()
        self.cluster, self.cut = DEFAULT_CLUSTER, cut
        self.runs = [r for r in simulate(jobs, DEFAULT_CLUSTER) if r.end > cut]

    def nodes(self) -> list[NodeInfo]:
        return self.cluster.slurm_nodes()

    def queue(self) -> list[QueuedJob]:
        out = []
        for r in sorted(self.runs, key=lambda r: r.start):
            running = r.start <= self.cut
            seconds = r.job.time_limit_s - ((self.cut - r.start).total_seconds() if running else 0.0)
            out.append(QueuedJob(r.job.job_id, running, (r.host,) if running else (), seconds,
                                 {self.cluster.gres_name(r.gpu_type): r.gpus}, 1, r.partition))
        return out

    def free_gpus(self) -> dict[str, int]:
        busy: dict[str, int] = {}
        for r in self.runs:
            if r.start <= self.cut:
                busy[self.cluster.gres_name(r.gpu_type)] = busy.get(self.cluster.gres_name(r.gpu_type), 0) + r.gpus
        return {t: c - busy.get(t, 0) for n in self.nodes() for t, c in n.gpus.items()}


def without_gpu_memory(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same history rows as a site without GPU telemetry has them: no measured per-GPU peak
    (no ``gres/gpumem`` in sacct, no collector) and so no GPU OOM found in a job's stderr either;
    sacct's own state (OUT_OF_MEMORY, FAILED, ...) and everything else stay."""
    return [{**r, "peak": None, "gpu_oom": None} for r in rows]


def bound_check(bundle: Any, test_rows: Sequence[dict[str, Any]], config: Any) -> dict[str, int]:
    """The outcome model's memory rule against the peaks withheld from it, on held-out jobs of
    families it knows (at least ``min_history`` jobs): per job, the smallest card its family held
    on at this many tokens per GPU or more, on as many GPUs or fewer (``held_bound_gib``, what the
    decider moves a job by). ``under``: that card is below the job's true need (its measured peak,
    or, for a GPU OOM, more than the card it ran out on); ``no_bound``: no outcome covers the job
    (only its request as written can count as fitting)."""
    out = {"jobs": 0, "no_bound": 0, "under": 0}
    for r in test_rows:
        family = r["script"]["family"]
        oom = train.gpu_oom(r, config)
        if bundle.history.family(family).get("n", 0) < config.policy.min_history or not (r["peak"] or oom):
            continue
        out["jobs"] += 1
        bound = bundle.history.held_bound_gib(family, r["script"]["log_tokens"], max(int(r["gpus"]), 1))
        if bound is None:
            out["no_bound"] += 1
        elif oom:
            card = config.gpu_types[r["gpu_type"]].memory_gib if r["gpu_type"] in config.gpu_types else 0.0
            out["under"] += bound <= card
        else:
            out["under"] += bound * 1024 < r["peak"]
    return out


def _outcome(p: Any) -> str:
    """A plan's decision in a few words, then why: a change with every reason (the rules' and the
    model's), a kept request with the last."""
    d = p.decision
    if d.refusal:
        return f"[red]refused[/red]: {d.refusal}"
    if not d.changes:
        return f"[green]kept[/green]: {d.reasons[-1]}"
    c, comp = d.changes[0], p.request.main
    gtype, gpus = c.gpu_type or comp.gpu_type or "any type", c.gpus_total or comp.gpus_total
    where = f" in {c.partition}" if c.partition else ""
    return f"[yellow]{gpus} x {gtype}{where}[/yellow]: {'; '.join(d.reasons)}"


def _pct(x: float | None, fmt: str = ".1%") -> str:
    return "n/a" if x is None else format(x, fmt)


class History(NamedTuple):
    """The demo's generated month: what was submitted before the cut, what sacct holds at the cut
    (jobs that ended by then), and the next day's jobs, held back as new submissions."""

    submitted: list[Any]  # JobSpec
    emitted: Any  # workload.emit's Emitted: the runs written to sacct.txt and the spool
    held_back: list[Any]  # JobSpec
    cut: datetime  # naive UTC: the history is ingested at this moment


def generate_history(out: Path, seed: int = 1, days: int = DAYS, jobs_per_day: float = JOBS_PER_DAY,
                     end: datetime = END) -> History:
    """``days`` of jobs up to ``end`` on the local cluster; all but the last day written under ``out``
    as sacct text, collector records and scripts, as an ingest at the cut (``end`` - 1 day) sees them."""
    from slurmgpu.simulation.workload import DEFAULT_CLUSTER, emit, generate

    cut = end - timedelta(days=1)
    jobs = generate(DEFAULT_CLUSTER, end - timedelta(days=days), days, seed, jobs_per_day=jobs_per_day)
    history = [j for j in jobs if j.submit_time < cut]
    emitted = emit(str(out), history, DEFAULT_CLUSTER, until=cut)
    return History(history, emitted, [j for j in jobs if j.submit_time >= cut], cut)


def run(out: Path = ROOT / "demo-out", seed: int = 1, console: Console | None = None) -> dict[str, Any]:
    """Run the demo; returns the held-out metrics and gsbatch's plans (script -> decision)."""
    console = console or Console()
    shutil.rmtree(out, ignore_errors=True)
    (out / "spool" / "submissions").mkdir(parents=True)
    config_path = demo_config(out)
    config = load_config(config_path)
    url = config.site.database_url

    generated = generate_history(out / "history", seed)  # a fixed window, so the demo's numbers are reproducible
    history, held_back = generated.submitted, generated.held_back
    console.print(f"[bold]1. history[/bold]: {len(history)} jobs submitted over {DAYS - 1} days, "
                  f"{len(generated.emitted.runs)} of them ended by {generated.cut:%Y-%m-%d %H:%M} UTC, generated "
                  f"(scripts, sacct text, GPU collector records) in {out / 'history'}")

    for job in history:  # what gsbatch would have recorded at submission
        request = build_request(parse_script(job.script.encode(), job.job_id), [], {}, config.gpu_features())
        write_record(str(out / "spool" / "submissions"), new_record(
            cluster="slurmgpu", job_id=job.job_id, script_sha256=hexdigest("sha256", job.script.encode()),
            script_text=job.script, sbatch_exit=0,
            features={"script": script_features(job.script)}, original_request=request.to_json(),
            decision={"changed": False}, changed=False))
    db.upgrade(url)
    engine = db.make_engine(url)
    with open(out / "history" / "sacct.txt", encoding="utf-8") as fh:
        report = ingest.load_jobs(engine, sacct.parse_lines(fh, sacct.FIELDS, "|", "slurmgpu"))
    ingest.load_submissions(engine, str(out / "spool" / "submissions"), report)
    ingest.load_gpu_records(engine, config.site.gpu_spool or "", report)
    console.print(f"[bold]2. ingest[/bold] into {url}: {report.summary()}")

    rows = train.history_rows(engine)
    train_rows, test_rows = train.split_by_time(rows, 5)
    bundle, _ = train.fit(train_rows, config)
    metrics = train.evaluate(bundle, train_rows, test_rows, config)
    bundle.data["metrics"] = metrics
    version = registry.register(engine, bundle, config.site.model_path or "", active=True)
    console.print(f"[bold]3. train[/bold] (with telemetry): model version {version} on {len(train_rows)} jobs; "
                  f"last 5 days held out ({metrics['memory_jobs']} jobs): memory under-predicted on "
                  f"{_pct(metrics['memory_under_prediction_rate'], '.2%')} (the bound's median error "
                  f"{_pct(metrics['memory_bound_median_error'])}), runtime MdAPE "
                  f"{_pct(metrics['runtime_mdape'])} ({metrics['runtime_jobs']} jobs)")

    # The same rows, as a site without GPU-memory telemetry has them; its model is not registered.
    blind_train, blind_test = without_gpu_memory(train_rows), without_gpu_memory(test_rows)
    outcomes, _ = train.fit(blind_train, config)
    outcome_metrics = train.evaluate(outcomes, blind_train, blind_test, config)
    outcomes.data["metrics"] = outcome_metrics
    outcomes_path = out / "model-outcomes.json"
    outcomes.save(str(outcomes_path))
    check = bound_check(outcomes, test_rows, config)
    memory = (f"memory under-predicted on {_pct(outcome_metrics['memory_under_prediction_rate'], '.2%')} "
              f"({outcome_metrics['memory_jobs']} jobs)" if outcome_metrics["memory_jobs"]
              else "no measured peaks to score its memory on")
    console.print(f"   outcomes only: the same {len(blind_train)} jobs with every GPU-memory measurement removed "
                  f"(no gres/gpumem, no collector) -> memory_source \"{outcomes.memory_source}\", saved as "
                  f"{outcomes_path} (not registered); same held-out days: {memory}, runtime MdAPE "
                  f"{_pct(outcome_metrics['runtime_mdape'])} ({outcome_metrics['runtime_jobs']} jobs); against the "
                  f"withheld peaks of {check['jobs']} held-out jobs of known families, the smallest card their family "
                  f"held on was below the true need for {check['under']} ({check['no_bound']} beyond any size held: "
                  f"only the request as written can fit)")

    new_runs = out / "new-runs"
    new_runs.mkdir()
    seen = set()
    for job in held_back:  # the next day's jobs: new runs of families the history knows
        family = script_features(job.script)["family"]
        if family not in seen and bundle.history.family(family).get("n", 0) >= config.policy.min_history:
            seen.add(family)
            (new_runs / f"{job.user}-{job.family}.sh").write_text(job.script)
        if len(seen) == 8:
            break
    env = {"SLURMGPU_CONFIG": str(config_path), "USER": "demo", "XDG_CACHE_HOME": str(out / "cache")}
    backend = _AtTheCut(history, generated.cut)
    decider = site_decider(config, backend, env)
    table = Table(title="4. gsbatch --dry-run (model decider; nothing submitted)", show_lines=True)
    for col in ("script", "request", "decision", "why"):
        table.add_column(col, overflow="fold")
    shown = None
    plans = {}
    for path in [*sorted(EXAMPLES.glob("*.sh")), *sorted(new_runs.glob("*.sh"))]:
        try:
            p = plan(Invocation(script=str(path), flags=frozenset({"--dry-run"})), env, decider)
        except InputError as exc:
            table.add_row(path.name, "-", "[red]error[/red]", str(exc))
            continue
        assert p.request is not None
        plans[str(path)] = p
        if p.decision.refusal:
            verdict, why = "[red]refused[/red]", p.decision.refusal
        elif p.submission.changed:
            verdict, why = "[yellow]rewritten[/yellow]", "; ".join(p.decision.reasons)  # each change's own
            shown = shown or (path, p.submission.script_text)
        else:
            verdict, why = "[green]kept[/green]", p.decision.reasons[-1]
        table.add_row(os.path.relpath(path, ROOT), "; ".join(describe(c) for c in p.request.components), verdict, why)
    console.print(table)

    # The new runs again, decided by the outcome model (gsbatch with SLURMGPU_MODEL set to it).
    outcome_env = {**env, "SLURMGPU_MODEL": str(outcomes_path)}
    outcome_decider = local_decider(config, backend, outcome_env, env["USER"])
    side = Table(title="5. the new runs: model with telemetry vs model from outcomes only", show_lines=True)
    for col in ("script", "with telemetry", "outcomes only"):
        side.add_column(col, overflow="fold")
    outcome_plans, differ = {}, 0
    for path in sorted(new_runs.glob("*.sh")):
        if str(path) not in plans:
            continue
        p = plans[str(path)]
        o = plan(Invocation(script=str(path), flags=frozenset({"--dry-run"})), outcome_env, outcome_decider)
        outcome_plans[str(path)] = o
        differ += (o.decision.changes, o.decision.refusal) != (p.decision.changes, p.decision.refusal)
        side.add_row(path.name, _outcome(p), _outcome(o))
    console.print(side)
    console.print(f"decisions that differ (GPU type, count, partition or refusal): {differ} of {len(outcome_plans)}")
    if shown is not None:
        console.print(f"\n[bold]gsbatch --dry-run {os.path.relpath(shown[0], ROOT)}[/bold] would submit:")
        console.print(shown[1], markup=False, highlight=False, soft_wrap=True)
    console.print(f"\nTry it: SLURMGPU_CONFIG={config_path} .venv/bin/gsbatch --dry-run --explain SCRIPT"
                  f"\n  (the outcome model: SLURMGPU_MODEL={outcomes_path} before it)")
    return {"metrics": metrics, "plans": plans, "held_back": held_back, "history": history, "config": config,
            "outcomes": {"bundle": outcomes, "path": outcomes_path, "metrics": outcome_metrics, "plans": outcome_plans,
                         "bound_check": check, "differ": differ}}
