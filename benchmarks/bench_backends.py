"""The Slurm queries through each backend on the live cluster: the command-line tools and pyslurm.

Measured, as medians of RUNS runs: the daemon's ledger refresh (nodes and the queue, read into the
GpuLedger ``slurmgpu serve`` keeps), its idle-GPU count, and an ingest of the last DAYS days of the
cluster's accounting into a fresh SQLite store (plus the accounting read alone, without the store).
While it runs, HELD GPU jobs are kept held in the queue, so that the queue is not empty: held jobs
are read and then left out of the ledger, so they change nobody's queue view; they are cancelled at
the end. pyslurm is skipped, with the reason, where it does not match the running Slurm.
Usage: make bench-backends, or RUNS=9 DAYS=7 HELD=100 python benchmarks/bench_backends.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from slurmgpu.history import db, ingest
from slurmgpu.pipeline.queue import GpuLedger
from slurmgpu.slurm.backend import CliBackend, SlurmBackend, choose_backend

ROOT = Path(__file__).resolve().parent.parent


def median_ms(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def ingest_ms(backend: SlurmBackend, days: int, cluster: str, runs: int) -> float:
    """Median time of an ingest into an empty store (its schema made beforehand, not timed)."""
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            url = f"sqlite:///{tmp}/bench{i}.db"
            db.upgrade(url)
            engine = db.make_engine(url)
            t0 = time.perf_counter()
            report = ingest.ingest_sacct(engine, cluster, since=db.utcnow() - timedelta(days=days), backend=backend)
            times.append((time.perf_counter() - t0) * 1000)
            engine.dispose()
            if report.errors:
                raise SystemExit(f"{backend.name}: {len(report.errors)} rows rejected, first {report.errors[0]}")
    return statistics.median(times)


def measure(backend: SlurmBackend, runs: int, days: int, cluster: str) -> dict[str, Any]:
    until = db.utcnow()
    since = until - timedelta(days=days)
    lines = list(backend.accounting(since, until))
    return {
        "ledger_refresh_ms": median_ms(lambda: GpuLedger.from_queue(backend.nodes(), backend.queue()), runs),
        "free_gpus_ms": median_ms(backend.free_gpus, runs),
        "accounting_read_ms": median_ms(lambda: sum(1 for _ in backend.accounting(since, until)), runs),
        "ingest_ms": ingest_ms(backend, days, cluster, max(3, runs // 3)),
        "accounting_lines": len(lines),
        "queue_entries_read": len(backend.queue()),
    }


def hold_jobs(count: int) -> list[str]:
    """COUNT held GPU jobs (never run; out of every ledger); their ids, to cancel."""
    ids = []
    for i in range(count):
        out = subprocess.run(["sbatch", "--parsable", "--hold", "-J", "sg-bench-backends", "-o", "/dev/null",
                              f"--gres=gpu:{('a100', 'v100', 't4')[i % 3]}:1", "--wrap", "true"],
                             capture_output=True, text=True, check=True)
        ids.append(out.stdout.strip().split(";")[0])
    return ids


def main(runs: int, days: int, held: int) -> dict[str, Any]:
    choice = choose_backend({"SLURMGPU_BACKEND": "auto"})
    cli = CliBackend()
    cluster = cli.cluster_name() or "default"
    backends: list[SlurmBackend] = [cli] + ([choice.backend] if choice.backend.name == "pyslurm" else [])
    ids = hold_jobs(held)
    try:
        results = {b.name: measure(b, runs, days, cluster) for b in backends}
    finally:
        if ids:
            subprocess.run(["scancel", *ids], check=False)
    return {"runs": runs, "days": days, "held_jobs": held, "backend_choice": choice.reason, "results": results}


if __name__ == "__main__":
    result = main(*(int(os.environ.get(k, d)) for k, d in (("RUNS", "9"), ("DAYS", "7"), ("HELD", "100"))))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "backends.json").write_text(json.dumps(result, indent=2))
    print(f"pyslurm: {result['backend_choice']}; medians of {result['runs']} runs, "
          f"{result['held_jobs']} held jobs in the queue, accounting of the last {result['days']} days")
    print(f"{'backend':8} {'ledger refresh':>15} {'free GPUs':>10} {'accounting read':>16} {'ingest':>10} {'lines':>7}")
    for name, r in result["results"].items():
        print(f"{name:8} {r['ledger_refresh_ms']:12.1f} ms {r['free_gpus_ms']:7.1f} ms "
              f"{r['accounting_read_ms']:13.1f} ms {r['ingest_ms']:7.0f} ms {r['accounting_lines']:7}")
