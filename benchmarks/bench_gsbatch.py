"""gsbatch's added wall time over plain sbatch, on the real local cluster, against a bare Python start.

Runs a bare Python start (`python -c pass`, the same interpreter), sbatch and gsbatch in turn on
the same scripts (held jobs, cancelled afterwards) and reports medians. The figure that matters is
gsbatch's median added time over sbatch divided by the bare Python start: targets <= 3.0 when the
request is kept, <= 4.5 when it is rewritten. The same ratio of CPU time (user + system, the
children's rusage) is reported too: on a loaded machine it is less noisy than wall time.
Usage: make bench-gsbatch [RUNS=40]; ONLY=TEXT measures only the cases whose name holds TEXT
("kept", "model, rewritten, daemon"); GSBATCH=PATH times that gsbatch instead of this tree's, and
GSBATCH=PATH:PATH... times each of them in the same rotation (before and after a change, interleaved
on the same machine: each case's rows are then labelled with the gsbatch's path). Each gsbatch's
tree should be byte-compiled, as this one is here.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
DEMO = ROOT / "demo-out"
# case -> (config, script text); the model cases need `make demo` first (its config and model).
CASES = {
    "rules, kept": (SAMPLE, "#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:1\n#SBATCH -t 1\nsleep 1\n"),
    "rules, rewritten": (SAMPLE, "#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\n#SBATCH -t 1\nsleep 1\n"),
}


def model_cases() -> dict[str, tuple[Path, str]]:
    """A next-day script of a known family from the demo, kept and rewritten by the model."""
    config = DEMO / "slurmgpu.toml"
    if not config.exists():
        return {}
    out = {}
    for path in sorted((DEMO / "new-runs").glob("*.sh")):
        res = subprocess.run([str(BIN / "gsbatch"), "--dry-run", str(path)], capture_output=True, text=True,
                             env={**os.environ, "SLURMGPU_CONFIG": str(config)}, check=False)
        case = "model, rewritten" if "GPU request changed" in res.stderr else "model, kept"
        out.setdefault(case, (config, path.read_text()))
    return out


GSBATCHES = [p for p in (os.environ.get("GSBATCH") or str(BIN / "gsbatch")).split(os.pathsep) if p]
ONLY = os.environ.get("ONLY", "")


def _cpu() -> float:
    """CPU seconds (user + system) of the children waited for so far."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def timed(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one run, and its stdout."""
    c0, t0 = _cpu(), time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, check=True)
    return time.perf_counter() - t0, _cpu() - c0, res.stdout


@contextlib.contextmanager
def daemon(config: Path, tmp: str) -> Iterator[str]:
    """`slurmgpu serve` for CONFIG on a socket in TMP, as a site runs it for the Lua hook."""
    sock = os.path.join(tmp, "run", "slurmgpu.sock")
    os.makedirs(os.path.dirname(sock), mode=0o755)
    group = grp.getgrgid(os.getgid()).gr_name
    proc = subprocess.Popen([str(BIN / "slurmgpu"), "--config", str(config), "serve", "--socket", sock,
                             "--group", group], stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("slurmgpu serve did not create its socket")
        yield sock
    finally:
        proc.terminate()
        proc.wait(10)


def measure(runs: int, script: Path, tmp: str, env: dict[str, str], ids: list[str]) -> dict[str, dict[str, float]]:
    """Bare Python start, sbatch and each gsbatch in turn (rotated), after two warm-up rounds;
    the figures of each gsbatch, by its path."""
    command = {"python": [sys.executable, "-c", "pass"], "sbatch": ["sbatch"], **{g: [g] for g in GSBATCHES}}
    order = list(command)
    times: dict[str, list[float]] = {t: [] for t in order}
    cpu: dict[str, list[float]] = {t: [] for t in order}
    for i in range(runs + 2):
        k = i % len(order)
        for tool in order[k:] + order[:k]:  # rotate so no tool always runs first
            argv = command[tool] + ([] if tool == "python" else ["--hold", "--parsable", str(script)])
            dt, dc, out = timed(argv, tmp, env)
            if tool != "python":
                ids.append(out.strip())
            if i >= 2:
                times[tool].append(dt)
                cpu[tool].append(dc)
    py, sb = (statistics.median(times[t]) for t in ("python", "sbatch"))
    cpy, csb = (statistics.median(cpu[t]) for t in ("python", "sbatch"))
    figures = {}
    for g in GSBATCHES:
        gs, cgs = statistics.median(times[g]), statistics.median(cpu[g])
        figures[g] = {"runs": runs, "python_median_ms": py * 1e3, "sbatch_median_ms": sb * 1e3,
                  "gsbatch_median_ms": gs * 1e3, "added_median_ms": (gs - sb) * 1e3,
                  "added_over_python": (gs - sb) / py,
                  "gsbatch_p90_ms": statistics.quantiles(times[g], n=10)[-1] * 1e3,
                  "python_cpu_ms": cpy * 1e3, "added_cpu_ms": (cgs - csb) * 1e3,
                  "added_cpu_over_python": (cgs - csb) / cpy}
    return figures


def labelled(case: str, figures: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """One row per gsbatch: the case's name alone when one gsbatch is timed, else with its path."""
    return {case if len(figures) == 1 else f"{case} [{g}]": f for g, f in figures.items()}


def main(runs: int) -> dict[str, dict[str, float]]:
    # Byte-compile first, as a pip install does: with PYTHONDONTWRITEBYTECODE set, an edited
    # source tree would otherwise be compiled again on every run and measured as start-up.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "slurmgpu")], check=True,
                   stdout=subprocess.DEVNULL)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    ids: list[str] = []
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env["SLURMGPU_SUBMISSION_SPOOL"] = tmp  # records are written, as in production
        env["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")
        try:
            for n, (case, (config, text)) in enumerate({**CASES, **model_cases()}.items()):
                env["SLURMGPU_CONFIG"] = str(config)
                script = Path(tmp) / f"case{n}.sh"
                script.write_text(text)
                env["SLURMGPU_SOCKET"] = os.path.join(tmp, "no-daemon.sock")
                if ONLY in f"{case}, in-process":
                    results.update(labelled(f"{case}, in-process", measure(runs, script, tmp, env, ids)))
                if ONLY in f"{case}, daemon":
                    with daemon(config, tmp) as sock:
                        env["SLURMGPU_SOCKET"] = sock
                        results.update(labelled(f"{case}, daemon", measure(runs, script, tmp, env, ids)))
                    shutil.rmtree(os.path.join(tmp, "run"))
        finally:
            for chunk in range(0, len(ids), 200):
                subprocess.run(["scancel", *[i for i in ids[chunk:chunk + 200] if re.fullmatch(r"\d+", i)]],
                               check=False)
    return results


if __name__ == "__main__":
    runs = int(os.environ.get("RUNS", "40"))
    res = main(runs)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "gsbatch.json").write_text(json.dumps(res, indent=2))
    print("| case | bare Python | sbatch | gsbatch | added (median) | added / bare Python | gsbatch p90 "
          "| added CPU / bare Python CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for case, r in res.items():
        print(f"| {case} | {r['python_median_ms']:.1f} ms | {r['sbatch_median_ms']:.1f} ms | "
              f"{r['gsbatch_median_ms']:.1f} ms | {r['added_median_ms']:.1f} ms | {r['added_over_python']:.2f}x | "
              f"{r['gsbatch_p90_ms']:.1f} ms | {r['added_cpu_ms']:.1f} / {r['python_cpu_ms']:.1f} ms = "
              f"{r['added_cpu_over_python']:.2f}x |")
