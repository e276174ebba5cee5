"""Prometheus metrics of the decision daemon (``serve --metrics-port``) and the nightly run
(``nightly --metrics-textfile``), with the maintained ``prometheus_client``.

Why multiprocess mode: the daemon forks (children answer long requests; pre-forked workers answer
in parallel), and a counter kept in one process's memory would lose what the others counted.
``enable`` is called once, before any fork: each process then writes its own memory-mapped files in
the directory, and a scrape sums them (``MultiProcessCollector``). A process that forks and does not
record (serve_socket's children) hands its observations to its parent instead (``defer``), so no
file is left per child; a worker that dies is told to the collector with ``mark_dead``.

Privacy and cardinality: no label names a user, account, job, partition or script. Labels take
values from fixed sets below, and GPU types only from the site config (anything else is "other"),
so a request cannot create a series.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Callable, Container, Mapping
from typing import Any, NamedTuple

from slurmgpu.pipeline.errors import InputError

SOURCES = ("hook", "gsbatch")  # op decide (slurmctld's job_submit.lua), op plan (gsbatch's fast path)
OUTCOMES = ("changed", "kept", "refused", "advised", "waived", "error")
DECIDERS = ("keep", "rules", "model")
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
OTHER = "other"  # a GPU type the config does not name
ANY = "any"  # a request that names no GPU type

GPU_HOURS_HELP = (
    "Net GPU-hours the daemon's applied changes save, by the decision's own estimate (not measured): for each "
    "change of type or count, GPUs asked x the model's predicted run time on the type asked, minus GPUs decided "
    "x its predicted run time on the type decided. Negative when changes spend more GPU time (e.g. for a "
    "sooner finish). Only model decisions of a typed request carry the predictions; rules decisions add nothing. "
    "Since the daemon started.")


class Observed(NamedTuple):
    """One decision, reduced to its labels and numbers (JSON-able: a child sends it to its parent)."""

    source: str
    outcome: str
    reason: str
    decider: str
    seconds: float
    move: tuple[str, str] | None = None  # (from type, to type) of an applied change
    oom_prevented: bool = False
    gpu_hours_saved: float | None = None


class _Metrics:
    """The daemon's metric objects; built once ``enable`` has chosen how values are stored."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        # registry=None: a scrape reads every process's value files (serve_http), not this process's objects
        self.decisions = Counter("slurmgpu_decisions", "Decisions answered, by who asked (hook: slurmctld's "
                                 "job_submit.lua, gsbatch: its fast path), outcome, reason class and decider.",
                                 ["source", "outcome", "reason", "decider"], registry=None)
        self.moves = Counter("slurmgpu_moves", "Applied changes, by the GPU type asked and the type decided "
                             "(the same type when only the count or partition changed; 'any': an untyped "
                             "request; 'other': a type the config does not name).", ["from_type", "to_type"],
                             registry=None)
        self.oom = Counter("slurmgpu_predicted_oom_prevented", "Applied changes whose request as asked was "
                           "predicted not to fit GPU memory and whose decided type and count were predicted to fit.",
                           registry=None)
        self.gpu_hours = Gauge("slurmgpu_gpu_hours_saved_estimate", GPU_HOURS_HELP, multiprocess_mode="sum",
                               registry=None)
        self.latency = Histogram("slurmgpu_decision_latency_seconds", "Time from a decision request's line to its "
                                 "reply, in the process that answered it (socket transfer not included).",
                                 ["source"], buckets=LATENCY_BUCKETS, registry=None)


_metrics: _Metrics | None = None
_directory: str | None = None
_sink: Callable[[Observed], None] | None = None


def enable(directory: str, owner: int | None = None) -> None:
    """Count decisions from now on, in multiprocess mode under ``directory``: made 0700 (owned by
    ``owner`` when given: the account the daemon drops to), its old value files removed. Call it
    before forking any process that records."""
    global _metrics, _directory
    prepare_directory(directory, owner)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    from prometheus_client import values

    # prometheus_client picks how values are stored when first imported; it may have been imported
    # before the variable was set (a test, a library caller).
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.get_value_class()
    _directory = directory
    _metrics = _Metrics()


def prepare_directory(directory: str, owner: int | None = None) -> None:
    """``directory`` as a private metrics store: made 0700 if missing; if present, a real directory of
    this user, root or ``owner``, private, and emptied of its value files (a restart starts at zero)."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise InputError(f"cannot make the metrics directory: {exc.strerror}", option="--metrics-dir") from None
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in {0, os.geteuid(), owner} or st.st_mode & 0o077:
        raise InputError(f"{directory} must be a directory of this user or root, mode 0700 (no symlink)",
                         option="--metrics-dir")
    for path in glob.glob(os.path.join(glob.escape(directory), "*.db")):
        os.unlink(path)
    if owner is not None:
        os.chown(directory, owner, -1)
    os.chmod(directory, 0o700)


def defer(sink: Callable[[Observed], None] | None) -> None:
    """In a child that should not write value files: hand each observation to ``sink`` (the parent
    records them with ``record``); None: record here again."""
    global _sink
    _sink = sink


def mark_dead(pid: int) -> None:
    """A worker process ended: drop its files of live-only values (its counts stay summed)."""
    if _directory is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, _directory)


def active() -> bool:
    """Whether decisions are counted (cheaper for a caller to skip building what it would pass)."""
    return _metrics is not None or _sink is not None


def record_decision(source: str, decision: Mapping[str, Any] | None, seconds: float, asked_type: str | None = None,
                    asked_gpus: int | None = None, types: Container[str] = (), error: str | None = None) -> None:
    """Count one answered decision request: ``decision`` in its reply's JSON form (None with
    ``error``: "bad_request" or "internal"); ``asked_*``: the request's main component; ``types``:
    the config's GPU types, the only ones a label may name."""
    if _metrics is None and _sink is None:
        return
    if decision is None:
        observed = Observed(source, "error", error or "internal", OTHER, seconds)
    else:
        observed = observe(source, decision, seconds, asked_type, asked_gpus, types)
    if _sink is not None:
        _sink(observed)
    else:
        record(observed)


def record(observed: Observed) -> None:
    """Add one observation to the counters (here or from a child's ``defer``)."""
    m = _metrics
    if m is None:
        return
    m.decisions.labels(observed.source, observed.outcome, observed.reason, observed.decider).inc()
    m.latency.labels(observed.source).observe(observed.seconds)
    if observed.move is not None:
        m.moves.labels(*observed.move).inc()
    if observed.oom_prevented:
        m.oom.inc()
    if observed.gpu_hours_saved is not None:
        m.gpu_hours.inc(observed.gpu_hours_saved)


def observe(source: str, decision: Mapping[str, Any], seconds: float, asked_type: str | None, asked_gpus: int | None,
            types: Container[str]) -> Observed:
    """The labels and estimates of one decision (see the module's HELP texts for what each means)."""
    decider = str(decision.get("decider")) if decision.get("decider") in DECIDERS else OTHER
    changes = decision.get("changes") or []
    change = changes[0] if changes and isinstance(changes[0], Mapping) else {}
    what = "+".join(name for key, name in (("gpu_type", "type"), ("gpus_total", "count"), ("partition", "partition"))
                    if change.get(key) is not None) or "none"
    if decision.get("refused"):
        return Observed(source, "refused", "unsatisfiable", decider, seconds)
    if decision.get("waiver"):
        return Observed(source, "waived", "waiver", decider, seconds)
    if decision.get("mode") == "advise" and change:
        return Observed(source, "advised", what, decider, seconds)
    if not change:
        return Observed(source, "kept", "not_decided" if decider == "keep" else "as_asked", decider, seconds)
    to_type = change.get("gpu_type") or asked_type
    move = (_label(asked_type, types), _label(to_type, types))
    oom, saved = False, None
    to_gpus = change.get("gpus_total") or asked_gpus
    if asked_type is not None and asked_gpus:
        table = {(c.get("gpu_type"), c.get("gpus")): c for c in decision.get("per_type") or ()
                 if isinstance(c, Mapping)}
        base, new = table.get((asked_type, asked_gpus)), table.get((to_type, to_gpus))
        if base is not None and new is not None:
            oom = not base.get("fits") and bool(new.get("fits"))
            asked_s = asked_gpus * float(base["pred_runtime_s"])
            saved = (asked_s - int(to_gpus or 0) * float(new["pred_runtime_s"])) / 3600
    return Observed(source, "changed", what, decider, seconds, move, oom, saved)


def _label(gpu_type: str | None, types: Container[str]) -> str:
    if gpu_type is None:
        return ANY
    return gpu_type if gpu_type in types else OTHER


def serve_http(address: str, port: int) -> Any:
    """Expose the daemon's metrics at http://ADDRESS:PORT/metrics (a thread); the server, to shut down.
    Every process's values are summed at each scrape (they live in ``enable``'s directory)."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    if _directory is None:
        raise RuntimeError("metrics.enable() first")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=_directory)
    server, _ = start_http_server(port, address, registry)
    return server


def nightly_registry(ok: bool, started: float, finished: float, model: Any = None) -> Any:
    """The nightly run's figures: whether it succeeded, when and how long, and the installed model's
    version and the evaluation it was installed with (``Bundle.data["metrics"]``; a figure not
    measured is left out, never written as zero)."""
    from prometheus_client import CollectorRegistry, Gauge, Info

    reg = CollectorRegistry()
    Gauge("slurmgpu_nightly_success", "1 when the last nightly run ingested and trained without error, else 0.",
          registry=reg).set(int(ok))
    Gauge("slurmgpu_nightly_last_run_timestamp_seconds", "When the last nightly run ended (Unix time).",
          registry=reg).set(finished)
    Gauge("slurmgpu_nightly_duration_seconds", "How long the last nightly run took.", registry=reg).set(
        finished - started)
    if model is None:
        return reg
    Info("slurmgpu_model", "The installed model: its version (the digest decisions record).",
         registry=reg).info({"version": str(model.digest)})
    figures = model.data.get("metrics") or {}
    decider = figures.get("decider") or {}
    single = (("slurmgpu_model_trained_jobs", "Jobs the installed model was trained on.", model.data.get("jobs")),
              ("slurmgpu_model_memory_under_prediction_ratio", "Share of held-out jobs whose peak GPU memory "
               "the installed model under-predicted (families with history), at its training.",
               figures.get("memory_under_prediction_rate")),
              ("slurmgpu_model_runtime_mdape_ratio", "Median absolute percentage error of the installed model's "
               "run time on held-out jobs, as a ratio, at its training.", figures.get("runtime_mdape")))
    for name, text, value in single:
        if isinstance(value, int | float):
            Gauge(name, text, registry=reg).set(value)
    replay = Gauge("slurmgpu_model_replay_jobs", "The installed model's decider replayed on held-out jobs at its "
                   "training: jobs replayed, changed, placed where they do not fit, GPU OOM as asked and as decided.",
                   ["kind"], registry=reg)
    for kind in ("replayed", "changed", "placed_no_fit", "oom_as_asked", "oom_decided"):
        if isinstance(decider.get(kind), int | float):
            replay.labels(kind).set(decider[kind])
    evaluated = Gauge("slurmgpu_model_evaluated_jobs", "Held-out jobs each figure was measured on.", ["figure"],
                      registry=reg)
    for figure, key in (("memory", "memory_jobs"), ("runtime", "runtime_jobs")):
        if isinstance(figures.get(key), int | float):
            evaluated.labels(figure).set(figures[key])
    return reg


def write_textfile(path: str, registry: Any) -> None:
    """The registry in node_exporter's textfile format at ``path``, atomically and mode 0644: the
    collector reads the old file or the new one whole (the temp file is a dot file, not ``*.prom``)."""
    from prometheus_client import generate_latest

    from slurmgpu.pipeline.spool import atomic_write

    atomic_write(path, generate_latest(registry), 0o644)
