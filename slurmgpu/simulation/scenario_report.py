"""A scenario's results as JSON, a Markdown table with notes, and SVG charts (JCT CDF, GPUs allocated)."""

from __future__ import annotations

import json
import math
import os
from typing import Any
from xml.sax.saxutils import escape

import numpy as np

from slurmgpu.history.queries import IDLE_UTIL_PCT
from slurmgpu.reporting.render import PALETTE, axis_scale
from slurmgpu.simulation.scenario import POLICIES, Evaluation, PolicyResult, sim_cluster

COLUMNS = ("policy", "jobs", "mean JCT h", "p50 JCT h", "p99 JCT h", "mean wait h", "p50 wait h", "p99 wait h",
           "makespan d", "GPU-hours", "mem used", "idle GPU-h", "OOM", "timeout", "failed")



def _row(p: PolicyResult) -> tuple[str, ...]:
    s, e = p.summary, p.efficiency
    hours = [f"{v / 3600:,.2f}" for v in (s.mean_jct_s, s.p50_jct_s, s.p99_jct_s, s.mean_wait_s, s.p50_wait_s,
                                           s.p99_wait_s)]
    return (POLICIES[p.name], f"{s.jobs:,}", *hours, f"{s.makespan_s / 86400:,.1f}", f"{s.gpu_hours:,.0f}",
            f"{e.mem_used_share:.1%}", f"{e.idle_gpu_hours:,.0f}", f"{s.oom:,}", f"{s.timeout:,}", f"{s.failed:,}")



def markdown_table(ev: Evaluation) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(p)) + " |" for p in ev.policies]
    return "\n".join(lines) + "\n"



def to_json(ev: Evaluation) -> dict[str, Any]:
    sc = ev.scenario
    return {
        "scenario": {"name": sc.name, "cluster": sc.cluster.name, "seed": sc.seed, "days": sc.days,
                     "start": sc.start.isoformat(), "train_share": sc.train_share, "iterations": sc.iterations,
                     "gpus": {t: sim_cluster(sc.cluster).capacity(t) for t in sc.cluster.gpu_types()}},
        "jobs": {"generated": ev.generated, "train": ev.train_jobs, "evaluated": ev.evaluated,
                 "unfittable": ev.unfittable},
        "decider": ev.decider,
        "gpu_types": {t.name: t._asdict() for t in ev.config.gpu_types.values()},
        "policies": {p.name: {"label": POLICIES[p.name], "note": p.note,
                              **{k: v for k, v in p.summary._asdict().items() if k != "utilisation"},
                              **p.efficiency._asdict()} for p in ev.policies},
        "seconds": ev.seconds,
    }



def _notes(ev: Evaluation) -> list[str]:
    sc = ev.scenario
    return [f"Scenario `{sc.name}`: {ev.generated:,} jobs over {sc.days:.1f} days on cluster `{sc.cluster.name}` "
            f"({sum(sim_cluster(sc.cluster).capacity(t) for t in sc.cluster.gpu_types())} GPUs, "
            f"{len(sc.cluster.gpu_types())} types), seed {sc.seed}. The first {ev.train_jobs:,} by submit time train "
            f"the decider; the other {ev.evaluated:,} are evaluated under every policy.",
            f"slurmgpu decider: {ev.decider}. Each job is decided at its submit time"
            + (" from the simulated queue as squeue shows it then (running jobs hold their GPUs for the time left "
               "to their limits, pending ones for their limits)" if ev.decider == "model" else "")
            + "; true peaks and run times are never seen.",
            f"{ev.unfittable} evaluated jobs fit no card in the cluster: they run out of memory under every policy.",
            *(f"{POLICIES[p.name]}: {p.note}." for p in ev.policies),
            "Times in hours (makespan in days). mem used: per-GPU peak / card memory over allocated GPUs, "
            f"weighted by GPU-hours; idle GPU-h: jobs below {IDLE_UTIL_PCT:g}% mean utilisation; failed: every job "
            "that did not complete (OOM and TIMEOUT included)."]



def to_markdown(ev: Evaluation) -> str:
    notes = "\n".join(f"- {n}" for n in _notes(ev))
    return (f"# Policy evaluation: scenario {ev.scenario.name}\n\n{markdown_table(ev)}\n{notes}\n\n"
            "![JCT CDF](jct_cdf.svg)\n\n![Allocated GPUs](allocated_gpus.svg)\n")



Series = list[tuple[str, list[tuple[float, float]]]]



def line_chart(title: str, x_label: str, y_label: str, series: Series, *, log_x: bool = False,
               y_max: float | None = None, y_ref: float | None = None) -> str:
    """A self-contained SVG line chart (no dependency): one polyline per series, a legend, and a
    dashed line at ``y_ref`` (a limit such as the cluster's capacity)."""
    width, height, left, right, top, bottom = 760, 420, 70, 170, 36, 50
    pw, ph = width - left - right, height - top - bottom
    xs = [x for _, pts in series for x, _ in pts]
    if log_x:
        lo, hi = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
        hi = max(hi, lo + 1)
        ticks = [(10.0 ** e, f"{10.0 ** e:g}") for e in range(lo, hi + 1)]

        def fx(x: float) -> float:
            return (math.log10(x) - lo) / (hi - lo)
    else:
        step, n = axis_scale(max(xs))
        ticks = [(step * i, f"{step * i:g}") for i in range(n + 1)]

        def fx(x: float) -> float:
            return x / (step * n)
    ystep, yn = axis_scale(y_max if y_max is not None else max(y for _, pts in series for _, y in pts))
    ytop = ystep * yn
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for value, label in ticks:
        x = left + fx(value) * pw
        out += [f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e4e7eb"/>',
                f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{escape(label)}</text>']
    for i in range(yn + 1):
        y = top + ph - ph * i / yn
        out += [f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e4e7eb"/>',
                f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{ystep * i:g}</text>']
    out += [f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle">{escape(x_label)}</text>',
            f'<text transform="translate(16 {top + ph / 2}) rotate(-90)" text-anchor="middle">{escape(y_label)}</text>']
    if y_ref is not None:
        y = top + ph - min(y_ref / ytop, 1.0) * ph
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#52606d" '
                   'stroke-dasharray="6 4"/>')
    for i, (name, pts) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{left + fx(x) * pw:.1f},{top + ph - min(y / ytop, 1.0) * ph:.1f}" for x, y in pts)
        ly = top + 10 + 18 * i
        out += [f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{path}"/>',
                f'<line x1="{left + pw + 12}" y1="{ly}" x2="{left + pw + 32}" y2="{ly}" stroke="{color}" '
                'stroke-width="3"/>',
                f'<text x="{left + pw + 38}" y="{ly + 4}">{escape(name)}</text>']
    return "\n".join([*out, "</svg>"]) + "\n"



def jct_cdf_svg(ev: Evaluation, points: int = 200) -> str:
    """Share of jobs done within x hours of submission, log x (JCTs span seconds to days)."""
    series = []
    for p in ev.policies:
        jct = np.maximum(np.array([r.jct_s for r in p.results]) / 3600, 1 / 3600)
        share = np.linspace(0, 1, points + 1)
        series.append((POLICIES[p.name], list(zip(np.quantile(jct, share).tolist(), share.tolist(), strict=True))))
    return line_chart("Job completion time (CDF)", "JCT, hours (log scale)", "share of jobs", series, log_x=True,
                      y_max=1.0)



def allocated_svg(ev: Evaluation, points: int = 600) -> str:
    """GPUs allocated over time (all types), sampled from each policy's allocation step function."""
    end = max(p.summary.makespan_s for p in ev.policies)
    grid = np.linspace(0, end, points + 1)
    series = []
    for p in ev.policies:
        times = np.array([t for t, _ in p.summary.utilisation])
        totals = np.array([sum(a.values()) for _, a in p.summary.utilisation], dtype=float)
        at = np.searchsorted(times, grid, side="right") - 1
        values = np.where(at >= 0, totals[np.maximum(at, 0)], 0.0)
        series.append((POLICIES[p.name], list(zip((grid / 86400).tolist(), values.tolist(), strict=True))))
    capacity = sum(sim_cluster(ev.scenario.cluster).capacity(t) for t in ev.scenario.cluster.gpu_types())
    return line_chart(f"Allocated GPUs ({capacity} in the cluster)", "days since the first evaluated submission",
                      "GPUs allocated", series, y_max=capacity, y_ref=capacity)



def write_report(ev: Evaluation, directory: str) -> list[str]:
    """results.json, results.md, jct_cdf.svg and allocated_gpus.svg; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    files = {"results.json": json.dumps(to_json(ev), indent=2) + "\n", "results.md": to_markdown(ev),
             "jct_cdf.svg": jct_cdf_svg(ev), "allocated_gpus.svg": allocated_svg(ev)}
    paths = []
    for name, text in files.items():
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        paths.append(path)
    return paths
