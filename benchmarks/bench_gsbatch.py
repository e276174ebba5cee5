"""gsbatch's added wall time over plain sbatch, on the real local cluster.

Runs sbatch and gsbatch alternately on the same scripts (held jobs, cancelled afterwards) and
reports medians. Target: under 100 ms median added. Usage: make bench [RUNS=40]
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CASES = {
    "kept": "#SBATCH -p gpu --gres=gpu:a100:1",
    "rewritten": "#SBATCH -p gpu-small --gres=gpu:a100:1",
}


def timed(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, check=True)
    return time.perf_counter() - t0, res.stdout


def main(runs: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "SLURMGPU_CONFIG": str(ROOT / "contrib" / "slurmgpu.toml")}
    ids: list[str] = []
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env["SLURMGPU_SUBMISSION_SPOOL"] = tmp  # records are written, as in production
        try:
            for case, directives in CASES.items():
                script = Path(tmp) / f"{case}.sh"
                script.write_text(f"#!/bin/bash\n{directives}\n#SBATCH -t 1\nsleep 1\n")
                times: dict[str, list[float]] = {"sbatch": [], "gsbatch": []}
                for i in range(runs + 2):
                    for tool in ("sbatch", "gsbatch") if i % 2 else ("gsbatch", "sbatch"):
                        dt, out = timed([tool, "--hold", "--parsable", str(script)], tmp, env)
                        ids.append(out.strip())
                        if i >= 2:  # two warm-up rounds
                            times[tool].append(dt)
                sb, gs = statistics.median(times["sbatch"]), statistics.median(times["gsbatch"])
                results[case] = {"runs": runs, "sbatch_median_ms": sb * 1e3, "gsbatch_median_ms": gs * 1e3,
                                 "added_median_ms": (gs - sb) * 1e3,
                                 "gsbatch_p90_ms": statistics.quantiles(times["gsbatch"], n=10)[-1] * 1e3}
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
    print("| case | sbatch median | gsbatch median | added (median) | gsbatch p90 |")
    print("|---|---|---|---|---|")
    for case, r in res.items():
        print(f"| {case} | {r['sbatch_median_ms']:.1f} ms | {r['gsbatch_median_ms']:.1f} ms | "
              f"{r['added_median_ms']:.1f} ms | {r['gsbatch_p90_ms']:.1f} ms |")
