"""Model benchmarks: training time on 100k and 1M jobs, and prediction latency cold and warm.

The history comes from the workload model on the large cluster (each job run on what it asked
for); rows are built as ``train.history_rows`` returns them, so only fitting is timed. Targets:
warm prediction under 2 ms; gsbatch's total added time (cold process, model load included)
under 100 ms median. Usage: make bench [TRAIN_JOBS=100000,1000000]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def rows_for(n: int, seed: int = 3) -> list[dict]:
    from slurmgpu.pipeline.features import script_features
    from slurmgpu.simulation.workload import LARGE_CLUSTER, generate, simulate

    jobs = generate(LARGE_CLUSTER, datetime(2026, 1, 1), 3650, seed, jobs_per_day=n / 3650 * 1.02)[:n]
    features: dict[str, dict] = {}  # array tasks share a script
    rows = []
    for run in simulate(jobs, LARGE_CLUSTER):
        job = run.job
        sf = features.get(job.script) or features.setdefault(job.script, script_features(job.script))
        gres = LARGE_CLUSTER.gres_name(run.gpu_type)
        rows.append({"job_id": job.job_id, "user": job.user, "submit": job.submit_time, "state": run.state,
                     "gpu_type": gres, "gpus": run.gpus, "elapsed": int((run.end - run.start).total_seconds()),
                     "peak": run.peak_mem_mib, "script": sf, "request": {"gpus_total": job.req_gpus}})
    return rows


def bench_training(n: int, config) -> dict:
    from slurmgpu.learning import train

    t0 = time.perf_counter()
    rows = rows_for(n)
    t1 = time.perf_counter()
    bundle, _ = train.fit(rows, config)
    t2 = time.perf_counter()
    return {"jobs": len(rows), "history_s": t1 - t0, "train_s": t2 - t1,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "bundle": bundle}


def bench_latency(bundle, config, script: Path, model_path: Path, runs: int = 30) -> dict:
    from slurmgpu.pipeline.policy import ModelDecider
    from slurmgpu.pipeline.request import build_request
    from slurmgpu.pipeline.script import read_script

    decider = ModelDecider(config, bundle, lambda: {"a100": 8, "v100": 8, "t4": 8}, "u")
    request = build_request(read_script(str(script)), [], {}, config.gpu_features())
    decider.decide(request)
    t0 = time.perf_counter()
    for _ in range(200):
        decider.decide(request)
    warm_ms = (time.perf_counter() - t0) / 200 * 1e3
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "SLURMGPU_CONFIG": str(config.path),
           "SLURMGPU_MODEL": str(model_path), "XDG_CACHE_HOME": str(model_path.parent)}
    times = {}
    for case, extra in (("gsbatch --dry-run, model decider", []), ("gsbatch --dry-run --no-rewrite", ["--no-rewrite"])):
        samples = []
        for _ in range(runs):
            s = time.perf_counter()
            subprocess.run([str(BIN / "gsbatch"), "--dry-run", *extra, str(script)], env=env, check=True,
                           capture_output=True)
            samples.append((time.perf_counter() - s) * 1e3)
        times[case] = statistics.median(samples)
    python = statistics.median([_time([sys.executable, "-c", "pass"]) for _ in range(runs)])
    return {"warm_decide_ms": warm_ms, "cold_ms": times, "python_start_ms": python,
            "bundle_kib": model_path.stat().st_size / 1024}


def _time(argv: list[str]) -> float:
    s = time.perf_counter()
    subprocess.run(argv, check=True)
    return (time.perf_counter() - s) * 1e3


def main() -> None:
    from slurmgpu.pipeline.config import load_config
    from slurmgpu.simulation.workload import LARGE_CLUSTER, generate

    base = load_config(ROOT / "contrib" / "slurmgpu.toml")
    config = base._replace(policy=base.policy._replace(decider="model"))
    results = {"training": []}
    bundle = None
    for n in [int(x) for x in os.environ.get("TRAIN_JOBS", "100000,1000000").split(",")]:
        r = bench_training(n, config)
        bundle = bundle or r.pop("bundle")
        r.pop("bundle", None)
        results["training"].append(r)
        print(f"training on {r['jobs']:,} jobs: history {r['history_s']:.1f} s, fit {r['train_s']:.1f} s, "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.json"
        bundle.save(str(model))
        job = next(j for j in generate(LARGE_CLUSTER, datetime(2026, 1, 1), 5, 9) if "--batch-size" in j.script)
        script = Path(tmp) / "job.sh"
        script.write_text(job.script.replace("A100-80", "a100"))
        lat = bench_latency(bundle, config, script, model)
    results["latency"] = lat
    print(f"warm decision (all candidate types and counts): {lat['warm_decide_ms']:.2f} ms per job")
    for case, ms in lat["cold_ms"].items():
        print(f"cold {case}: {ms:.0f} ms median (python start alone {lat['python_start_ms']:.0f} ms; "
              f"bundle {lat['bundle_kib']:.0f} KiB)")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "model.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
