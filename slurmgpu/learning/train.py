"""Training and held-out evaluation of the models, from the history database (pandas here only).

Every training row's history features are computed from strictly earlier jobs, as they would
have been known at its submission; the bundle ships the statistics as of the end of training.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from slurmgpu.collector.oom import HOST_OOM_STATE, ran_out_of_gpu_memory
from slurmgpu.history.db import GpuUsage, Job, Submission
from slurmgpu.learning.censored import INF, memory_interval
from slurmgpu.pipeline.bundle import (
    BUNDLE_VERSION,
    TIGHT_AFTER,
    Bundle,
    TreeEnsemble,
    arch_base_mib,
    memory_base_mib,
    memory_stratum,
    on_card,
    one_gpu_base,
    site_base_mib,
    zero_shift_mib,
)
from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.features import (
    BUSY,
    HELD,
    NUMERIC,
    RATE,
    RATE_N,
    RUNS,
    SCRIPT_NUMERIC,
    SITE_KIND,
    TYPE_OFFSET,
    UTIL,
    UTIL_RUNS,
    CountsLine,
    HistoryStats,
    card_features,
    counts_line,
    job_features,
    log_rate,
    published_counts,
    rate_keys,
    script_features,
    size_scale,
)
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_script

USED_STATES = ("COMPLETED", "OUT_OF_MEMORY", "TIMEOUT", "FAILED")


def history_rows(engine: Engine) -> list[dict[str, Any]]:
    """Jobs that ran on GPUs, with script features (from the stored script text where there is one,
    else gsbatch's record) and their measured per-GPU peak memory, oldest first.

    gsbatch records an array job under the id sbatch printed, so array tasks fall back to it.
    """
    from slurmgpu.history.db import JobScript
    from slurmgpu.history.queries import gpus_busy, of_job

    stmt = (select(Job.cluster, Job.job_id, Job.job_id_raw, Job.array_job_id, Job.user, Job.submit_time, Job.state,
                   Job.gpu_type, Job.gpu_count, Job.elapsed_s, Job.comment, Job.sacct_gpu_mem_mib, Job.end_time,
                   Job.start_time, Job.partition, Job.time_limit_s)
            .where(Job.gpu_count > 0, Job.state.in_(USED_STATES), Job.submit_time.is_not(None))
            .order_by(Job.submit_time, Job.job_id))
    out = []
    read: dict[str, dict[str, Any]] = {}
    with engine.connect() as conn:
        usage: dict[tuple[str, str], list[Any]] = {}  # the collector's rows of each job, one per host
        for u in conn.execute(select(GpuUsage.cluster, GpuUsage.job_id, GpuUsage.peak_mem_mib, GpuUsage.max_util,
                                     GpuUsage.gpu_oom, GpuUsage.detail, GpuUsage.mean_util)):
            usage.setdefault((u.cluster, u.job_id), []).append(u)
        peaks = {k: (max(u.peak_mem_mib for u in us), max((u.max_util for u in us if u.max_util is not None),
                                                             default=None)) for k, us in usage.items()}
        ooms = {k: max(found) for k, us in usage.items()  # the collector found a GPU OOM in the job's stderr
                if (found := [u.gpu_oom for u in us if u.gpu_oom is not None])}
        details = {k: [u.detail for u in us] for k, us in usage.items()}  # per-GPU figures, one list per host
        utils = {k: max(found) for k, us in usage.items()  # mean utilisation, the busiest host's
                 if (found := [u.mean_util for u in us if u.mean_util is not None])}
        records = {(c, j): (f, r, t) for c, j, f, r, t in conn.execute(
            select(Submission.cluster, Submission.job_id, Submission.features, Submission.original_request,
                   JobScript.text).outerjoin(JobScript, JobScript.sha256 == Submission.script_sha256))}
        for r in conn.execute(stmt).mappings():
            rec = records.get((r["cluster"], r["job_id"])) or (
                records.get((r["cluster"], str(r["array_job_id"]))) if r["array_job_id"] is not None else None)
            feats = ((rec[0] or {}).get("script") if rec else None)
            text = rec[2] if rec else None  # the script itself (job_scripts), where the record carried it
            if text is None and r["comment"] and r["comment"].startswith("script:"):
                text = r["comment"][len("script:"):]
            if text is not None:  # the script itself: features as this code reads them (reruns share one)
                feats = read.get(text) or read.setdefault(text, script_features(text))
            if not _well_formed(feats):  # a record from before a feature existed, or a malformed one
                continue
            key = (r["cluster"], r["job_id"], r["job_id_raw"])
            measured = of_job(peaks, *key)
            peak = measured[0] if measured else r["sacct_gpu_mem_mib"]
            oom, hosts = of_job(ooms, *key), of_job(details, *key)
            out.append({"job_id": r["job_id"], "user": r["user"], "submit": r["submit_time"], "state": r["state"],
                        "end": r["end_time"], "gpu_type": r["gpu_type"], "gpus": r["gpu_count"],
                        "elapsed": r["elapsed_s"],
                        "peak": peak, "script": feats, "request": (rec[1] if rec else None) or {},
                        "gpu_oom": oom, "gpus_used": gpus_busy(hosts or [], or_opened=True), "cluster": r["cluster"],
                        "gpu_util": of_job(utils, *key),
                        "start": r["start_time"],
                        "partition": r["partition"], "time_limit": r["time_limit_s"], "text": text})
    return out


def _well_formed(feats: Any) -> bool:
    """Script features as ``script_features`` makes them: a family key, an architecture (or none),
    and finite numbers for the model's inputs. A user's spool record is checked field by field at
    ingest; this keeps one from another version of the code from stopping the training."""
    if not isinstance(feats, dict) or not isinstance(feats.get("family"), str):
        return False
    if not isinstance(feats.get("arch"), (str, type(None))):
        return False
    numbers = [feats.get(name) for name in SCRIPT_NUMERIC] + ([feats["scale"]] if "scale" in feats else [])
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers)


def gpu_oom(row: Mapping[str, Any], config: Config) -> bool:
    """Out of memory, the outcome the learner avoids: Slurm's OUT_OF_MEMORY (host memory) or a GPU
    OOM as ``collector.oom.ran_out_of_gpu_memory`` defines it for every part of slurmgpu."""
    card = _gpu(config, row["gpu_type"])["memory_gib"] * 1024
    return row["state"] == HOST_OOM_STATE or ran_out_of_gpu_memory(row["state"], row.get("gpu_oom"), row["peak"], card)


# Batch x sequence (or steps) beyond e^100 is no real job (a typo, or a hostile script): its peak
# would overflow the line's sums of squares, its speed no logarithm of a real one; it stays out of both.
MAX_FIT_LOG_TOKENS = 100.0


# A card's memory offset (type_offsets) is kept where OFFSET_MIN_FAMILIES families ran on it beside
# another card, and it lies OFFSET_SE standard errors and at least OFFSET_MIN_MIB from 0: on most
# sites' histories no card differs, and an offset of noise would move every estimate on that card.
OFFSET_SE = 2.0
OFFSET_MIN_MIB = 64.0
OFFSET_MIN_FAMILIES = 4
# ... and the families agree on it: their own figures' median deviation at most this share of it. A
# context and workspace is the card's, the same in every model: in six draws of a DLInfBench history
# the families deviate 1-28% of the offset. A difference that arguments the script hides make (users
# pick the card for the job) varies from family to family: on the scenario's histories (seeds 4242,
# 1, 7, 13; loads 0.3, 0.9) every card with 4 or more families' figures deviated 44-77%.
OFFSET_AGREE = 0.35
OFFSET_ROUNDS = 10


def type_offsets(points: Iterable[tuple[str, Any, str, float]]) -> dict[str, float]:
    """What each card adds to a peak (MiB) over the site's cards at large (the median card's 0), from
    (family, same job, card, peak as one GPU's): matched comparisons only, one family at one batch,
    sequence and GPU count run on two or more cards, whose peaks differ by nothing the script shows
    but the card (between families, or between a family's batches, which jobs went to which card
    would pass for the card). The CUDA context, cuDNN's workspace and the framework's pool differ
    by GPU generation and CUDA version (DLInfBench: ResNet-50 inference at batch 32 takes 817 MiB
    on a GTX 1080, 1384 on a V100), in every model alike; what differs in one family alone (a bf16
    job run in fp32 where the card lacks bf16, an argument the script hides) is no card's. So each
    family votes once: alternately each job's level (its runs less their cards' offsets, averaged)
    and each card's offset moved by the median over families of its runs' median residual in each,
    centred on the median card's, OFFSET_ROUNDS times; kept where OFFSET_MIN_FAMILIES families or
    more vote, their own figures agree (OFFSET_AGREE) and the offset stands OFFSET_SE standard
    errors (of that median) and OFFSET_MIN_MIB from 0. Cards without such evidence have none (0)."""
    by_job: dict[Any, list[tuple[str, float]]] = {}
    for family, job, card, peak in points:
        by_job.setdefault((family, job), []).append((card, peak))
    matched = {key: runs for key, runs in by_job.items() if len({card for card, _ in runs}) >= 2}
    offsets: dict[str, float] = {}
    for _ in range(OFFSET_ROUNDS if matched else 0):
        moves: dict[str, list[float]] = {}  # card -> each family's median residual about its jobs' levels
        for jobs in _residuals(matched, offsets).values():
            for card, rs in jobs.items():
                moves.setdefault(card, []).append(statistics.median(r for r, _ in rs))
        for card, ms in moves.items():
            offsets[card] = offsets.get(card, 0.0) + statistics.median(ms)
        middle = statistics.median(offsets.values())  # most cards add nothing: they stay at 0
        offsets = {card: v - middle for card, v in offsets.items()}
    # Each family's own figure of each card's offset: its runs over the same jobs' runs on other
    # cards (the residual about the level times n / (n - 1): a level of n runs holds a card's own).
    votes: dict[str, list[float]] = {}
    for jobs in _residuals(matched, offsets).values():
        for card, rs in jobs.items():
            votes.setdefault(card, []).append(offsets[card] + statistics.median(r * n / (n - 1) for r, n in rs))

    def clear(card: str) -> bool:
        vs = votes[card]
        middle = statistics.median(vs)
        spread = statistics.median(abs(v - middle) for v in vs)
        se = 1.2533 * 1.4826 * spread / math.sqrt(len(vs))
        return (len(vs) >= OFFSET_MIN_FAMILIES and spread <= OFFSET_AGREE * abs(offsets[card])
                and abs(offsets[card]) >= max(OFFSET_MIN_MIB, OFFSET_SE * se))

    return {card: round(v, 1) for card, v in sorted(offsets.items()) if clear(card)}


def _residuals(matched: Mapping[tuple[str, Any], list[tuple[str, float]]], offsets: Mapping[str, float]
               ) -> dict[str, dict[str, list[tuple[float, int]]]]:
    """Per family and card, each run's peak less its card's offset about its job's level (the mean of
    the job's runs so), with the job's run count."""
    out: dict[str, dict[str, list[tuple[float, int]]]] = {}
    for (family, _job), runs in matched.items():
        level = sum(peak - offsets.get(card, 0.0) for card, peak in runs) / len(runs)
        for card, peak in runs:
            out.setdefault(family, {}).setdefault(card, []).append((peak - offsets.get(card, 0.0) - level, len(runs)))
    return out


class _Running:
    """Per-family statistics accumulated in submission order (none per user: the bundle is world-readable)."""

    def __init__(self, offsets: Mapping[str, float] | None = None) -> None:
        self.fam: dict[str, dict[str, float]] = {}
        self.archs: dict[str, list[str]] = {}  # architecture -> its families, in order first seen
        self.offsets = dict(offsets or {})  # each card's memory offset: peaks are kept without it

    def snapshot(self) -> HistoryStats:
        return HistoryStats({k: self._family_view(v) for k, v in self.fam.items()}, self.archs, whole=True,
                            type_offsets=self.offsets)

    def now(self, script: Mapping[str, Any]) -> HistoryStats:
        """The statistics a job's features read (its family and its architecture's), as of now."""
        keys = [script["family"], *self.archs.get(script.get("arch") or "", ())]
        return HistoryStats({k: self._family_view(self.fam[k]) for k in keys if k in self.fam}, self.archs,
                            type_offsets=self.offsets)

    @staticmethod
    def _family_view(s: Mapping[str, float]) -> dict[str, Any]:
        # Numbers, but for "shapes": the "<count>x<type>" shapes the family ran on (a list of str).
        n, m = s["n"], s["m"]
        view = {"n": n, "oom_rate": s["oom"] / n, "params_b": s["params_b"], "scale": s["scale"], "bits": s["bits"],
                **{k: s[k] for k in ("params_m", "acts_m") if k in s},
                "log_peak_mean": s["lpsum"] / m if m else 0.0, "zero_one_gpu": 1.0,
                "shapes": sorted(k[len("shape:"):] for k in s if k.startswith("shape:")),
                **{k: v for k, v in s.items() if k.startswith((HELD, BUSY, RUNS, UTIL, UTIL_RUNS))},
                **{f"{RATE}{k[3:]}": v / s[f"rn:{k[3:]}"] for k, v in s.items() if k.startswith("rs:")},
                **{f"{RATE_N}{k[3:]}": v for k, v in s.items() if k.startswith("rn:")},
                **_rate_spread(s), **_line(s)}
        if s.get("line_n"):
            view.update(line_n=s["line_n"], line_err=max(s[f"miss:{i}"] for i in range(min(int(s["line_n"]),
                                                                                              TIGHT_AFTER))))
        return view

    def add(self, row: Mapping[str, Any]) -> None:
        key, arch = row["script"]["family"], row["script"].get("arch")
        if key not in self.fam and arch:
            self.archs.setdefault(arch, []).append(key)
        s = self.fam.setdefault(key, dict.fromkeys(("n", "m", "oom", "lpmax", "ltmax", "lpsum", "t", "p", "tt",
                                                    "tp", "tmin", "pmin"), 0.0))
        s["n"] += 1
        s["params_b"] = float(row["script"]["params_b"])
        s["scale"] = size_scale(row["script"])
        s["bits"] = float(row["script"]["precision_bits"])  # the cards' speeds its runs are read against
        counts = published_counts(row["script"])
        if counts is not None:
            s["params_m"], s["acts_m"] = counts
        s[f"shape:{row['gpus']}x{row['gpu_type']}"] = 1.0  # the GPU counts and types it ran on
        interval = memory_interval(row, row.get("card_gib", 0.0) * 1024)
        if interval is not None and interval[1] != INF and row.get("card_gib"):
            # "held:<GiB>:<GPUs>": the most tokens (log) a run of this family survived on GPUs that size
            held = f"{HELD}{row['card_gib']:g}:{row['gpus']}"
            s[held] = max(s.get(held, -INF), row["script"]["log_tokens"])
        if rated(row) and max(row["script"]["log_tokens"], row["script"]["log_steps"]) <= MAX_FIT_LOG_TOKENS:
            rate = log_rate(row["elapsed"], row["script"])
            for shape in rate_keys(row["gpus"], row["gpu_type"], row["script"]["log_tokens"]):
                s[f"rs:{shape}"] = s.get(f"rs:{shape}", 0.0) + rate
                s[f"rq:{shape}"] = s.get(f"rq:{shape}", 0.0) + rate * rate
                s[f"rn:{shape}"] = s.get(f"rn:{shape}", 0.0) + 1
        if row["state"] == "COMPLETED" and row.get("gpus_used") is not None:
            busy, runs = f"{BUSY}{row['gpus']}", f"{RUNS}{row['gpus']}"
            s[busy] = max(s.get(busy, 0.0), float(row["gpus_used"]))
            s[runs] = s.get(runs, 0.0) + 1
        if row["state"] == "COMPLETED" and row["gpus"] == 1 and row.get("gpu_util") is not None:
            util, runs = f"{UTIL}{row['gpu_type']}", f"{UTIL_RUNS}{row['gpu_type']}"
            s[util] = max(s.get(util, 0.0), float(row["gpu_util"]))
            s[runs] = s.get(runs, 0.0) + 1
        if row["state"] == "OUT_OF_MEMORY":
            s["oom"] += 1
        elif row["peak"] and row["script"]["log_tokens"] <= MAX_FIT_LOG_TOKENS:
            tokens = math.exp(row["script"]["log_tokens"])
            peak = max(one_gpu_peak(row) - self.offsets.get(row["gpu_type"], 0.0), 1.0)  # without its card's offset
            if s["m"] >= 3 and (line := _line(s))["b"] > 0:  # how well its line foretold this peak (memory_stratum)
                miss = abs(math.log(peak / one_gpu_base({"log_tokens": row["script"]["log_tokens"]}, line)))
                s[f"miss:{int(s.get('line_n', 0.0)) % TIGHT_AFTER}"] = miss  # the last TIGHT_AFTER, in a ring
                s["line_n"] = s.get("line_n", 0.0) + 1
            lp = math.log(peak)
            s["m"] += 1
            s["lpsum"] += lp
            if lp >= s["lpmax"]:
                s["lpmax"], s["ltmax"] = lp, row["script"]["log_tokens"]
            if s["m"] == 1 or tokens < s["tmin"]:
                s["tmin"], s["pmin"] = tokens, peak
            elif tokens == s["tmin"]:
                s["pmin"] = max(s["pmin"], peak)
            s["t"] += tokens
            s["p"] += peak
            s["tt"] += tokens * tokens
            s["tp"] += tokens * peak


def one_gpu_peak(row: Mapping[str, Any]) -> float:
    """A run's peak as one GPU's (``bundle.zero_shift_mib``), never below 1 MiB."""
    return max(row["peak"] + zero_shift_mib(row["script"], row["gpus"]), 1.0)


def _line_record(fam: Mapping[str, float]) -> dict[str, float]:
    """What ``memory_stratum`` reads of a family's history: how well its line has foretold its peaks."""
    return {k: fam[k] for k in ("line_n", "line_err", "log_tokens_at_max") if k in fam}


def _line(s: Mapping[str, float]) -> dict[str, float]:
    """The family's peak line a + b x tokens (least squares; b 0 where it is not rising) and the points
    ``bundle.one_gpu_base`` bounds it with."""
    m = s["m"]
    line = {"a": 0.0, "b": 0.0, "tokens_min": s["tmin"], "peak_at_tokens_min": s["pmin"],
            "log_peak_max": s["lpmax"], "log_tokens_at_max": s["ltmax"]}
    var = s["tt"] - s["t"] ** 2 / m if m else 0.0
    if m >= 2 and var > 1e-9 * max(s["tt"], 1.0):
        b = (s["tp"] - s["t"] * s["p"] / m) / var
        if b > 0:
            line.update(a=(s["p"] - b * s["t"]) / m, b=b)
    return line


def rated(row: Mapping[str, Any]) -> bool:
    """Whether a run's speed counts in its family's ``rate:`` figures: a completed run, and where the
    script shows no amount of work a timed-out one too, at its limit (which runs finish within the
    limit then depends on their hidden work: left out, the slow shapes' long runs vanish and those
    shapes look fast; in the benchmark a K80 measured barely slower than a V100)."""
    return bool(row.get("elapsed")) and (row["state"] == "COMPLETED" or (
        row["state"] == "TIMEOUT" and not row["script"].get("work_shown", 1)))


def _rate_spread(s: Mapping[str, float]) -> dict[str, float]:
    """The family's spread of log speed between runs of one shape and batch: "rate_ss", the sum of
    squared deviations from each shape's mean, over "rate_dof" degrees of freedom (work hidden from
    the script spreads it wide; the decider weighs the family's measured ratios by it)."""
    ss = dof = 0.0
    for k, n in s.items():
        if k.startswith("rn:") and "@" in k and n >= 2:
            total = s[f"rs:{k[3:]}"]
            ss += max(s[f"rq:{k[3:]}"] - total * total / n, 0.0)
            dof += n - 1
    return {"rate_ss": ss, "rate_dof": dof}


def _gpu(config: Config, name: str | None, precision_bits: float | None = None) -> dict[str, float]:
    t = config.gpu_types.get(name or "")
    return card_features(t, precision_bits) if t else {"memory_gib": 0.0, "relative_speed": 1.0}


def ended_at(row: Mapping[str, Any]) -> datetime:
    """When a job's outcome became known: its end (sacct), else submit + elapsed (its earliest end)."""
    if row.get("end") is not None:
        return row["end"]
    return row["submit"] + timedelta(seconds=row.get("elapsed") or 0)


def written_limit(row: Mapping[str, Any], config: Config, read: dict[str, int | None]) -> int | None:
    """The time limit the job's submission wrote, as the decider reads it from a request: the
    recorded request's, else its script's (``read``: each script's, once). Not sacct's, which is a
    partition's default where none was written: trained on that, a job that writes none would be
    predicted as the shortest (its feature 0 never seen); left unwritten here, 0 means "none"."""
    if row["request"]:
        return row["request"].get("time_limit_s")
    text = row.get("text")
    if text is None:
        return None
    if text not in read:
        try:
            script = parse_script(text.encode("utf-8", "surrogateescape"), f"job {row.get('job_id')}")
            read[text] = build_request(script, [], {}, config.gpu_features()).main.time_limit_s
        except (ValueError, InputError):  # a script sbatch would refuse: no limit it wrote
            read[text] = None
    return read[text]


def build_examples(rows: Iterable[Mapping[str, Any]], config: Config,
                   offsets: Mapping[str, float] | None = None) -> tuple[list[dict[str, Any]], HistoryStats]:
    """Feature rows with history as of each job's submission (point in time: only jobs that had
    ended by then count, never one still queued or running), and the final snapshot. The cards'
    memory OFFSETS (a bundle's, to judge it), else measured on the older 80% of the measured
    peaks: the newest fifth, which calibrates the memory margin (``fit``), is judged with offsets
    it did not help to measure."""
    rows = list(rows)
    if offsets is None:
        measured = [r for r in rows if r["peak"] and not gpu_oom(r, config)
                    and r["script"]["log_tokens"] <= MAX_FIT_LOG_TOKENS]
        offsets = type_offsets((r["script"]["family"], (r["script"]["log_tokens"], r["gpus"]), r["gpu_type"],
                                one_gpu_peak(r)) for r in measured[:int(len(measured) * 0.8)])
    running = _Running(offsets)
    examples = []
    ended: list[tuple[datetime, int, dict[str, Any]]] = []  # a heap of outcomes not known yet
    limits: dict[str, int | None] = {}  # each script's written time limit, read once
    for seq, row in enumerate(rows):
        while ended and ended[0][0] <= row["submit"]:
            running.add(heapq.heappop(ended)[2])
        gpu = _gpu(config, row["gpu_type"], row["script"]["precision_bits"])
        history = running.now(row["script"])
        request = {**row["request"], "req_gpu_mem_gib": _gpu(config, row["request"].get("gpu_type"))["memory_gib"],
                   "time_limit_s": written_limit(row, config, limits)}
        gpus = max(int(row["gpus"]), 1)
        f = job_features(row["script"], request, gpu, gpus, history, row["gpu_type"])
        base = memory_base_mib(f, row["script"], history)
        oom = gpu_oom(row, config)
        examples.append({**row, "x": [f[n] for n in NUMERIC], "base": base, "oom": oom, TYPE_OFFSET: f[TYPE_OFFSET],
                         "family_then": _line_record(history.family(row["script"]["family"]))})
        heapq.heappush(ended, (ended_at(row), seq, {**row, "state": "OUT_OF_MEMORY" if oom else row["state"],
                                                     "oom": oom, "card_gib": gpu["memory_gib"]}))
    while ended:  # the snapshot shipped in the bundle knows every outcome
        running.add(heapq.heappop(ended)[2])
    return examples, running.snapshot()


def fit(rows: list[dict[str, Any]], config: Config, quantile: float = 0.995, iterations: int = 400,
        progress: Callable[[str], None] = lambda s: None) -> tuple[Bundle, list[dict[str, Any]]]:
    """Fit both models; returns the bundle and the examples (for evaluation)."""
    examples, snapshot = build_examples(rows, config)
    mem = [e for e in examples if e["peak"] and not e["oom"]]
    run = [e for e in examples if e["state"] == "COMPLETED" and e["elapsed"]]
    if len(run) < 20:
        raise ValueError(f"too little history to train: {len(run)} completed GPU jobs (20 needed)")
    if len(mem) >= 20:
        # Trees learn the typical ratio of a peak to its estimate (RMSE on the log); the newest fifth,
        # not fitted on, sets the margin to the quantile per stratum of what the estimate rests on
        # (split conformal, one quantile per stratum: "Mondrian"). One margin for all would let the
        # first jobs of new models, whose estimates are far off, inflate every estimate.
        cut = int(len(mem) * 0.8)
        fit_part, calib = mem[:cut], mem[cut:]
        progress(f"memory model on {len(fit_part)} jobs with GPU memory, calibrated on {len(calib)}")
        cards = snapshot.type_offsets
        progress("card memory offsets: " + (", ".join(f"{card} {v:+.0f} MiB" for card, v in cards.items()) if cards
                                            else "none (no card differs in the matched runs of 4 or more families)"))
        mem_predict, mem_trees = _trees([e["x"] for e in fit_part], [math.log(e["peak"] / e["base"]) for e in fit_part],
                                        "RMSE", iterations, MONOTONE["memory"], IGNORED["memory"])
        # Per stratum, the estimate with the narrower upper quantile on the calibration jobs: the
        # trees' ratio, or the estimate alone (trees fitted across models can carry one model's
        # quirks to another; on published CNN peaks they widened the known families' margin 4x).
        gaps: dict[str, tuple[list[float], list[float]]] = {}
        for e, p in zip(calib, mem_predict([e["x"] for e in calib]), strict=True):
            ratio = math.log(e["peak"] / e["base"])
            # A tight family's job counts in its stratum at large too: that margin stays what it was
            # without the tight one (calibrated on the hard jobs alone it was narrower, and the scenario's
            # OOMs rose), and it is the one a tight job past its family's batches takes.
            stratum = memory_stratum(e["x"], e["family_then"])
            for key in {stratum, stratum.removesuffix(":tight")}:
                with_trees, alone = gaps.setdefault(key, ([], []))
                with_trees.append(ratio - p)
                alone.append(ratio)
        offsets, tree_strata = {}, []
        for k, (with_trees, alone) in gaps.items():
            if len(alone) >= MIN_STRATUM:
                trees_upper, alone_upper = _upper(quantile, with_trees), _upper(quantile, alone)
                offsets[k] = min(trees_upper, alone_upper)
                if trees_upper < alone_upper:
                    tree_strata.append(k)
        # Sizes of a model never run (strata 1, 2) are rare among the newest jobs: their margin comes
        # from leaving each size of an architecture out and estimating it from the others.
        for k, held_out in _size_gaps(mem, snapshot).items():
            if k not in offsets and len(held_out) >= MIN_STRATUM:
                offsets[k] = _upper(min(quantile, SIZE_QUANTILE), held_out)
        # Architectures never run, by the site's published-counts line: likewise, each left out.
        unseen = _arch_gaps(mem, snapshot)
        if len(unseen) >= MIN_STRATUM:
            offsets[f"{int(SITE_KIND)}"] = _upper(min(quantile, SIZE_QUANTILE), unseen)
        # A stratum with too few jobs to measure its quantile takes the trees and the largest margin.
        pooled = _upper(quantile, [g for k, (with_trees, _) in gaps.items() if not k.endswith(":tight")
                                   for g in with_trees])
        memory, source = {**mem_trees, "offsets": offsets, "tree_strata": sorted(tree_strata),
                          "default_offset": max([pooled, *offsets.values()])}, "telemetry"
    else:
        # No GPU-memory field (most sites' sacct): the per-GPU estimate stays the family or analytic
        # base, and the decider moves a job only to cards its family's outcomes show it holds on.
        progress(f"only {len(mem)} jobs with GPU memory: memory from outcomes (cards each family held on)")
        memory, source = {"trees": [{"splits": [], "leaves": [0.0]}], "scale": 1.0, "bias": 0.0}, "outcomes"
    progress(f"runtime model on {len(run)} jobs")

    def runtime_model(part: list[dict[str, Any]],
                      loss: str = "RMSE") -> tuple[Callable[[list[list[float]]], list[float]], dict[str, Any]]:
        return _trees([e["x"] for e in part], [math.log(max(e["elapsed"], 1)) for e in part], loss, iterations,
                      MONOTONE["runtime"])

    # How far newer jobs ran beyond what a model of older ones predicted: the margin a changed
    # request must keep to its time limit (a median prediction alone times out half the misses).
    cut = int(len(run) * 0.8)
    probe, _ = runtime_model(run[:cut])
    over = sorted(math.log(max(e["elapsed"], 1)) - p for e, p in
                  zip(run[cut:], probe([e["x"] for e in run[cut:]]), strict=True))
    spread = max(over[min(int(0.95 * len(over)), len(over) - 1)], 0.0) if over else 0.0
    _, run_trees = runtime_model(run)
    # How much longer than its median a job runs 95 times in 100, given what it is (quantile trees
    # on the log ratio): the time-limit test of a move uses it, not only one margin for every job
    # (measured on the scenario: timeouts 128 -> 121 and 159 -> 155, failures 379 -> 372, 344 -> 340).
    # Fitted on each job's miss by a median model of the other half, not on the log runtime itself:
    # quantile trees walk down from the site's longest runs in small steps, and at 400 trees still
    # put a job its limit says takes minutes at hours (a margin of 9x where the runs' own is 1.5x).
    # Two levels deep: deeper trees chase each job's own miss (at depth 4 or 6, 400 trees put the
    # 95th percentile below the median: a margin under 1 where the held-out misses' is 1.5).
    halves = (run[0::2], run[1::2])
    misses: list[tuple[list[float], float]] = []
    for held, other in (halves, halves[::-1]):
        if held and other:
            median, _ = runtime_model(other)
            misses += [(e["x"], math.log(max(e["elapsed"], 1)) - p)
                       for e, p in zip(held, median([e["x"] for e in held]), strict=True)]
    _, upper_trees = _trees([x for x, _ in misses] or [run[0]["x"]], [m for _, m in misses] or [0.0],
                            "Quantile:alpha=0.95", iterations, depth=2)
    bundle = Bundle({
        "version": BUNDLE_VERSION, "features": list(NUMERIC), "quantile": quantile,
        "memory": memory, "memory_source": source,
        "runtime": run_trees, "runtime_spread": spread, "runtime_upper": upper_trees,
        "history": {"families": snapshot.families, "archs": snapshot.archs, "type_offsets": snapshot.type_offsets},
        "window": [min(e["submit"] for e in examples).isoformat(), max(e["submit"] for e in examples).isoformat()],
        "jobs": len(examples),
    })
    return bundle, examples


# Features the target may only grow with (physics fixes the sign): memory with the batch, sequence,
# tokens and parameter count (so the line a + b*tokens still grows after the learned ratio); run
# time with the steps. Not run time with the batch: a script counting epochs runs fewer steps of a
# larger batch.
MONOTONE = {"memory": ("batch_size", "seq_len", "log_tokens", "params_b"), "runtime": ("log_steps",)}
# Features a target must not read: a time limit says how long a user expects the job to run, not
# how much memory it takes (a split on it would be a coincidence of the history).
IGNORED = {"memory": ("log_limit",)}


def _trees(xs: list[list[float]], ys: list[float], loss: str, iterations: int, increasing: tuple[str, ...] = (),
           ignored: tuple[str, ...] = (), depth: int = 6) -> tuple[Callable[[list[list[float]]], list[float]],
                                                                dict[str, Any]]:
    """CatBoost trees for one target, as a predictor and the bundle's tree format, non-decreasing in
    the INCREASING features, blind to the IGNORED ones. Targets that are all the same (every job ran
    exactly as long) are that constant: CatBoost refuses to fit them."""
    from catboost import CatBoostRegressor

    if max(ys) - min(ys) < 1e-12:
        return (lambda rows: [ys[0]] * len(rows)), {"trees": [{"splits": [], "leaves": [0.0]}], "scale": 1.0,
                                                     "bias": ys[0]}
    model = CatBoostRegressor(iterations=iterations, depth=depth, loss_function=loss, verbose=0,
                              allow_writing_files=False, thread_count=2, random_seed=0,
                              monotone_constraints=[1 if name in increasing else 0 for name in NUMERIC],
                              ignored_features=[NUMERIC.index(name) for name in ignored] or None)
    model.fit(xs, ys)
    return (lambda rows: [float(v) for v in model.predict(rows)]), TreeEnsemble.from_catboost(model)


_FAM_N, _BASE_KIND = NUMERIC.index("fam_n"), NUMERIC.index("base_kind")


def _known(example: Mapping[str, Any], config: Config) -> bool:
    return example["x"][_FAM_N] >= config.policy.min_history


def _size_gaps(mem: list[dict[str, Any]], snapshot: HistoryStats) -> dict[str, list[float]]:
    """Log(peak / estimate) of every measured job when its model size is left out of its
    architecture, by the stratum that estimate falls in (jackknife over sizes), pooled and per
    architecture ("<stratum>@<arch>": sizes of one architecture follow its own line more closely)."""
    from slurmgpu.pipeline.features import base_kind

    gaps: dict[str, list[float]] = {}
    for e in mem:
        script = e["script"]
        f = dict(zip(NUMERIC, e["x"], strict=True))
        # The size left out, not just the family: the same model run by another command is that size
        # (its published parameter count where it has one: a name's scale can be shared by models of
        # other sizes, vit_large_patch16 and _patch32).
        counts = published_counts(script)
        size = ("params_m", counts[0]) if counts else ("scale", size_scale(script))
        siblings = [fam for fam in snapshot.siblings(script) if fam.get(size[0]) != size[1]]
        if not siblings:
            continue
        kind = base_kind({}, siblings, script)
        estimate = arch_base_mib(f, siblings, script)
        if estimate:
            estimate = on_card(estimate, e[TYPE_OFFSET])
            stratum = memory_stratum([*e["x"][:_BASE_KIND], kind, *e["x"][_BASE_KIND + 1:]])
            for key in (stratum, f"{stratum}@{script['arch']}"):  # all architectures, and this one's own
                gaps.setdefault(key, []).append(math.log(e["peak"] / estimate))
    return gaps


def _arch_gaps(mem: list[dict[str, Any]], snapshot: HistoryStats) -> list[float]:
    """Log(peak / estimate) of every measured job of a model with published counts, estimated by the
    site's line (``features.counts_line``) of the other architectures (jackknife over
    architectures: the line its own sizes helped draw would flatter it)."""
    lines: dict[tuple[str, float], CountsLine | None] = {}
    gaps = []
    for e in mem:
        script = e["script"]
        if published_counts(script) is None:
            continue
        arch, bits = script.get("arch"), float(script["precision_bits"])
        own = {script["family"], *snapshot.archs.get(arch or "", ())}
        key = (arch or script["family"], bits)
        if key not in lines:
            lines[key] = counts_line((fam for k, fam in snapshot.families.items() if k not in own), bits)
        estimate = site_base_mib(dict(zip(NUMERIC, e["x"], strict=True)), script, lines[key])
        if estimate:
            gaps.append(math.log(e["peak"] / on_card(estimate, e[TYPE_OFFSET])))
    return gaps


MIN_STRATUM = 20  # calibration jobs a stratum needs for its own quantile
# The coverage of a model size never run (its figure rests on other sizes): the decider never acts on
# it to shrink a request (a family without min_history jobs moves only to a card at least as large as
# asked), so it is a forecast: under-predicted 1 time in 20, not the 1 in 200 that guards moves.
SIZE_QUANTILE = 0.95


def _upper(quantile: float, gaps: list[float]) -> float:
    """The split-conformal upper quantile of the gaps (at least 0: an estimate is never lowered)."""
    if not gaps:
        return 0.0
    ordered = sorted(gaps)
    return max(ordered[min(int(math.ceil(quantile * (len(ordered) + 1))) - 1, len(ordered) - 1)], 0.0)


def split_by_time(rows: list[dict[str, Any]], test_days: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not rows:
        return [], []
    cut = max(r["submit"] for r in rows) - timedelta(days=test_days)
    return [r for r in rows if r["submit"] <= cut], [r for r in rows if r["submit"] > cut]


def split_by_family(rows: list[dict[str, Any]],
                    share: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """The rows of the families kept and of those held out, and the held-out family keys: SHARE of
    the families (one at least, never all), taken in the order of a hash of their keys, so the same
    history holds out the same ones."""
    families = sorted({r["script"]["family"] for r in rows}, key=lambda f: hashlib.sha256(f.encode()).hexdigest())
    held = set(families[:min(max(round(share * len(families)), 1), len(families) - 1)])
    return ([r for r in rows if r["script"]["family"] not in held], [r for r in rows if r["script"]["family"] in held],
            sorted(held))


def evaluate(bundle: Bundle, train_rows: list[dict[str, Any]], test_rows: list[dict[str, Any]],
             config: Config) -> dict[str, Any]:
    """Held-out metrics: memory under-prediction rate, runtime error, and whether the chosen
    type would have held the job (true peak within the card) where the user's request did."""
    examples, _ = build_examples([*train_rows, *test_rows], config, bundle.history.type_offsets)
    test_ids = {r["job_id"] for r in test_rows}
    tests = [e for e in examples if e["job_id"] in test_ids]
    all_mem = [e for e in tests if e["peak"] and not e["oom"]]
    mem = [e for e in all_mem if _known(e, config)]
    run = [e for e in tests if e["state"] == "COMPLETED" and e["elapsed"] and _known(e, config)]

    bounds = {id(e): e["base"] * math.exp(bundle.memory_ratio(e["x"], bundle.memory.predict(e["x"]),
                                                              e["script"].get("arch"), e["family_then"]))
              for e in all_mem}  # mem is a part of all_mem: each bound once

    def under(items: list[dict[str, Any]]) -> float | None:
        return sum(1 for e in items if bounds[id(e)] < e["peak"]) / len(items) if items else None

    ape = sorted(abs(math.exp(bundle.runtime.predict(e["x"])) - e["elapsed"]) / e["elapsed"] for e in run)
    bound_error = sorted(abs(bounds[id(e)] / e["peak"] - 1) for e in mem)
    return {
        "test_jobs": len(tests),
        "memory_jobs": len(mem),  # jobs of families with history: the ones decisions are made for
        "memory_under_prediction_rate": under(mem),
        "memory_bound_median_error": bound_error[len(bound_error) // 2] if bound_error else None,
        "memory_under_prediction_rate_all_families": under(all_mem),
        "runtime_jobs": len(run),
        "runtime_mdape": ape[len(ape) // 2] if ape else None,
    }

