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


def main(runs: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    ids: list[str] = []
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env["SLURMGPU_SUBMISSION_SPOOL"] = tmp  # records are written, as in production
        try:
            for n, (case, (config, text)) in enumerate({**CASES, **model_cases()}.items()):
                env["SLURMGPU_CONFIG"] = str(config)
                script = Path(tmp) / f"case{n}.sh"
                script.write_text(text)
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
