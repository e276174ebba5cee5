"""The candidate table: each GPU type and count a job may run on, with its predicted peak, runtime
and wait, whether it fits, and how a row scores against the request as asked.

The decider (pipeline/policy.py) picks among these rows and says why; the figures of a row come
from the runtime estimate (pipeline/runtime_estimate.py) and the memory bound
(pipeline/memory_bound.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from slurmgpu.pipeline.config import Config, GpuType
from slurmgpu.pipeline.memory_bound import UNSEEN_PENALTY, MemoryBound, by_prediction
from slurmgpu.pipeline.queue import Waits
from slurmgpu.pipeline.request import array_tasks
from slurmgpu.pipeline.runtime_estimate import RuntimeEstimate, measured_ratio

BUSY_WAIT_S = 1800.0  # assumed wait when a type has too few idle GPUs right now (no queue view)
# Past this a figure of seconds is no figure (30,000 years): sums and products of them stay finite.
FIGURE_BOUND = 1e12


class Candidate(NamedTuple):
    """One GPU type and count the model weighed, with its numbers (for --explain and predict)."""

    gpu_type: str
    gpus: int
    fits: bool
    pred_peak_mem_mib: float
    pred_runtime_s: float
    expected_wait_s: float
    margin: float = 0.0  # the fit test: pred_peak_mem_mib * (1 + margin) within the card
    # The time-limit test of a move (``in_time_limit``): pred_runtime_s times this, or the bundle's one
    # margin if larger, within the limit. The bundle's 95th-percentile run time of the job on this
    # shape over its median: wider where jobs like it run less predictably.
    runtime_margin: float = 1.0
    # Where the family ran both this shape and the one asked: the standard deviation of the log of
    # pred_runtime_s over the request's (``RuntimeEstimate.weighed_ratio``); None elsewhere.
    ratio_sd: float | None = None


class CandidateTable:
    """Builds the table for one bundle under one config: ``wait(type, gpus, ...)`` the queue's
    expected wait (pipeline/queue.py), or None for idle GPUs now or ``BUSY_WAIT_S``."""

    def __init__(self, config: Config, bundle: Any, wait: Waits | None = None) -> None:
        self.config, self.bundle, self.wait = config, bundle, wait
        self.runtime = RuntimeEstimate(config, bundle)
        self.memory = MemoryBound(config, bundle)

    def build(self, sf: Mapping[str, Any], req: Mapping[str, Any], shapes: list[tuple[GpuType, int]],
              used: int, free: Mapping[str, int], busy: int | None = None) -> list[Candidate]:
        """The table: predicted peak, runtime and wait of the job (script features ``sf``, normalised
        request ``req``) on each shape, and whether it fits. ``used``: the fewest GPUs the launch uses;
        ``busy``: the most GPUs the family's runs on the asked count kept busy, if the decider trims
        on that evidence (from ``busy`` GPUs up, a type's row is its row at the asked count: the
        job uses the same GPUs the same way, only its wait differs)."""
        from slurmgpu.pipeline.features import card_features, job_features

        req_type, req_total = req.get("gpu_type"), int(req.get("gpus_total") or 0)
        array = array_tasks(req.get("array"))
        bits = sf["precision_bits"]  # the datasheet column its cards' speeds are read from (GpuType.speed)
        rows = [job_features(sf, req, card_features(gt, bits), c,
                             self.bundle.history, gt.name) for gt, c in shapes]
        preds = self.bundle.predict_many(rows, sf)
        # A type or count the family never ran on is a prediction from other families: doubt it more.
        fam = self.bundle.history.family(sf["family"])
        seen = self.seen(sf["family"], req_type, req_total)
        asked_pred = next((p for (gt, c), p in zip(shapes, preds, strict=True)
                           if (gt.name, c) == (req_type, req_total)), None)
        exponent: float | None = None  # the family's speed slope at the asked count, once it is needed
        # and the one without the family's own runs, the prior its measured ratios are weighed against
        prior_exponent = functools.cache(lambda: self.runtime.speed_exponent(sf, req_total, own=False))
        table = []
        for (gt, c), pred in zip(shapes, preds, strict=True):
            known = f"{c}x{gt.name}" in seen
            runtime_margin = max(pred.runtime_upper_s / max(pred.runtime_s, 1e-9), 1.0)
            measured = measured_ratio(fam, (gt.name, c), (req_type, req_total), sf["log_tokens"])
            ratio_sd = None
            if asked_pred is not None and measured is not None:
                # The family ran both shapes at one batch: its own measured speed ratio there,
                # weighed against the datasheet's by how many runs it rests on and how widely they spread.
                ratio, ratio_sd = self.runtime.weighed_ratio(fam, measured, gt, c, req_type, req_total,
                                                             prior_exponent, bits)
                runtime = asked_pred.runtime_s * math.exp(ratio)
            elif known:
                runtime = pred.runtime_s
            elif asked_pred is not None and c == req_total and req_type and \
                    gt.speed(bits) >= self.config.gpu_types[req_type].speed(bits):
                # A faster type the family never ran on: the datasheet's speed ratio over the runtime
                # as asked, felt as strongly as the family (else its architecture, else the site) felt
                # it between the types it did run on (a job bound by its input pipeline gains little
                # from a faster card, whatever the datasheet says). A new family, or one never on the
                # asked shape, gets that hardware prior too: the model alone ranked a new family's
                # H100 no faster than its A100 and kept 258 of 1,690 jobs on the slower card
                # (scenario, load 0.3: mean JCT 2.06 -> 1.68 h with the prior). A slower one keeps
                # the full ratio below: a time limit is at stake (measured: fewer timeouts).
                if exponent is None:
                    exponent = self.runtime.speed_exponent(sf, req_total)
                speeds = self.config.gpu_types
                runtime = asked_pred.runtime_s * (speeds[req_type].speed(bits) /
                                                  max(gt.speed(bits), 1e-9)) ** exponent
            elif asked_pred is None or req_type is None:
                runtime = pred.runtime_s * UNSEEN_PENALTY
            else:
                runtime = self.runtime.plausible_runtime(pred.runtime_s, asked_pred.runtime_s, req_type, req_total,
                                                         gt.name, c, used, bits)
            margin = self.memory.margin(known)
            # the asked shape, or a card at least as large at its count: it holds what the asked one holds
            asked_gib = gt.memory_gib if req_type is None or gt.name == req_type else \
                self.config.gpu_types[req_type].memory_gib
            within = asked_gib if c == req_total and gt.memory_gib >= asked_gib else None
            table.append(Candidate(gt.name, c, self.memory.fits(pred.peak_mem_mib, margin, gt, sf, c, within),
                                   pred.peak_mem_mib, runtime, self.expected_wait(gt.name, c, free, runtime, array),
                                   margin, runtime_margin, ratio_sd))
        if busy is not None:
            full = {c.gpu_type: c for c in table if c.gpus == req_total}
            table = [full[c.gpu_type]._replace(gpus=c.gpus, expected_wait_s=c.expected_wait_s)
                     if busy <= c.gpus < req_total and c.gpu_type in full else c for c in table]
        return table

    def seen(self, family: str, req_type: str | None, req_total: int) -> set[str]:
        """The shapes ("<GPUs>x<type>") the family ran on, and the one asked for."""
        return set(self.bundle.history.family(family).get("shapes", ())) | {f"{req_total}x{req_type}"}

    def expected_wait(self, gpu_type: str, gpus: int, free: Mapping[str, int], runtime_s: float = 0.0,
                      array: tuple[int, int] = (1, 0)) -> float:
        """From the queue where it was read (an array: its tasks' mean wait, each running RUNTIME_S);
        else idle GPUs now or ``BUSY_WAIT_S``."""
        if self.wait is not None:
            if array[0] > 1 and math.isfinite(runtime_s):
                return self.wait(gpu_type, gpus, tasks=array[0], runtime_s=runtime_s, at_once=array[1])
            return self.wait(gpu_type, gpus)
        return 0.0 if free.get(gpu_type, 0) >= gpus else BUSY_WAIT_S

    def on_slices(self, table: list[Candidate], slices: Mapping[str, str], req_type: str | None) -> list[Candidate]:
        """A slice row runs as long as the job runs as asked (the utilisation evidence says its
        compute fits; the decider's slice evidence) and fits only by its predicted peak with the
        margin: no outcome on a whole card says anything of a slice's memory."""
        asked = next((c for c in table if c.gpu_type == req_type and c.gpus == 1), None)
        if asked is None:
            return [c for c in table if c.gpu_type not in slices]
        return [c._replace(pred_runtime_s=asked.pred_runtime_s, runtime_margin=asked.runtime_margin,
                           fits=by_prediction(c.pred_peak_mem_mib, c.margin,
                                              self.config.gpu_types[c.gpu_type].memory_gib))
                if c.gpu_type in slices else c for c in table]


def slower(config: Config, c: Candidate, baseline: Candidate) -> bool:
    """A move, of a job that fits as asked, to a shape predicted slower than the request or to a
    card slower on the datasheet (a prediction of "no slower" there is the model's guess, and
    a wrong one costs the job its time limit)."""
    if not baseline.fits or (c.gpu_type, c.gpus) == (baseline.gpu_type, baseline.gpus):
        return False
    types = config.gpu_types
    return c.pred_runtime_s > baseline.pred_runtime_s or \
        types[c.gpu_type].relative_speed < types[baseline.gpu_type].relative_speed


def in_time_limit(config: Config, bundle: Any, c: Candidate, baseline: Candidate, limit_s: int | None) -> bool:
    """A change must not push the job past its own time limit (it would be killed): the predicted
    runtime with the margin newer jobs overran their predictions by (the bundle's runtime
    spread), at least ``scaling_factor``, and, for a move to a slower shape (``slower``), at
    least the job's own 95th-percentile margin (``Candidate.runtime_margin``): its upper
    runtime. A move, of a job that fits as asked, to a shape no slower (``slower``: on the
    datasheet and by prediction) runs no longer than the request: the request's own risk, less,
    so it is in time wherever the request is (measured: the bundle's margin of 5.7x on hidden
    work held 85 of 1,690 jobs on a slower card than the one they would finish sooner on). A
    job predicted not to fit as asked would fail for sure: its move keeps the bundle's margin
    alone (measured: with the job's own margin there, such jobs lost their only move and GPU
    OOMs rose from 251 to 273)."""
    if limit_s is None or c == baseline or (baseline.fits and not slower(config, c, baseline)):
        return True
    margin = max(config.policy.scaling_factor, math.exp(getattr(bundle, "runtime_spread", 0.0)),
                 c.runtime_margin if slower(config, c, baseline) else 1.0)
    return c.pred_runtime_s * margin <= limit_s


def clear_gain(config: Config, c: Candidate, baseline: Candidate) -> bool:
    """A move to a slower shape is worth its risk only where it finishes sooner than the request
    even at its upper runtime: a gain within the prediction's error keeps the request. A MIG
    slice that runs as long as the card asked (``CandidateTable.on_slices``: by the family's
    measured utilisation, not the model's guess) gains by its cost, which that error leaves alone."""
    if not slower(config, c, baseline) or (config.gpu_types[c.gpu_type].is_slice
                                           and c.pred_runtime_s <= baseline.pred_runtime_s):
        return True
    return c.expected_wait_s + c.pred_runtime_s * c.runtime_margin < \
        baseline.expected_wait_s + baseline.pred_runtime_s


def sooner_probability(c: Candidate, base: Candidate) -> float | None:
    """The probability that C finishes before BASE, where C's runtime is the family's measured
    ratio over the request's (``ratio_sd``; BASE's own deviation added where it has one): its log
    normal about the estimate, waits as read. None where C's figure is no such measurement."""
    if c.ratio_sd is None:
        return None
    sd = math.hypot(c.ratio_sd, base.ratio_sd or 0.0)
    room = base.expected_wait_s + base.pred_runtime_s - c.expected_wait_s  # C's runtime must stay under it
    if room <= 0:
        return 0.0
    if c.pred_runtime_s <= 0 or sd <= 0:
        return 1.0 if c.pred_runtime_s < room else 0.0
    return 0.5 * math.erfc(-(math.log(room) - math.log(c.pred_runtime_s)) / (sd * math.sqrt(2.0)))


def fewest_fitting(config: Config, full: Candidate, table: list[Candidate]) -> Candidate | None:
    """The fewest GPUs of this type that fit and run within the scaling factor of ``full``."""
    limit = full.pred_runtime_s * config.policy.scaling_factor
    fewer = [c for c in table if c.gpu_type == full.gpu_type and c.fits and c.pred_runtime_s <= limit]
    return min(fewer, key=lambda c: c.gpus) if fewer else None


def score(config: Config, c: Candidate, base: Candidate) -> float:
    """Lower is better, relative to the request as asked."""
    done = c.expected_wait_s + c.pred_runtime_s
    cost = c.pred_runtime_s * c.gpus * config.gpu_types[c.gpu_type].cost
    base_done = base.expected_wait_s + base.pred_runtime_s
    base_cost = base.pred_runtime_s * base.gpus * config.gpu_types[base.gpu_type].cost
    objective = config.policy.objective
    if objective == "fastest":
        return _ratio(done, base_done)
    if objective == "cheapest":
        return _ratio(cost, base_cost) if done <= base_done * config.policy.scaling_factor else math.inf
    return 0.5 * _ratio(done, base_done) + 0.5 * _ratio(cost, base_cost)


def _ratio(value: float, base: float) -> float:
    """VALUE relative to BASE (the request's own, which is 1): nothing over nothing is as good, and
    something over nothing unboundedly worse (a request predicted to take no time is not beaten); a
    product too large for a float (a cost in the hundreds of digits) is as large as another."""
    if math.isinf(base):
        return 1.0 if math.isinf(value) else 0.0
    if base > 0:
        return value / base
    return 1.0 if value <= 0 else math.inf


def usable(value: float, bound: float = FIGURE_BOUND) -> bool:
    """Whether a figure is one a comparison can use: finite, not negative, at most BOUND."""
    return math.isfinite(value) and 0 <= value <= bound


def finite(c: Candidate) -> bool:
    """Whether a row has every figure a comparison and its reason use: wait, runtime and its margin, and
    a finite peak (one past any card only fails the fit test)."""
    return all(usable(v) for v in (c.expected_wait_s, c.pred_runtime_s, c.runtime_margin)) \
        and usable(c.pred_peak_mem_mib, math.inf)
