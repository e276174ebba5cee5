"""Decision latency of `slurmgpu serve` under load: several client processes, ~200 requests/s in all.

The daemon runs as deployed (`slurmgpu serve`, model decider, one log line per decision) with a
model trained on the model tests' synthetic history (400 trees, the training default). Each client
opens a connection per request, as job_submit.lua does, and sends at a fixed pace for a bounded
time; the jobs cycle through a pool of families, batch sizes and GPU requests. Target: p99 under
5 ms at 200 requests/s on this project's 2-core machine. No cluster needed (without one the daemon
ranks by runtime alone). Usage: make bench, or RATE=200 DURATION=20 CLIENTS=4 python bench_serve.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))

from test_models import FAMILIES, history, script_for  # noqa: E402

from slurmgpu import serve, train  # noqa: E402
from slurmgpu.config import load_config  # noqa: E402


def jobs() -> list[dict]:
    """Distinct decide requests: every family, batch size and a few GPU asks and partitions."""
    asks = [("gres:gpu:a100:4", None), ("gres:gpu:a100:1", "gpu"), ("gres:gpu:v100:2", "gpu"),
            ("gres:gpu:t4:1", "gpu-small"), ("gres:gpu:2", None)]
    pool = []
    for n, (family, batch, steps, (tres, part)) in enumerate(product(FAMILIES, (8, 32, 128), (500, 2000), asks)):
        pool.append({"script": script_for(family, batch, steps, "a100"), "tres_per_node": tres, "time_limit": 720,
                     "user_name": ("ann", "bob", "cy")[n % 3], "name": f"{family}.sh",
                     **({"partition": part} if part else {})})
    return pool


def client(socket_path: str, pool: list[dict], offset: int, rate: float, seconds: float,
           start: float) -> tuple[list[float], int]:
    """Send at a fixed pace from ``start``; latency of each answered request, and failures."""
    latencies, failures = [], 0
    interval = 1.0 / rate
    for k in range(int(seconds * rate)):
        due = start + k * interval
        time.sleep(max(due - time.time(), 0))
        t0 = time.perf_counter()
        decision = serve.ask(socket_path, pool[(offset + k) % len(pool)], timeout_s=1.0)
        if decision is None:
            failures += 1
        else:
            latencies.append(time.perf_counter() - t0)
    return latencies, failures


def main(rate: float, seconds: float, clients: int) -> dict[str, float]:
    sample = (ROOT / "contrib" / "slurmgpu.toml").read_text()
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    os.chmod(tmp, 0o755)
    config_path, model = Path(tmp) / "slurmgpu.toml", Path(tmp) / "model.json"
    config_path.write_text(re.sub(r'(?m)^decider = "\w+"', 'decider = "model"', sample))
    config = load_config(config_path)
    train.fit(history(2000), config, iterations=400)[0].save(str(model))
    sock = os.path.join(tmp, "slurmgpu.sock")
    exe = shutil.which("slurmgpu") or str(BIN / "slurmgpu")
    log = open(Path(tmp) / "serve.log", "w")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen([exe, "--config", str(config_path), "serve", "--socket", sock, "--group", "",
                               "--slurm-user", "", "--model", str(model)], stderr=log)
    try:
        deadline = time.monotonic() + 60
        while serve.call(sock, {"op": "health"}) is None:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"slurmgpu serve did not start: {(Path(tmp) / 'serve.log').read_text()}")
            time.sleep(0.1)
        pool = jobs()
        for job in pool:  # warm-up: every request once
            serve.ask(sock, job, timeout_s=5)
        start = time.time() + 1.0
        with ProcessPoolExecutor(clients) as ex:
            futures = [ex.submit(client, sock, pool, i * 7, rate / clients, seconds, start + i / rate)
                       for i in range(clients)]
            results = [f.result() for f in futures]
        elapsed = time.time() - start
        cpu_s = cpu_seconds(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(10)
        log.close()
        handled = [float(x) for x in re.findall(r"latency_ms=([0-9.]+)", (Path(tmp) / "serve.log").read_text())]
        shutil.rmtree(tmp, ignore_errors=True)
    latencies = sorted(x * 1e3 for lat, _ in results for x in lat)
    q, inside = statistics.quantiles(latencies, n=100), statistics.quantiles(handled[len(pool):], n=100)
    return {"clients": clients, "target_rps": rate, "seconds": seconds, "requests": len(latencies),
            "failures": sum(f for _, f in results), "achieved_rps": len(latencies) / elapsed,
            "p50_ms": q[49], "p99_ms": q[98], "max_ms": latencies[-1],
            "in_daemon_p50_ms": inside[49], "in_daemon_p99_ms": inside[98],
            "daemon_cpu_ms_per_request": cpu_s * 1e3 / (len(handled) + 1), "distinct_jobs": len(pool)}


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    res = main(float(os.environ.get("RATE", "200")), float(os.environ.get("DURATION", "20")),
               int(os.environ.get("CLIENTS", "4")))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "serve.json").write_text(json.dumps(res, indent=2))
    print("| clients | req/s (target) | requests | failures | p50 | p99 | max | in daemon p50 / p99 | CPU/request |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {res['clients']} | {res['achieved_rps']:.1f} ({res['target_rps']:.0f}) | {res['requests']} | "
          f"{res['failures']} | {res['p50_ms']:.2f} ms | {res['p99_ms']:.2f} ms | {res['max_ms']:.1f} ms | "
          f"{res['in_daemon_p50_ms']:.2f} / {res['in_daemon_p99_ms']:.2f} ms | "
          f"{res['daemon_cpu_ms_per_request']:.2f} ms |")
