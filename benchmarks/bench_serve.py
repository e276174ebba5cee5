"""Decision latency of `slurmgpu serve` under load: several client processes at offered rates.

The daemon runs as deployed (`slurmgpu serve --workers N`, one log line per decision), with the
rules decider (the daemon's own cost) and with the model decider and a model trained on the model
tests' synthetic history (400 trees, the training default). Each client opens a connection per
request, as job_submit.lua does, and sends at a fixed pace for a bounded time; the jobs cycle
through a pool of families, batch sizes and GPU requests. Clients run on the same machine as the
daemon. Targets on this project's 2-core machine: p99 under 5 ms at 1,000 requests/s with the
model. No cluster needed (without one the daemon ranks by runtime alone). The daemon records each
decision in a submission spool on this machine's disk, as a site's daemon does; the records column
counts the record files against the requests the daemon answered (a record dropped or not written
shows there). The daemon's CPU is read once its record files stop growing, so the CPU of writing
each request's record counts, however far the writer fell behind (the seconds it took after the
clients stopped are in serve.json).

Usage: make bench, or RATES=200,1000,2000 DURATION=10 CLIENTS=4 WORKERS=2 DECIDERS=rules,model
python bench_serve.py (WORKERS: 1 is one process; default one per core, as `serve` does).
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
DISTINCT = os.environ.get("DISTINCT") == "1"  # every request line unique: no decision is reused
sys.path.insert(0, str(ROOT / "tests"))

from test_models import FAMILIES, history, script_for  # noqa: E402

from slurmgpu.apps import serve  # noqa: E402
from slurmgpu.learning import train  # noqa: E402
from slurmgpu.pipeline.config import load_config  # noqa: E402

# Each run's directory, removed when every run is done: deleting a run's ~10,000 records straight
# away made the next run's record files cost the writer up to 1 ms of CPU each to create, where
# 0.05 ms is usual (this machine's filesystem discards freed blocks as it commits them), a cost a
# site's daemon does not pay every few seconds.
LEFT: list[str] = []


def jobs() -> list[dict]:
    """Distinct decide requests: every family, batch size and a few GPU asks and partitions. The
    clients cycle through them, so each line comes back within a second: the daemon reuses its
    decision (serve.REUSE_S) unless ``DISTINCT=1`` makes every line sent unique (``client``)."""
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
        job = pool[(offset + k) % len(pool)]
        if DISTINCT:  # another job name: the same decision, but a line the daemon has not seen
            job = {**job, "name": f"{offset}-{k}-{job['name']}"}
        decision = serve.ask(socket_path, job, timeout_s=1.0)
        if decision is None:
            failures += 1
        else:
            latencies.append(time.perf_counter() - t0)
    return latencies, failures


def main(decider: str, model: Path, rate: float, seconds: float, clients: int,
         workers: int) -> dict[str, float | str]:
    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    os.chmod(tmp, 0o755)
    config_path, log_path, sock = Path(tmp) / "slurmgpu.toml", Path(tmp) / "serve.log", os.path.join(tmp, "s.sock")
    sample = (ROOT / "contrib" / "slurmgpu.toml").read_text()
    config_path.write_text(re.sub(r'(?m)^decider = "\w+"', f'decider = "{decider}"', sample))
    exe = shutil.which("slurmgpu") or str(BIN / "slurmgpu")
    log = log_path.open("w")
    spool = Path(tmp) / "submissions"
    spool.mkdir()
    daemon = subprocess.Popen([exe, "--config", str(config_path), "serve", "--socket", sock, "--group", "",
                               "--slurm-user", "", "--model", str(model), "--workers", str(workers)], stderr=log,
                              env={**os.environ, "SLURMGPU_SUBMISSION_SPOOL": str(spool)})
    try:
        deadline = time.monotonic() + 60
        while serve.call(sock, {"op": "health"}) is None:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"slurmgpu serve did not start: {log_path.read_text()}")
            time.sleep(0.1)
        pool = jobs()
        for job in pool:  # warm-up: every request once
            serve.ask(sock, job, timeout_s=5)
        start, cpu0 = time.time() + 1.0, cpu_seconds(daemon.pid)
        with ProcessPoolExecutor(clients) as ex:
            futures = [ex.submit(client, sock, pool, i * 7, rate / clients, seconds, start + i / rate)
                       for i in range(clients)]
            results = [f.result() for f in futures]
        elapsed = time.time() - start
        backlog_s = written(spool)  # the records still queued when the clients stopped: their CPU counts
        cpu = cpu_seconds(daemon.pid) - cpu0
    finally:
        daemon.terminate()
        daemon.wait(60)  # the workers write the records still queued
        log.close()
        lines = log_path.read_text().splitlines()
        handled = [float(x) for line in lines for x in re.findall(r"latency_ms=([0-9.]+)", line)][len(pool):]
        reused = sum(1 for line in lines if " reused=" in line and "latency_ms=" in line)
        records = sum(1 for name in os.listdir(spool) if name.startswith("sub-")) - len(pool)
        LEFT.append(tmp)  # removed after the last run: see LEFT
    latencies = sorted(x * 1e3 for lat, _ in results for x in lat)
    q, inside = statistics.quantiles(latencies, n=100), statistics.quantiles(handled, n=100)
    return {"decider": decider, "workers": workers, "clients": clients, "target_rps": rate, "seconds": seconds,
            "requests": len(latencies), "failures": sum(f for _, f in results),
            "achieved_rps": len(latencies) / elapsed, "p50_ms": q[49], "p99_ms": q[98], "max_ms": latencies[-1],
            "in_daemon_p50_ms": inside[49], "in_daemon_p99_ms": inside[98],
            "daemon_cpu_ms_per_request": cpu * 1e3 / len(handled), "distinct_jobs": len(pool),
            "answered": len(handled), "records": records, "record_backlog_s": backlog_s,
            "reused": reused, "distinct_lines": DISTINCT}


def written(spool: Path) -> float:
    """Seconds until the daemon's record files stop growing in number (none for a second)."""
    t0, count, still = time.monotonic(), -1, time.monotonic()
    while time.monotonic() - still < 1.0 and time.monotonic() - t0 < 60:
        now = len(os.listdir(spool))
        if now != count:
            count, still = now, time.monotonic()
        time.sleep(0.1)
    return still - t0


def hostile(n: int = 8) -> dict:
    """Health-check latency while N clients each send a 1.8 MB request (over the limit), then
    while N send a ~250 KiB script each (under it: answered by the workers), and while one
    client holds a half-sent line. The in-process daemon of the tests, rules decider."""
    import socket
    import threading

    from test_serve import daemon, socket_dir

    directory = socket_dir()
    path = os.path.join(directory, "slurmgpu.sock")
    script = "#!/bin/bash\n#SBATCH --gres=gpu:v100:1\n" + "echo step\n" * 23000 + "srun train.py\n"
    payloads = {"1.8 MB": b'{"op": "decide", "job": {"script": "' + b"#" * (1800 << 10) + b'"}}\n',
                "250 KiB": json.dumps({"op": "decide", "job": {"script": script, "partition": "gpu-small",
                                                               "tres_per_node": "gres:gpu:v100:1"}}).encode() + b"\n"}
    out = {}
    try:
        with daemon(path, serve.Service(load_config(ROOT / "contrib" / "slurmgpu.toml"))):
            stalled = socket.socket(socket.AF_UNIX)
            stalled.connect(path)
            stalled.sendall(b'{"op": "decide", "job": {"script": "')
            for name, payload in payloads.items():
                def send(data: bytes = payload) -> None:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.settimeout(30)
                        s.connect(path)
                        try:
                            s.sendall(data)
                        except OSError:
                            pass
                        s.makefile("rb").readline()

                threads = [threading.Thread(target=send) for _ in range(n)]
                t0 = time.monotonic()
                for t in threads:
                    t.start()
                waits = []
                while any(t.is_alive() for t in threads):
                    t1 = time.monotonic()
                    assert serve.call(path, {"op": "health"}, timeout_s=5.0)
                    waits.append(time.monotonic() - t1)
                out[name] = {"clients": n, "seconds": time.monotonic() - t0, "health_checks": len(waits),
                             "health_max_ms": max(waits, default=0) * 1e3}
            stalled.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time so far of a process and its running descendants (the workers and
    their record writers)."""
    total = 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(p for child in map(int, children) for p in _tree(child))]


if __name__ == "__main__" and os.environ.get("HOSTILE"):
    for name, r in hostile(int(os.environ.get("CLIENTS", "8"))).items():
        print(f"{r['clients']} concurrent {name} requests: {r['seconds']:.2f} s; {r['health_checks']} health checks "
              f"meanwhile, slowest {r['health_max_ms']:.1f} ms")
elif __name__ == "__main__":
    rates = [float(r) for r in os.environ.get("RATES", os.environ.get("RATE", "200,1000,2000")).split(",")]
    seconds, clients = float(os.environ.get("DURATION", "10")), int(os.environ.get("CLIENTS", "4"))
    workers = int(os.environ.get("WORKERS", "0")) or len(os.sched_getaffinity(0))
    deciders = os.environ.get("DECIDERS", "rules,model").split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.json"
        config = load_config(ROOT / "contrib" / "slurmgpu.toml")
        train.fit(history(2000), config._replace(policy=config.policy._replace(decider="model")),
                  iterations=400)[0].save(str(model))
        try:
            results = [main(decider, model, rate, seconds, clients, workers) for decider in deciders for rate in rates]
        finally:
            for tmp in LEFT:
                shutil.rmtree(tmp, ignore_errors=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "serve.json").write_text(json.dumps(results, indent=2))
    print("| decider | workers | clients | req/s (offered) | requests | failures | p50 | p99 | max "
          "| in daemon p50 / p99 | daemon CPU/request | records / answered (written after) | reused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['decider']} | {r['workers']} | {r['clients']} | {r['achieved_rps']:.1f} ({r['target_rps']:.0f}) | "
              f"{r['requests']} | {r['failures']} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | "
              f"{r['max_ms']:.1f} ms | {r['in_daemon_p50_ms']:.2f} / {r['in_daemon_p99_ms']:.2f} ms | "
              f"{r['daemon_cpu_ms_per_request']:.2f} ms | {r['records']} / {r['answered']} "
              f"({r['record_backlog_s']:.1f} s) | {r['reused'] / max(r['answered'], 1):.0%} |")
