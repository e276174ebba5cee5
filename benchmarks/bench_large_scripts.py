"""gsbatch's added wall time over plain sbatch on large scripts sbatch accepts, on the local cluster.

Slurm takes batch scripts up to 4 MB; gsbatch reads each one before it submits, so a script's size
must not cost it more than a fixed bound (target: at most 300 ms more than sbatch on any script).
Runs ``sbatch --test-only`` and ``gsbatch --test-only`` in turn (rotated, after a warm-up round) on
the same scripts, each ~3.9 MB except a typical one and the 264 KB line that once took regexes
quadratic time, and reports medians. The config is ``make demo``'s (the model decider, which reads
the launch) when it exists, else the sample config (the rules). Usage: make bench [RUNS=5]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HEAD = "#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:2\n#SBATCH -t 10\n"
SIZE = 3_900_000  # bytes: just under Slurm's default max_script_size (4 MB)
TARGET_MS = 300.0


def _filled(line: str, tail: str = "") -> str:
    """HEAD, then LINE repeated up to SIZE bytes, then TAIL."""
    return HEAD + line * ((SIZE - len(HEAD) - len(tail)) // len(line)) + tail


def shapes() -> dict[str, str]:
    """The script shapes measured: each is a script sbatch accepts."""
    return {
        "typical": HEAD + "module load cuda\ntorchrun --nproc_per_node=2 train.py --model gpt2 --batch-size 8 --bf16\n",
        "CUDA_VISIBLE_DEVICES x 11k, one line": HEAD + "N=$CUDA_VISIBLE_DEVICES " * 11_000 + "\n",
        "srun lines": _filled("srun -n 2 python train.py --model gpt2 --batch-size 8 --lr 0.001\n"),
        "torchrun lines": _filled("torchrun --nproc_per_node=2 train.py --model gpt2 --batch-size 8\n"),
        "#SBATCH lines": _filled("#SBATCH --comment=abc\n", "srun python train.py\n"),
        "one command, 650k arguments": HEAD + "srun python train.py" + " arg=1" * ((SIZE - len(HEAD) - 21) // 6) + "\n",
    }


def config() -> Path:
    demo = ROOT / "demo-out" / "slurmgpu.toml"
    return demo if demo.exists() else ROOT / "contrib" / "slurmgpu.toml"


def timed(argv: list[str], cwd: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, cwd=cwd, env=env, check=True)
    return time.perf_counter() - t0


def measure(runs: int, script: Path, tmp: str, env: dict[str, str]) -> dict[str, float]:
    times: dict[str, list[float]] = {"sbatch": [], "gsbatch": []}
    order = ["sbatch", "gsbatch"]
    for i in range(runs + 1):
        for tool in order[i % 2:] + order[:i % 2]:
            dt = timed([str(BIN / tool) if tool == "gsbatch" else tool, "--test-only", str(script)], tmp, env)
            if i >= 1:
                times[tool].append(dt)
    sb, gs = (statistics.median(times[t]) for t in order)
    return {"runs": runs, "bytes": script.stat().st_size, "sbatch_median_ms": sb * 1e3,
            "gsbatch_median_ms": gs * 1e3, "added_median_ms": (gs - sb) * 1e3}


def main(runs: int) -> dict[str, dict[str, float]]:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "slurmgpu")], check=True,
                   stdout=subprocess.DEVNULL)  # as a pip install does: no compile time measured as start-up
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "SLURMGPU_CONFIG": str(config())}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env["SLURMGPU_SOCKET"] = os.path.join(tmp, "no-daemon.sock")  # planned in gsbatch's own process
        env["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")
        for n, (case, text) in enumerate(shapes().items()):
            script = Path(tmp) / f"case{n}.sh"
            script.write_text(text)
            results[case] = measure(runs, script, tmp, env)
    return results


if __name__ == "__main__":
    res = main(int(os.environ.get("RUNS", "5")))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "large_scripts.json").write_text(json.dumps(res, indent=2))
    print(f"config: {config().relative_to(ROOT)}; target: added <= {TARGET_MS:.0f} ms")
    print("| script | size | sbatch | gsbatch | added (median) |")
    print("|---|---|---|---|---|")
    for case, r in res.items():
        over = "" if r["added_median_ms"] <= TARGET_MS else " (over)"
        print(f"| {case} | {r['bytes'] / 1e6:.2f} MB | {r['sbatch_median_ms']:.0f} ms | "
              f"{r['gsbatch_median_ms']:.0f} ms | {r['added_median_ms']:.0f} ms{over} |")
