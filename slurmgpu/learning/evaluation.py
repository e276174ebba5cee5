"""The deployed decision replayed on a held-out window, and judged by what the history measured.

``train.evaluate`` scores the models' numbers; this scores what an admin switches on: the
``ModelDecider`` with its bundle, margins and thresholds, deciding each held-out job from its script
as gsbatch would (no queue: the history cannot say what a job would have waited elsewhere, so the
comparison is of run time, GPU-hours and failures; ``slurmgpu scenario`` simulates the waits).

What a change would have done is read off the history, never off the model: a job moved to a card
fits when its measured peak (or the card it completed on) is no larger, and does not when it ran out
of memory on a card at least as large; its run time is its family's measured speed on the new shape
(``rate:`` statistics over the whole history, the test window included: they are measurements).
A change the history cannot judge is counted as such, not guessed.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from slurmgpu.learning.censored import INF, memory_interval
from slurmgpu.learning.train import gpu_oom
from slurmgpu.pipeline.bundle import Bundle
from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.features import log_rate, rate_keys
from slurmgpu.pipeline.policy import ModelDecider
from slurmgpu.pipeline.request import JobRequest, build_request
from slurmgpu.pipeline.script import parse_script

WITHIN = 0.95  # a type "within 5%" of the best measured throughput


def _request(row: Mapping[str, Any], config: Config) -> JobRequest | None:
    """The job as its user asked, from its script; the GPUs it ran on where the script does not say
    (an imported history keeps them in columns), its partition where the script names none. Not
    sacct's time limit where the script writes none: that is a partition's default, which gsbatch
    does not see either (the decider and training read the limit written, ``train.written_limit``)."""
    try:
        script = parse_script(row["text"].encode("utf-8", "surrogateescape"), f"job {row['job_id']}")
        request = build_request(script, [], {}, config.gpu_features())
        extra = []
        if not request.main.gpus_total:
            extra.append(f"--gres=gpu:{row['gpu_type']}:{row['gpus']}")
        if not request.main.partitions and row.get("partition") in config.partitions:
            extra.append(f"--partition={row['partition']}")
        return build_request(script, extra, {}, config.gpu_features()) if extra else request
    except (ValueError, InputError):  # a script sbatch would refuse: no request to replay
        return None


def _measured_rates(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per family, per shape (``rate_keys``: at a batch, and over all batches): the median of
    log(elapsed / (steps x tokens)) of its completed runs there."""
    runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["state"] == "COMPLETED" and r.get("elapsed") and r.get("gpu_type"):
            s = r["script"]
            for key in rate_keys(r["gpus"], r["gpu_type"], s["log_tokens"]):
                runs[s["family"]][key].append(log_rate(r["elapsed"], s))
    return {fam: {shape: sorted(v)[len(v) // 2] for shape, v in shapes.items()} for fam, shapes in runs.items()}


def replay(bundle: Bundle, config: Config, train_rows: list[dict[str, Any]],
           test_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Replay the model decider on TEST_ROWS (it was trained on rows before them) and judge it."""
    decider = ModelDecider(config, bundle, lambda: {}, wait=lambda gpu_type, gpus, **_: 0.0)
    rates = _measured_rates([*train_rows, *test_rows])
    out: dict[str, Any] = {"test_jobs": len(test_rows), "replayed": 0, "changed": 0, "type_changed": 0,
                           "count_changed": 0, "placed_fits": 0, "placed_no_fit": 0, "placed_unknown": 0,
                           "oom_as_asked": 0, "oom_decided": 0, "runtime_h_as_asked": 0.0,
                           "runtime_h_decided": 0.0, "gpu_h_as_asked": 0.0, "gpu_h_decided": 0.0,
                           "runtime_jobs": 0, "runtime_unmeasured": 0, "throughput_hidden_work": 0, "moves": []}
    under: dict[str, list[bool]] = defaultdict(list)
    picks: list[tuple[float | None, ...]] = []  # PICKERS' picks, each over the best measured throughput
    for row in test_rows:
        if not row.get("text") or not row.get("gpu_type"):
            continue
        request = _request(row, config)
        if request is None or not request.main.gpus_total:
            continue
        out["replayed"] += 1
        oom = gpu_oom(row, config)
        sf = row["script"]  # history_rows read it from this very text
        decision = decider.decide(request)
        asked = (row["gpu_type"], int(row["gpus"]))
        change = decision.changes[0] if decision.changes and not decision.refusal else None
        chosen = (change.gpu_type or asked[0] if change else asked[0],
                  change.gpus_total or asked[1] if change else asked[1])
        ran = next((c for c in decision.per_type if (c.gpu_type, c.gpus) == asked), None)
        if ran is not None and row.get("peak") and not oom:
            under[sf["family"]].append(ran.pred_peak_mem_mib < row["peak"])
        out["oom_as_asked"] += oom
        card = config.gpu_types.get(asked[0])
        need = memory_interval({**row, "oom": oom}, card.memory_gib * 1024 if card else 0.0)
        if chosen != asked:
            out["changed"] += 1
            out["type_changed"] += chosen[0] != asked[0]
            out["count_changed"] += chosen[1] != asked[1]
            verdict = _fits(need, config.gpu_types[chosen[0]].memory_gib * 1024,
                            sharded=float(sf.get("zero", 0.0)) > 0 and chosen[1] < asked[1])
            out[f"placed_{verdict}"] += 1
            out["oom_decided"] += verdict == "no_fit"
            out["moves"].append({"job_id": row["job_id"], "asked": f"{asked[1]}x{asked[0]}",
                                 "chosen": f"{chosen[1]}x{chosen[0]}", "verdict": verdict})
        else:
            out["oom_decided"] += oom
        # Run time and GPU-hours, where the history measured both shapes (or the job kept its own).
        if row["state"] == "COMPLETED" and row.get("elapsed"):
            rate = rates.get(sf["family"], {})
            decided_s = row["elapsed"] if chosen == asked else _runtime(rate, chosen, sf, row, asked)
            if decided_s is None:
                out["runtime_unmeasured"] += 1
            else:
                out["runtime_jobs"] += 1
                out["runtime_h_as_asked"] += row["elapsed"] / 3600
                out["runtime_h_decided"] += decided_s / 3600
                out["gpu_h_as_asked"] += row["elapsed"] * asked[1] / 3600
                out["gpu_h_decided"] += decided_s * chosen[1] / 3600
            if sf.get("work_shown", 1):
                picks.extend(_throughput(decider, sf, asked, chosen[0], rate))
            else:
                out["throughput_hidden_work"] += 1
    n_fam = {f: v for f, v in under.items() if v}
    out["memory_jobs"] = sum(len(v) for v in n_fam.values())
    out["memory_under_predicted"] = (sum(sum(v) for v in n_fam.values()) / out["memory_jobs"]
                                     if out["memory_jobs"] else None)
    # Calibration per family: the share of its jobs under-predicted, for families with 5+ jobs.
    per_family = {f: sum(v) / len(v) for f, v in n_fam.items() if len(v) >= 5}
    out["families_calibrated"] = len(per_family)
    out["families_under_over_5pct"] = sorted(f for f, share in per_family.items() if share > 0.05)
    out["throughput_jobs"] = len(picks)
    for i, who in enumerate(PICKERS):
        values = [p[i] for p in picks]
        out[f"throughput_{who}_within_5pct"], out[f"throughput_{who}_mean"] = _scores(values)
        out[f"throughput_{who}_within_5pct_ci"], out[f"throughput_{who}_mean_ci"] = _intervals(values)
        out[f"throughput_{who}_unmeasured"] = sum(v is None for v in values)
    return out


PICKERS = ("model", "datasheet", "users")  # the decider's type, the datasheet's fastest, the type asked
PICKER_NAMES = ("model", "datasheet's fastest", "users' own")
BOOTSTRAP_DRAWS = 500


def _scores(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """The share of jobs within 5% of the best measured throughput (an unmeasured pick is not) and
    the mean ratio over the measured picks."""
    measured = [v for v in values if v is not None]
    return ((sum(v >= WITHIN for v in measured) / len(values)) if values else None,
            (sum(measured) / len(measured)) if measured else None)


def _intervals(values: Sequence[float | None]) -> tuple[list[float] | None, list[float] | None]:
    """95% bootstrap intervals of both ``_scores`` over the jobs (a fixed seed: the same history
    gives the same figures): a share of 40 jobs is not a share of 4,000."""
    if not values:
        return None, None
    rng = random.Random(0)
    draws = [_scores(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_DRAWS)]
    out: list[list[float] | None] = []
    for i in (0, 1):
        got = sorted(v for d in draws if (v := d[i]) is not None)
        out.append([got[int(0.025 * (len(got) - 1))], got[int(0.975 * (len(got) - 1))]] if got else None)
    return out[0], out[1]


def _fits(need: tuple[float, float] | None, card_mib: float, sharded: bool) -> str:
    """What the history says of a job on a card of CARD_MIB per GPU: "fits", "no_fit" or "unknown"."""
    if need is None or sharded:  # fewer GPUs of a sharded job hold more each: nothing measured says how much
        return "unknown"
    low, high = need
    if high != INF and high <= card_mib:
        return "fits"
    if low >= card_mib:
        return "no_fit"
    return "unknown"


def _runtime(rate: Mapping[str, float], chosen: tuple[str, int], sf: Mapping[str, Any], row: Mapping[str, Any],
             asked: tuple[str, int]) -> float | None:
    """The job's run time on CHOSEN from its family's measured speed ratio between the two shapes."""
    new, old = rate.get(f"{chosen[1]}x{chosen[0]}"), rate.get(f"{asked[1]}x{asked[0]}")
    if new is None or old is None:
        return None
    return float(row["elapsed"]) * math.exp(new - old)


def _throughput(decider: ModelDecider, sf: Mapping[str, Any], asked: tuple[str, int], decided: str,
                rate: Mapping[str, float]) -> list[tuple[float | None, ...]]:
    """For a job whose family ran at its GPU count on two or more types: the measured throughput of
    the type the decider chose (DECIDED, the request kept where its gain was too small), of the
    datasheet's fastest and of the type the user asked for (``PICKERS``), relative to the best type
    measured. Types the job may not move to (bf16 on a card without it) are left out. Only for a
    script that shows its amount of work (the caller): else one family's runs spread with their
    hidden work, and its medians judge a choice by the same noise the model learned from."""
    types = [t for t in decider.config.gpu_types
             if t == asked[0] or decider.evidence.runs_there(sf, asked[0], t)]
    for at in (0, 1):  # the job's own batch where two types ran it, else the family's batches together
        measured = {t: rate[key] for t in types if (key := rate_keys(asked[1], t, sf["log_tokens"])[at]) in rate}
        if len(measured) >= 2:
            break
    else:
        return []
    best = min(measured.values())  # log seconds per unit of work: the smallest is the fastest

    def relative(t: str) -> float | None:
        return math.exp(best - measured[t]) if t in measured else None

    sheet = max(types, key=lambda t: decider.config.gpu_types[t].speed(sf["precision_bits"]))
    return [(relative(decided), relative(sheet), relative(asked[0]))]


def recorded_summary(r: Mapping[str, Any]) -> list[str]:
    """One line per source of the recorded decisions' outcomes."""
    lines = [f"decisions this version made (recorded): {r['decisions']}"]
    for source, sides in sorted(r["by_source"].items()):
        for side in ("changed", "kept"):
            states = ", ".join(f"{n} {state}" for state, n in sorted(sides[side].items()))
            lines.append(f"  {source}, {side}: {states or 'none'}")
    return lines


def summary(r: Mapping[str, Any]) -> list[str]:
    """The replay in a few lines: every figure is one of ``replay``'s."""
    lines = [f"decider replayed on {r['replayed']} of {r['test_jobs']} held-out jobs (those with a stored script): "
             f"{r['changed']} changed ({r['type_changed']} type, {r['count_changed']} count)"]
    if r["changed"]:
        lines.append(f"  placed where it does not fit: {r['placed_no_fit']} (the history shows it); "
                     f"fits: {r['placed_fits']}; the history cannot tell: {r['placed_unknown']}")
    lines.append(f"  GPU OOM: {r['oom_as_asked']} as asked, {r['oom_decided']} decided"
                 + (f" (+ up to {r['placed_unknown']} the history cannot tell)" if r["placed_unknown"] else ""))
    if r["runtime_jobs"]:
        lines.append(f"  run time {r['runtime_h_decided']:.1f} h vs {r['runtime_h_as_asked']:.1f} h as asked, "
                     f"GPU-hours {r['gpu_h_decided']:.1f} vs {r['gpu_h_as_asked']:.1f}, on {r['runtime_jobs']} "
                     f"completed jobs ({r['runtime_unmeasured']} moved to a shape their family never ran: left out)")
    if r["memory_under_predicted"] is not None:
        lines.append(f"  peak memory under-predicted on {r['memory_under_predicted']:.1%} of {r['memory_jobs']} jobs; "
                     f"{len(r['families_under_over_5pct'])} of {r['families_calibrated']} families (5+ jobs) "
                     "over 5%")
    if r.get("throughput_hidden_work"):
        lines.append(f"  type picked: not judged on {r['throughput_hidden_work']} completed jobs whose scripts show no "
                     "amount of work (their family's runtimes spread with it, not with the card)")
    if r["throughput_jobs"]:
        lines.append(f"  type picked, on {r['throughput_jobs']} jobs whose family ran on several types: within 5% of "
                     "the best measured throughput [95% interval], mean of the best [interval]")
        for who, name in zip(PICKERS, PICKER_NAMES, strict=True):
            lines.append(f"    {name}: {picked(r, who) or 'never one the family was measured on'}")
    return lines


def picked(r: Mapping[str, Any], who: str) -> str | None:
    """How well one of PICKERS picked types in ``replay``'s figures: 'share [interval], mean m [interval]'
    (None where it never picked one the family was measured on)."""
    if r.get(f"throughput_{who}_mean") is None:
        return None
    share, mean = r[f"throughput_{who}_within_5pct"], r[f"throughput_{who}_mean"]
    share_ci, mean_ci = r.get(f"throughput_{who}_within_5pct_ci"), r.get(f"throughput_{who}_mean_ci")
    return (f"{share:.1%}" + (f" [{share_ci[0]:.1%}-{share_ci[1]:.1%}]" if share_ci else "")
            + f", mean {mean:.3f}" + (f" [{mean_ci[0]:.3f}-{mean_ci[1]:.3f}]" if mean_ci else ""))


def recorded(decisions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the decisions a model version actually made came to (``history.queries.decision_rows``
    for its digest): per source (gsbatch, lua) and kept or changed, how their jobs ended."""
    out: dict[str, Any] = {"decisions": len(decisions), "by_source": {}}
    for d in decisions:
        side = out["by_source"].setdefault(d["source"] or "gsbatch", {"kept": {}, "changed": {}})
        states = side["changed" if d["changed"] else "kept"]
        state = d["state"] or "not in the accounting yet"
        states[state] = states.get(state, 0) + 1
    return out
