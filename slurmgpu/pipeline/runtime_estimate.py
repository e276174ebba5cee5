"""How long a job runs on a shape it may be moved to: the family's measured speed ratios, weighed
against the datasheet's, and the datasheet prior itself (a speed slope per family, architecture
and site) for a shape the family never ran on.

Apart from the decider (pipeline/policy.py) so that the estimate can be read, tested and tuned
without the choice around it; the candidate table (pipeline/candidates.py) calls it per row.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from slurmgpu.pipeline.config import Config, GpuType
from slurmgpu.pipeline.features import RATE, RATE_N, keys_at, rate_keys

# The prior's precision on a speed slope (the family's or architecture's, against the one above it:
# an SD of 0.5): the measured slope's precision is its runs' spread of datasheet speed over one run's
# variance of log speed, so runs of known work (SD about 0.1) decide and runs whose work is hidden
# from the script (SD about 1.2) count for little. Measured in the decision benchmark (hidden work,
# Gavel's table): with the runs unweighed, an architecture's slope of 0.06 from a few habitual runs
# kept ResNet-18 jobs on P100s that Gavel measures 1.3 times slower than V100s.
SPEED_PRIOR = 4.0
# The steepest speed slope believed: a card may gain more than its datasheet ratio (Gavel measures a
# V100 up to 14 times a K80, the FP32 datasheet 3.6 times), not without bound.
MAX_SLOPE = 2.0
# How far the datasheet's speed ratio of two types (to the family's exponent) may be off for a job, as
# a log standard deviation: the prior a family's own measured ratio is weighed against.
PRIOR_RATIO_SD = 0.3
# Degrees of freedom the site's spread of log speed counts for when a family's own is estimated.
SITE_SPREAD_DOF = 5.0
# Per bundle: the site's pooled spread of log speed, and its pooled speed slope by the datasheet
# speeds it was computed with (the daemon decides many jobs with one bundle).
_SITE_SPREADS: weakref.WeakKeyDictionary[Any, float | None] = weakref.WeakKeyDictionary()
Speeds = tuple[tuple[str, float, float], ...]  # (type, relative_speed, fp32_speed) of every type, sorted
_SITE_SLOPES: weakref.WeakKeyDictionary[Any, dict[Speeds, float]] = weakref.WeakKeyDictionary()


class RuntimeEstimate:
    """The runtime figures of one bundle under one config's datasheet speeds."""

    def __init__(self, config: Config, bundle: Any) -> None:
        self.config, self.bundle = config, bundle

    def weighed_ratio(self, fam: Mapping[str, Any], measured: tuple[float, float | None], gt: GpuType, gpus: int,
                      req_type: str | None, req_total: int, exponent: Callable[[], float],
                      precision_bits: float | None = None) -> tuple[float, float | None]:
        """A type's measured log time ratio over the asked one, shrunk toward the datasheet's (at
        ``exponent()``, the architecture's or site's speed exponent, never the family's own runs):
        precision-weighted, the measurement's variance the family's spread
        of log speed (``rate_variance``) over the runs on each side, the prior's ``PRIOR_RATIO_SD``.
        Where work is hidden from the script a ratio of a few runs says little and the datasheet
        decides; runs of known work agree closely and decide for themselves (the datasheet's speeds
        those a job of PRECISION_BITS runs at, ``GpuType.speed``). With it, the weighed
        figure's standard deviation (how sure a move on it is). A count change, or a bundle without
        run counts, keeps the measured ratio, with no deviation."""
        ratio, weight = measured
        variance = self.rate_variance(fam)
        if weight is None or variance is None or gpus != req_total or not req_type or gt.name == req_type:
            return ratio, None
        if variance * weight <= 0:
            return ratio, None
        speeds = self.config.gpu_types
        prior = exponent() * math.log(
            max(speeds[req_type].speed(precision_bits), 1e-9) / max(gt.speed(precision_bits), 1e-9))
        w_measured, w_prior = 1.0 / (variance * weight), 1.0 / PRIOR_RATIO_SD ** 2
        return (w_measured * ratio + w_prior * prior) / (w_measured + w_prior), (w_measured + w_prior) ** -0.5

    def rate_variance(self, fam: Mapping[str, Any]) -> float | None:
        """The variance of one run's log speed about its shape's mean: the family's (``rate_ss`` over
        ``rate_dof``) shrunk toward the site's pooled one by ``SITE_SPREAD_DOF``; None for a bundle
        without these figures."""
        if self.bundle not in _SITE_SPREADS:
            fams = self.bundle.history.families.values()
            ss = sum(float(f.get("rate_ss", 0.0)) for f in fams)
            dof = sum(float(f.get("rate_dof", 0.0)) for f in fams)
            _SITE_SPREADS[self.bundle] = ss / dof if dof > 0 else None
        site = _SITE_SPREADS[self.bundle]
        if site is None:
            return None
        return (float(fam.get("rate_ss", 0.0)) + SITE_SPREAD_DOF * site) / (float(fam.get("rate_dof", 0.0))
                                                                              + SITE_SPREAD_DOF)

    def speed_exponent(self, sf: Mapping[str, Any], gpus: int, own: bool = True) -> float:
        """How strongly the family's speed follows the datasheet: the least-squares slope of its
        measured log speed (``rate:`` per batch, at GPUS) on log relative speed, the log batch
        tokens a second regressor (which runs went to which card must not pass for the card's
        speed), shrunk towards its architecture's (the other sizes and commands of its model,
        pooled), itself shrunk towards the site's (``site_exponent``), each by the measured slope's
        precision (``speed_fit``) against ``SPEED_PRIOR``. In [0, ``MAX_SLOPE``]. Not ``own``: without
        the family's own runs (the prior its own measured ratios are weighed against must not be made
        of them)."""
        prior = self.site_exponent()
        levels = [[self.points(fam, gpus) for fam in self.bundle.history.siblings(sf)]]
        if own:
            levels.append([self.points(self.bundle.history.family(sf["family"]), gpus)])
        for groups in levels:
            spread, measured = speed_fit(groups)
            prior = (spread * measured + SPEED_PRIOR * prior) / (spread + SPEED_PRIOR)
        return prior

    def site_exponent(self) -> float:
        """The speed slope of all families at every count (each its own intercept), in [0, ``MAX_SLOPE``]:
        the prior for a family that ran on too few types to say (1, the datasheet, without any).
        Computed once per bundle and set of datasheet speeds (the daemon decides many jobs)."""
        speeds = tuple(sorted((name, t.relative_speed, t.fp32_speed) for name, t in self.config.gpu_types.items()))
        known = _SITE_SLOPES.setdefault(self.bundle, {})
        if speeds not in known:
            counts = {fam_key: {k[len(RATE):].split("x", 1)[0] for k in fam if k.startswith(RATE)}
                      for fam_key, fam in self.bundle.history.families.items()}
            groups = [self.points(self.bundle.history.family(fam_key), int(n))
                      for fam_key, ns in counts.items() for n in ns if n.isdigit()]
            spread, measured = speed_fit(groups)
            known[speeds] = measured if spread > 0 else 1.0
        return known[speeds]

    def points(self, fam: Mapping[str, Any], gpus: int) -> list[tuple[float, float, float, float]]:
        """The family's speed points at GPUS, each weighed by its runs over the family's spread."""
        return speed_points(self.config, fam, gpus, self.rate_variance(fam))

    def plausible_runtime(self, model_s: float, asked_s: float, asked_type: str, asked_gpus: int,
                          gpu_type: str, gpus: int, used: int, precision_bits: float | None = None) -> float:
        """Runtime on a shape the family never ran on, held to the hardware: scaled from the
        family's own requested shape by the config's relative speed and by the GPUs the launch
        uses (``used``), the model's figure kept only where it is more cautious. A card or count
        faster on paper is never predicted slower than the request, a slower one never faster
        than its speed ratio says (issue: no faster card predicted slower without evidence)."""
        speed = self.config.gpu_types
        scale = (speed[asked_type].speed(precision_bits) / max(speed[gpu_type].speed(precision_bits), 1e-9)
                 * min(asked_gpus, used) / max(min(gpus, used), 1))
        prior = asked_s * scale
        if scale <= 1.0:
            return min(max(model_s, prior), asked_s)
        return max(model_s, prior)


def measured_ratio(fam: Mapping[str, Any], shape: tuple[str, int], asked: tuple[str | None, int],
                   log_tokens: float) -> tuple[float, float | None] | None:
    """The family's measured log speed ratio (``rate:``, time per step and token) of SHAPE over the
    ASKED shape: at this job's batch where it ran both there, else the mean over the batches it
    ran on both (paired: each shape's mean over all its batches mixes which jobs ran where, and
    once made a V100 look 3.8 times faster than an A100 for a family whose large-batch runs went
    to V100s); None where it never ran both at one batch. With it, the variance of that figure
    in units of one run's (the sum over the pairs of 1/runs on each side, over pairs squared),
    None where the bundle counts no runs."""
    new, old = (RATE + rate_keys(gpus, gpu_type or "", log_tokens)[0] for gpu_type, gpus in (shape, asked))

    def runs(key: str) -> float | None:
        n = fam.get(RATE_N + key[len(RATE):])
        return float(n) if n else None

    if new in fam and old in fam:
        pairs = [(float(fam[new]) - float(fam[old]), runs(new), runs(old))]
    else:
        new_at, old_at = new[:new.index("@") + 1], old[:old.index("@") + 1]
        pairs = [(float(v) - float(fam[old_at + k[len(new_at):]]), runs(k), runs(old_at + k[len(new_at):]))
                 for k, v in keys_at(fam, new_at) if old_at + k[len(new_at):] in fam]
    if not pairs:
        return None
    ratio = sum(p for p, _, _ in pairs) / len(pairs)
    if any(a is None or b is None for _, a, b in pairs):
        return ratio, None
    return ratio, sum(1 / a + 1 / b for _, a, b in pairs if a and b) / len(pairs) ** 2


def speed_points(config: Config, fam: Mapping[str, Any], gpus: int, variance: float | None = None
                 ) -> list[tuple[float, float, float, float]]:
    """(log relative speed, log batch tokens, log speed, weight) of each batch the family ran on GPUS
    of a type: the weight is the point's precision, its runs (``rate_n:``, 1 where not counted) over
    VARIANCE, one run's variance of log speed (1 where not known). Where the work is hidden from the
    script a mean of a few runs is as wide as the work's spread and must not pass for the card's speed.
    The speed is the one the family's precision runs at (``bits``, ``GpuType.speed``): a site's slope
    pools families of every precision, each against its own column of the datasheet."""
    points = []
    for name, t in config.gpu_types.items():
        at = f"{RATE}{gpus}x{name}@"
        for key, v in keys_at(fam, at):
            runs = float(fam.get(RATE_N + key[len(RATE):]) or 1.0)
            points.append((math.log(max(t.speed(fam.get("bits")), 1e-9)), math.log(max(float(key[len(at):]), 1.0)),
                           -float(v), runs / (variance or 1.0)))
    return points


def speed_fit(groups: list[list[tuple[float, float, float, float]]]) -> tuple[float, float]:
    """Weighted least squares of log speed on log relative speed and log tokens, each group its own
    intercept: the precision of the speed slope (the weighted spread of the speeds with the tokens
    held fixed), and the slope in [0, ``MAX_SLOPE``] (1 where the spread is none)."""
    sums = [0.0] * 5  # xx, zz, xz, xy, zy
    for points in groups:
        total = sum(p[3] for p in points)
        if len(points) < 2 or total <= 0:
            continue
        mx, mz, my = (sum(p[i] * p[3] for p in points) / total for i in range(3))
        for x, z, y, w in points:
            dx, dz, dy = x - mx, z - mz, y - my
            for i, v in enumerate((dx * dx, dz * dz, dx * dz, dx * dy, dz * dy)):
                sums[i] += w * v
    sxx, szz, sxz, sxy, szy = sums
    spread = sxx - sxz * sxz / szz if szz > 1e-12 else sxx
    if spread <= 1e-12:
        return 0.0, 1.0
    measured = (sxy * szz - szy * sxz) / (sxx * szz - sxz * sxz) if szz > 1e-12 else sxy / sxx
    return spread, min(max(measured, 0.0), MAX_SLOPE)
