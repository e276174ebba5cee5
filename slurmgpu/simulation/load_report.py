"""A load sweep's report: per load, the allocated share and waits per GPU type beside the scenario's
own files (scenario_report); over all loads, a summary table with the issue's targets for the decider."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from slurmgpu.simulation.load import Calibration, allocated_share, capacity, window
from slurmgpu.simulation.scenario import POLICIES, Evaluation, PolicyResult
from slurmgpu.simulation.scenario_report import write_report

# The decider's targets (issue 30): fewer failures and OOMs than the requests, mean JCT within
# these factors of the requests' and the oracle's.
MAX_JCT_VS_REQUEST = 0.70
MAX_JCT_VS_ORACLE = 1.3


class LoadRun(NamedTuple):
    calibration: Calibration
    evaluation: Evaluation


def directory_name(load: float) -> str:
    return f"load-{load:g}"


def shares(ev: Evaluation) -> dict[str, float]:
    """Each policy's allocated share over the request policy's window (the same span for all)."""
    span = window(ev.policies[0].results)
    gpus = capacity(ev.scenario.cluster)
    return {p.name: allocated_share(p.results, gpus, span) for p in ev.policies}


def waits_by_type(p: PolicyResult) -> dict[str, dict[str, float]]:
    """Jobs, median and 90th-percentile wait (s) per GPU type the policy ran them on."""
    by: dict[str, list[float]] = {}
    for r in p.results:
        by.setdefault(r.gpu_type, []).append(r.wait_s)
    return {t: {"jobs": len(w), "p50_wait_s": float(np.percentile(w, 50)), "p90_wait_s": float(np.percentile(w, 90))}
            for t, w in sorted(by.items())}


def checks(ev: Evaluation) -> dict[str, bool]:
    """The decider against the issue's targets."""
    by = {p.name: p.summary for p in ev.policies}
    d, r, o = by["slurmgpu"], by["request"], by["oracle"]
    return {"failed below the requests'": d.failed < r.failed, "OOM below the requests'": d.oom < r.oom,
            f"mean JCT <= {MAX_JCT_VS_REQUEST:g}x the requests'": d.mean_jct_s <= MAX_JCT_VS_REQUEST * r.mean_jct_s,
            f"mean JCT <= {MAX_JCT_VS_ORACLE:g}x the oracle's": d.mean_jct_s <= MAX_JCT_VS_ORACLE * o.mean_jct_s}


def _h(seconds: float) -> str:
    return f"{seconds / 3600:,.2f}"


def load_markdown(run: LoadRun) -> str:
    cal, ev = run.calibration, run.evaluation
    share = shares(ev)
    types = sorted({t for p in ev.policies for t in waits_by_type(p)})
    waits = {p.name: waits_by_type(p) for p in ev.policies}
    head = ["GPU type", *(f"{POLICIES[p.name]} {q}" for p in ev.policies for q in ("jobs", "p50 h", "p90 h"))]
    lines = [f"# Load {cal.load:g}: {ev.scenario.rate:,.0f} jobs a day over {ev.scenario.days:g} days, "
             f"seed {ev.scenario.seed}", "",
             "Calibration pilots (jobs a day -> share of GPUs allocated, every request as asked): "
             + ", ".join(f"{rate:,.0f} -> {got:.1%}" for rate, got in cal.pilots) + ".", "",
             "Share of the GPUs allocated over the evaluated submissions (less the first day):", "",
             "| policy | allocated |", "|---|---|",
             *(f"| {POLICIES[n]} | {s:.1%} |" for n, s in share.items()), "",
             "Waits by the GPU type each policy ran the jobs on (hours):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in types:
        cells = []
        for p in ev.policies:
            w = waits[p.name].get(t)
            cells += [f"{w['jobs']:,}", _h(w["p50_wait_s"]), _h(w["p90_wait_s"])] if w else ["0", "", ""]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += ["", "The decider against the targets: "
              + "; ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in checks(ev).items()) + ".", "",
              "Per-policy figures: [results.md](results.md). ![Allocated GPUs](allocated_gpus.svg)", ""]
    return "\n".join(lines)


def load_json(run: LoadRun) -> dict[str, Any]:
    cal, ev = run.calibration, run.evaluation
    return {"load": cal.load, "jobs_per_day": ev.scenario.rate, "days": ev.scenario.days, "seed": ev.scenario.seed,
            "pilots": [{"jobs_per_day": r, "allocated": s} for r, s in cal.pilots],
            "allocated": shares(ev), "waits_by_type": {p.name: waits_by_type(p) for p in ev.policies},
            "checks": checks(ev)}


def write_load(run: LoadRun, report_dir: str) -> list[str]:
    """REPORT_DIR/load-<share>/: the scenario's files, load.md and load.json."""
    directory = os.path.join(report_dir, directory_name(run.calibration.load))
    paths = write_report(run.evaluation, directory)
    for name, text in (("load.md", load_markdown(run)), ("load.json", json.dumps(load_json(run), indent=2) + "\n")):
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        paths.append(path)
    return paths


SUMMARY_COLUMNS = ("load", "jobs/day", "allocated", "policy", "mean JCT h", "x request", "x oracle", "p50 wait h",
                   "p90 wait h", "OOM", "timeout", "failed")


def summary_markdown(runs: Sequence[LoadRun]) -> str:
    """One row per load and policy; the decider's targets per load below."""
    lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    notes = []
    for run in runs:
        ev = run.evaluation
        share = shares(ev)
        by = {p.name: p for p in ev.policies}
        for p in ev.policies:
            s = p.summary
            wait = np.array([r.wait_s for r in p.results])
            lines.append("| " + " | ".join((
                f"{run.calibration.load:g}", f"{ev.scenario.rate:,.0f}", f"{share[p.name]:.1%}", POLICIES[p.name],
                _h(s.mean_jct_s), f"{s.mean_jct_s / by['request'].summary.mean_jct_s:.2f}",
                f"{s.mean_jct_s / by['oracle'].summary.mean_jct_s:.2f}", _h(float(np.percentile(wait, 50))),
                _h(float(np.percentile(wait, 90))), f"{s.oom:,}", f"{s.timeout:,}", f"{s.failed:,}")) + " |")
        notes.append(f"- load {run.calibration.load:g} ({ev.evaluated:,} jobs evaluated, seed {ev.scenario.seed}, "
                     f"{ev.scenario.days:g} days; [details]({directory_name(run.calibration.load)}/load.md)): "
                     + "; ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in checks(ev).items()))
    busiest = max(runs, key=lambda r: r.calibration.load)
    return ("# Policies by load\n\n" + "\n".join(lines) + "\n\nallocated: share of the cluster's GPUs held over the "
            "evaluated submissions, less the first day. failed: every job that did not complete (OOM and timeout "
            "included). x request, x oracle: mean JCT over theirs.\n\nThe decider against the targets:\n\n"
            + "\n".join(notes) + f"\n\n![JCT CDF at load {busiest.calibration.load:g}]"
            f"({directory_name(busiest.calibration.load)}/jct_cdf.svg)\n")


def write_summary(runs: Sequence[LoadRun], report_dir: str) -> str:
    os.makedirs(report_dir, exist_ok=True)
    path = os.path.join(report_dir, "load-summary.md")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(summary_markdown(runs))
    return path
