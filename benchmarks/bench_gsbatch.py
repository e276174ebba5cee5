"""gsbatch's added wall time over plain sbatch, on the real local cluster, against a bare Python start.

Runs a bare Python start (`python -c pass`, the same interpreter), sbatch and gsbatch in turn on
the same scripts (held jobs, cancelled afterwards) and reports medians. The figure that matters is
gsbatch's median added time over sbatch divided by the bare Python start: targets <= 3.0 when the
request is kept, <= 4.5 when it is rewritten. Usage: make bench-gsbatch [RUNS=40]
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import re
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


def timed(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, check=True)
    return time.perf_counter() - t0, res.stdout


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


def measure(runs: int, script: Path, tmp: str, env: dict[str, str], ids: list[str]) -> dict[str, float]:
    """Bare Python start, sbatch and gsbatch in turn (rotated), after two warm-up rounds."""
    times: dict[str, list[float]] = {"python": [], "sbatch": [], "gsbatch": []}
    order = ["python", "sbatch", "gsbatch"]
    for i in range(runs + 2):
        for tool in order[i % 3:] + order[:i % 3]:  # rotate so no tool always runs first
            argv = [sys.executable, "-c", "pass"] if tool == "python" else [tool, "--hold", "--parsable", str(script)]
            dt, out = timed(argv, tmp, env)
            if tool != "python":
                ids.append(out.strip())
            if i >= 2:
                times[tool].append(dt)
    py, sb, gs = (statistics.median(times[t]) for t in order)
    return {"runs": runs, "python_median_ms": py * 1e3, "sbatch_median_ms": sb * 1e3, "gsbatch_median_ms": gs * 1e3,
            "added_median_ms": (gs - sb) * 1e3, "added_over_python": (gs - sb) / py,
            "gsbatch_p90_ms": statistics.quantiles(times["gsbatch"], n=10)[-1] * 1e3}


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
                results[f"{case}, in-process"] = measure(runs, script, tmp, env, ids)
                with daemon(config, tmp) as sock:
                    env["SLURMGPU_SOCKET"] = sock
                    results[f"{case}, daemon"] = measure(runs, script, tmp, env, ids)
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
    print("| case | bare Python | sbatch | gsbatch | added (median) | added / bare Python | gsbatch p90 |")
    print("|---|---|---|---|---|---|---|")
    for case, r in res.items():
        print(f"| {case} | {r['python_median_ms']:.1f} ms | {r['sbatch_median_ms']:.1f} ms | "
              f"{r['gsbatch_median_ms']:.1f} ms | {r['added_median_ms']:.1f} ms | {r['added_over_python']:.2f}x | "
              f"{r['gsbatch_p90_ms']:.1f} ms |")
