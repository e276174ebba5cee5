"""Decision benchmark: the deployed decider's GPU-type choice judged on measured throughputs.

The history is built from published per-GPU-type throughputs (Gavel's, K80/P100/V100 at 1-8 GPUs,
tests/fixtures/published/) with the noise of a real site's accounting, so the evaluation cannot
flatter the decider the way a history with visible work and +-2% runtimes does:

* the amount of work is hidden from the job script (no steps or epochs argument): the steps of a
  job are lognormal with sigma 1.4 (the 5th-95th percentile span of one family is ~100x);
* runtimes are heavy-tailed: per-run speed noise, slow nodes (5% of runs 1.3-3x slower), early
  crashes (FAILED) and runs past the time limit (TIMEOUT);
* each user mostly asks for one habitual type, whatever its speed, and runs a few favourite
  job families (so habit and family go together, as on a real cluster);
* a run whose published peak memory (GPUMemNet's ResNet-50 sweep) exceeds the card is
  OUT_OF_MEMORY after a few minutes, and the user resubmits on a card it fits;
* the history has no GPU-memory field.

The history is imported as an admin would (``history import``'s CSV through the same API), the
models trained (``train.fit``, as ``slurmgpu train``), and the decider that ``slurmgpu predict``
runs (objective ``fastest``, one partition holding every type) is asked about later, held-out
jobs. Each choice is scored against the measured throughput of the (type, count) it picks, beside
the users' own requests and the datasheet rule (the fastest type by ``relative_speed`` that fits
the job's true peak): share within 5% of the measured-fastest type that fits at the asked count,
mean throughput ratio (an out-of-memory choice counts 0), OOMs, with a bootstrap 95% interval per
seed. A second variant writes the work into the script (``--max-steps``). Beside them: what
``slurmgpu evaluate`` reports on the same held-out jobs (judged by the history's own runtimes) and
train's runtime MdAPE, and the decider's ten worst choices with its reasons (in the JSON).

Usage: make bench-decision [DECISION_ARGS="--seeds 1,2,3,4,5 --history 1500 --held-out 128"]
Writes benchmarks/results/decision.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from published import FIXTURES, gavel_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "decision.json"

# Gavel's three types in one partition (tests/published.py), 8 GPUs a node for its 8-GPU jobs; the
# rule's datasheet speeds and the cards' memory are the config's own.
CONFIG_TOML = gavel_config(gpus_per_node=8, cluster="bench")
_TYPES = tomllib.loads(CONFIG_TOML)["gpu_types"]
TYPES = tuple(sorted(_TYPES))
CARD_MIB = {t: v["memory_gib"] * 1024 for t, v in _TYPES.items()}
DATASHEET = {t: v["relative_speed"] for t, v in _TYPES.items()}

# The command each Gavel job runs (scheduler/job_table.py names the programs): the model stays in
# the command (the decider's family key), the batch is an argument, the work is not.
COMMANDS = {
    "ResNet-18": "cifar10/main.py --data_dir data/cifar10 --model resnet18",
    "ResNet-50": "imagenet/main.py --data_dir data/imagenet --model resnet50",
    "Transformer": "translation/train.py --data data/multi30k --model transformer",
    "LM": "language_modeling/main.py --data data/wikitext2 --model lstm",
    "Recommendation": "recommendation/train.py --data_dir data/ml-20m --model autoencoder",
    "A3C": "rl/main.py --env PongDeterministic-v4 --workers 4",
    "CycleGAN": "cyclegan/cyclegan.py --dataset_path data/monet2photo",
}
WORK_SIGMA = 1.4  # lognormal sigma of a job's steps within its family: exp(2 * 1.645 * 1.4) ~ 100x
TIME_LIMIT_S = 2 * 86400
WITHIN = 0.95  # "within 5% of the measured-fastest"


class Family(NamedTuple):
    """One Gavel job at one GPU count: what a user runs, and what it measures on every type."""

    model: str
    batch: str  # "" for the jobs without a batch size (A3C, CycleGAN)
    gpus: int
    peak_mib: float | None  # published peak per GPU where measured; None: fits every card here

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.batch)


class Job(NamedTuple):
    job_id: str
    user: str
    submit: datetime
    family: Family
    gpu_type: str  # the type the user asks for
    steps: int  # the amount of work; in the script only in the visible variant


def throughputs(source: str = "gavel_sim") -> dict[tuple[str, str], dict[tuple[str, int], float]]:
    """Steps per second per (model, batch) and (type, GPUs), as published (steps of all workers)."""
    table: dict[tuple[str, str], dict[tuple[str, int], float]] = defaultdict(dict)
    with open(FIXTURES / "throughput.csv", newline="") as fh:
        for r in csv.DictReader(fh):
            if r["source"] == source:
                table[(r["model"], r["batch_size"])][(r["gpu"], int(r["num_gpus"]))] = float(r["steps_per_s"])
    return dict(table)


def resnet50_peaks() -> dict[str, float]:
    """GPUMemNet's measured peak (MiB) of timm ResNet-50 at 224 px per batch, Gavel's ImageNet job."""
    with open(FIXTURES / "memory.csv", newline="") as fh:
        return {r["batch_size"]: float(r["peak_mib"]) for r in csv.DictReader(fh)
                if r["source"] == "gpumemnet_timm" and r["model"] == "resnet50" and r["ok"] == "1"}


def fits(fam: Family, gpu_type: str) -> bool:
    return fam.peak_mib is None or fam.peak_mib <= CARD_MIB[gpu_type]


def families(table: dict[tuple[str, str], dict[tuple[str, int], float]]) -> list[Family]:
    """Every (model, batch, GPUs) measured on each type it fits (a type it does not fit may lack a
    measurement: Gavel left K80 ResNet-50 batch 128 on several GPUs unmeasured)."""
    peaks = resnet50_peaks()
    out = []
    for (model, batch), speeds in sorted(table.items()):
        for gpus in sorted({n for _, n in speeds}):
            fam = Family(model, batch, gpus, peaks.get(batch) if model == "ResNet-50" else None)
            if all((t, gpus) in speeds for t in TYPES if fits(fam, t)):
                out.append(fam)
    return out


def script(fam: Family, gpu_type: str, steps: int | None) -> str:
    """The job script the user writes; ``steps`` None keeps the work out of it (the hidden variant)."""
    launcher = "python" if fam.gpus == 1 else f"torchrun --nproc_per_node={fam.gpus}"
    batch = f" --batch-size {fam.batch}" if fam.batch else ""
    work = f" --max-steps {steps}" if steps is not None else ""
    return (f"#!/bin/bash\n#SBATCH --gres=gpu:{gpu_type}:{fam.gpus}\n#SBATCH --time=2-00:00:00\n"
            f"{launcher} {COMMANDS[fam.model]}{batch}{work}\n")


def workload(seed: int, fams: Sequence[Family], table: dict[tuple[str, str], dict[tuple[str, int], float]],
             n_history: int, n_held: int, n_users: int = 16) -> tuple[list[Job], list[Job]]:
    """Jobs in submit order: the history's first ``n_history``, then ``n_held`` later ones to decide.
    Each user has a habitual type (asked 85% of the time) and three favourite families (80%)."""
    rng = random.Random(seed)
    users = [(f"u{i:02d}", rng.choices(TYPES, weights=(3, 3, 4))[0], rng.sample(list(fams), 3))
             for i in range(n_users)]
    # The median job of a family runs about two hours on one V100's speed at its count.
    median_steps = {f: 7200 * table[f.key][("v100", f.gpus)] for f in fams}
    t0 = datetime(2026, 1, 5)
    jobs = []
    for i in range(n_history + n_held):
        user, habit, favourites = rng.choice(users)
        fam = rng.choice(favourites) if rng.random() < 0.8 else rng.choice(fams)
        gpu_type = habit if rng.random() < 0.85 else rng.choice(TYPES)
        steps = max(10, round(median_steps[fam] * rng.lognormvariate(0, WORK_SIGMA)))
        jobs.append(Job(str(100000 + i), user, t0 + timedelta(minutes=40 * i), fam, gpu_type, steps))
    return jobs[:n_history], jobs[n_history:]


def accounting(jobs: Iterable[Job], table: dict[tuple[str, str], dict[tuple[str, int], float]], seed: int,
               visible: bool) -> list[dict[str, Any]]:
    """The sacct-like rows the jobs leave (the import schema, no GPU-memory field): an OOM is
    followed by the user's resubmission on a card the job fits."""
    rng = random.Random(seed * 7919 + 1)
    rows = []

    def run(job: Job, job_id: str, gpu_type: str, submit: datetime) -> None:
        fam = job.family
        text = script(fam, gpu_type, job.steps if visible else None)
        row = {"job_id": job_id, "user": job.user, "submit_time": submit.isoformat(), "gpu_type": gpu_type,
               "gpu_count": fam.gpus, "script": text}
        if not fits(fam, gpu_type):
            rows.append({**row, "elapsed_s": round(rng.uniform(60, 400)), "state": "OUT_OF_MEMORY"})
            retry = rng.choice([t for t in TYPES if fits(fam, t)])
            run(job, job_id + "1", retry, submit + timedelta(minutes=20))
            return
        speed = table[fam.key][(gpu_type, fam.gpus)] * rng.lognormvariate(0, 0.08)
        if rng.random() < 0.05:  # a slow node, a busy file system
            speed /= rng.uniform(1.3, 3.0)
        elapsed = job.steps / speed + rng.uniform(20, 180)  # start-up: data loading, compilation
        state = "COMPLETED"
        if rng.random() < 0.03:
            elapsed, state = elapsed * rng.random(), "FAILED"
        elif elapsed > TIME_LIMIT_S:
            elapsed, state = TIME_LIMIT_S, "TIMEOUT"
        rows.append({**row, "elapsed_s": max(1, round(elapsed)), "state": state})

    for job in jobs:
        run(job, job.job_id, job.gpu_type, job.submit)
    return rows


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    cols = ("job_id", "user", "submit_time", "gpu_type", "gpu_count", "elapsed_s", "state", "script")
    with open(path, "w", newline="") as fh:
        out = csv.DictWriter(fh, cols)
        out.writeheader()
        out.writerows(rows)


def datasheet_choice(fam: Family) -> str:
    """The one-line rule: the type with the highest datasheet speed that the job fits."""
    return max((t for t in TYPES if fits(fam, t)), key=lambda t: DATASHEET[t])


def oracle(fam: Family, table: dict[tuple[str, str], dict[tuple[str, int], float]]) -> tuple[str, float]:
    """The measured-fastest type the job fits at its own count, and its steps per second."""
    best = max((t for t in TYPES if fits(fam, t)), key=lambda t: table[fam.key][(t, fam.gpus)])
    return best, table[fam.key][(best, fam.gpus)]


def score(fam: Family, choice: tuple[str, int], table: dict[tuple[str, str], dict[tuple[str, int], float]]
          ) -> dict[str, Any]:
    """One choice against the measurements: its throughput over the oracle's (0 if it does not fit;
    None where the chosen count was never measured for the job)."""
    gpu_type, gpus = choice
    _, best = oracle(fam, table)
    if not fits(fam, gpu_type):
        return {"oom": True, "ratio": 0.0}
    measured = table[fam.key].get((gpu_type, gpus))
    return {"oom": False, "ratio": None if measured is None else measured / best}


def summary(scores: Sequence[dict[str, Any]], rng: random.Random, resamples: int = 1000) -> dict[str, Any]:
    """Share within 5%, mean ratio and OOMs over the measured choices, with bootstrap 95% intervals."""
    ratios = [s["ratio"] for s in scores if s["ratio"] is not None]
    if not ratios:
        return {"jobs": 0, "unmeasured": len(scores)}

    def figures(rs: Sequence[float]) -> tuple[float, float]:
        return sum(r >= WITHIN for r in rs) / len(rs), statistics.fmean(rs)

    within, mean = figures(ratios)
    boot = sorted(figures(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    shares, means = sorted(b[0] for b in boot), sorted(b[1] for b in boot)
    lo, hi = int(0.025 * resamples), int(0.975 * resamples) - 1
    return {"jobs": len(ratios), "within_5pct": within, "within_5pct_ci": [shares[lo], shares[hi]],
            "mean_ratio": mean, "mean_ratio_ci": [means[lo], means[hi]],
            "oom": sum(s["oom"] for s in scores), "unmeasured": len(scores) - len(ratios)}


def run_seed(seed: int, visible: bool, n_history: int, n_held: int, iterations: int, workdir: Path,
             source: str = "gavel_sim") -> dict[str, Any]:
    """One history imported, trained on and decided over; the scores of every policy."""
    from slurmgpu.history import db
    from slurmgpu.history.imports import import_history
    from slurmgpu.learning import evaluation, train
    from slurmgpu.pipeline.config import load_config
    from slurmgpu.pipeline.policy import ModelDecider
    from slurmgpu.pipeline.request import build_request
    from slurmgpu.pipeline.script import parse_script

    table = throughputs(source)
    fams = families(table)
    history, held = workload(seed, fams, table, n_history, n_held)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "slurmgpu.toml").write_text(CONFIG_TOML)
    config = load_config(workdir / "slurmgpu.toml")
    # The held-out jobs ran as asked and are in accounting too, after the history: what `slurmgpu
    # evaluate` would judge the decider by. The models learn from the history's rows only.
    rows = accounting([*history, *held], table, seed, visible)
    write_csv(workdir / "history.csv", rows)
    url = f"sqlite:///{workdir / 'history.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    import_history(engine, str(workdir / "history.csv"), "bench")
    held_ids = {j.job_id for j in held}
    read = train.history_rows(engine)
    test_rows = [r for r in read if r["job_id"] in held_ids or r["job_id"][:-1] in held_ids]
    train_rows = [r for r in read if r not in test_rows]
    started = time.perf_counter()
    bundle = train.fit(train_rows, config, iterations=iterations)[0]
    trained_s = time.perf_counter() - started
    replayed = evaluation.replay(bundle, config, train_rows, test_rows)
    self_judged = {"runtime_mdape": train.evaluate(bundle, train_rows, test_rows, config)["runtime_mdape"],
                   **{k: replayed.get(k) for k in ("throughput_jobs", "throughput_hidden_work",
                                                   "throughput_model_within_5pct",
                                                   "throughput_model_mean", "throughput_datasheet_within_5pct",
                                                   "throughput_datasheet_mean")}}
    policies: dict[str, list[dict[str, Any]]] = {"decider": [], "requests": [], "datasheet": [], "oracle": []}
    moved = 0
    misses = []  # the decider's choices short of 5% of the best, worst first: for whoever tunes it
    for job in held:
        fam = job.family
        text = script(fam, job.gpu_type, job.steps if visible else None)
        request = build_request(parse_script(text.encode(), "job.sh"), [], {}, config.gpu_features())
        decision = ModelDecider(config, bundle, lambda: {}, job.user).decide(request)
        change = decision.changes[0] if decision.changes and not decision.refusal else None
        chosen = ((change.gpu_type if change and change.gpu_type else job.gpu_type),
                  (change.gpus_total if change and change.gpus_total else fam.gpus))
        moved += chosen != (job.gpu_type, fam.gpus)
        policies["decider"].append(score(fam, chosen, table))
        ratio = policies["decider"][-1]["ratio"]
        if ratio is not None and ratio < WITHIN:
            misses.append({"job": f"{fam.model} batch {fam.batch or '-'} on {fam.gpus} GPU(s)",
                           "asked": job.gpu_type, "chosen": f"{chosen[1]} x {chosen[0]}",
                           "best": oracle(fam, table)[0], "ratio": round(ratio, 3),
                           "reason": "; ".join(decision.reasons)})
        policies["requests"].append(score(fam, (job.gpu_type, fam.gpus), table))
        policies["datasheet"].append(score(fam, (datasheet_choice(fam), fam.gpus), table))
        policies["oracle"].append(score(fam, (oracle(fam, table)[0], fam.gpus), table))
    rng = random.Random(seed)
    return {"seed": seed, "work": "visible" if visible else "hidden", "history_rows": len(train_rows),
            "history_oom_rows": sum(r["state"] == "OUT_OF_MEMORY" for r in train_rows),
            "held_out": len(held), "decider_changed": moved, "train_s": round(trained_s, 1),
            **{name: summary(scores, rng) for name, scores in policies.items()},
            "decider_misses": sorted(misses, key=lambda m: m["ratio"])[:10],
            # What `slurmgpu evaluate` reports on the same held-out jobs, judged by the history's own
            # runtimes (hidden work and all), and train's runtime error there.
            "evaluate_on_history": self_judged}


def _cell(s: dict[str, Any]) -> str:
    if not s.get("jobs"):
        return "no measured choice"
    lo, hi = s["within_5pct_ci"]
    mlo, mhi = s["mean_ratio_ci"]
    text = f"{s['within_5pct']:.0%} [{lo:.0%}-{hi:.0%}] / {s['mean_ratio']:.3f} [{mlo:.3f}-{mhi:.3f}] / {s['oom']}"
    return text + (f" ({s['unmeasured']} unmeasured)" if s["unmeasured"] else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _pair(e: dict[str, Any], who: str) -> str:
    mean = e.get(f"throughput_{who}_mean")
    return f"{_pct(e.get(f'throughput_{who}_within_5pct'))} / {'-' if mean is None else f'{mean:.3f}'}"


def table_md(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: per variant and seed, each policy's share within 5% / mean ratio / OOMs."""
    lines = ["| work | seed | decider | users' requests | datasheet rule | oracle | decider moved |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['work']} | {r['seed']} | {_cell(r['decider'])} | {_cell(r['requests'])} | "
                     f"{_cell(r['datasheet'])} | {_cell(r['oracle'])} | {r['decider_changed']}/{r['held_out']} |")
    lines += ["", "What `slurmgpu evaluate` reports on the same held-out jobs, judged by the history's runtimes "
              "(within 5% / mean ratio; - where no job was judged: it judges no job whose script hides its work), "
              "and train's runtime MdAPE:", "",
              "| work | seed | decider | datasheet rule | runtime MdAPE |", "|---|---|---|---|---|"]
    for r in results:
        e = r["evaluate_on_history"]
        lines.append(f"| {r['work']} | {r['seed']} | {_pair(e, 'model')} | {_pair(e, 'datasheet')} | "
                     f"{_pct(e['runtime_mdape'])} |")
    for work in dict.fromkeys(r["work"] for r in results):
        rs = [r for r in results if r["work"] == work and r["decider"].get("jobs") and r["datasheet"].get("jobs")]
        held = sum(r["decider"]["within_5pct"] >= r["datasheet"]["within_5pct"]
                   and r["decider"]["mean_ratio"] >= r["datasheet"]["mean_ratio"] for r in rs)
        lines.append(f"\n{work} work: the decider at least the datasheet rule on both figures on {held} of "
                     f"{len(rs)} seeds")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds")
    parser.add_argument("--history", type=int, default=1500, help="history jobs per seed")
    parser.add_argument("--held-out", type=int, default=128, help="later jobs the decider is asked about")
    parser.add_argument("--iterations", type=int, default=400, help="boosting iterations (as slurmgpu train)")
    parser.add_argument("--source", default="gavel_sim", choices=("gavel_sim", "gavel_phys"))
    parser.add_argument("--work", default="hidden,visible", help="variants: hidden, visible or both")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"--seeds {args.seeds!r}: give integers separated by commas", file=sys.stderr)
        return 2
    variants = [v.strip() for v in args.work.split(",")]
    if not variants or any(v not in ("hidden", "visible") for v in variants):
        print(f"--work {args.work!r}: give hidden, visible or both", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            for seed in seeds:
                r = run_seed(seed, variant == "visible", args.history, args.held_out, args.iterations,
                             Path(tmp) / f"{variant}-{seed}", args.source)
                results.append(r)
                print(f"{variant} seed {seed}: decider {_cell(r['decider'])}; datasheet {_cell(r['datasheet'])} "
                      f"(trained in {r['train_s']} s)", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "source": args.source, "history_jobs": args.history, "held_out": args.held_out,
        "iterations": args.iterations, "work_sigma": WORK_SIGMA, "within": WITHIN,
        "figures": "within_5pct / mean_ratio / oom; intervals: bootstrap 95% over held-out jobs",
        "results": results}, indent=2) + "\n")
    print("share within 5% of the measured-fastest type [95% CI] / mean throughput ratio [95% CI] / OOMs\n")
    print(table_md(results))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
