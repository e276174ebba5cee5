"""Whether a job holds on a card: the predicted peak with its margin, or the family's outcomes
(runs that ended well on a card that size), and the words that say which, with the hint of what
would make a request that does not fit hold.

Apart from the decider (pipeline/policy.py) so that the fit test stands on its own; the
candidate table (pipeline/candidates.py) calls it per row and the decider for its reasons.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from slurmgpu.pipeline.config import Config, GpuType, Partition
from slurmgpu.pipeline.features import log_size
from slurmgpu.pipeline.request import JobRequest

# Memory and runtime on a type or count the job family has never run on: its figures are a
# prediction from other families, doubted by this factor.
UNSEEN_PENALTY = 1.6
BORDERLINE = 0.15  # a fitting peak (with margin) this close to the card is worth a word


class Row(Protocol):
    """A row of the candidate table (pipeline/candidates.py ``Candidate``), as the fit words read it."""

    @property
    def gpu_type(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def fits(self) -> bool: ...
    @property
    def pred_peak_mem_mib(self) -> float: ...
    @property
    def margin(self) -> float: ...


class MemoryBound:
    """The fit test of one bundle's predictions and outcomes on one config's cards."""

    def __init__(self, config: Config, bundle: Any) -> None:
        self.config, self.bundle = config, bundle

    def margin(self, known: bool) -> float:
        """The fit test's margin over a predicted peak: ``memory_margin``, doubted by
        ``UNSEEN_PENALTY`` on a shape the family never ran."""
        return (1 + self.config.policy.memory_margin) * (1.0 if known else UNSEEN_PENALTY) - 1

    def fits(self, peak_mib: float, margin: float, gt: GpuType, sf: Mapping[str, Any], gpus: int,
             asked_gib: float | None) -> bool:
        """The table's fit test for one shape: the predicted peak with its margin within the card, or
        a card the family's outcomes show it holds on (a run with at least these tokens per GPU
        ended well on a card that size, on as many GPUs or fewer: evidence beats a prediction,
        which a wide margin can push past a card the family completes on). Where the bundle has no
        measured peaks, only the outcomes count, and the request itself where the estimate fits the
        card asked (ASKED_GIB, given for the asked shape and for any card at least as large at its
        count: such a card holds whatever the asked one holds; in the decision benchmark a ResNet-50
        job at batch 128 was kept on the 12 GiB K80 it asked for, whose outcomes at that batch were
        none, as were the 16 GiB cards', and ran out of memory there)."""
        fits = peak_mib * (1 + margin) <= gt.memory_gib * 1024
        outcomes_only = getattr(self.bundle, "memory_source", "telemetry") == "outcomes"
        if fits and not outcomes_only:  # the family's outcomes are read only where they can decide
            return True
        held = self.bundle.history.held_bound_gib(sf["family"], sf["log_tokens"], gpus)
        by_outcome = held is not None and held <= gt.memory_gib
        as_asked = asked_gib is not None and peak_mib * (1 + margin) <= asked_gib * 1024
        return (by_outcome or as_asked) if outcomes_only else by_outcome

    def fit_words(self, c: Row, sf: Mapping[str, Any], asked_gpus: int) -> str:
        """Why a fitting choice fits, in the reason: its predicted peak, or the family's outcomes
        where they, not the prediction, make it fit (on the asked count, for a count trimmed to
        the GPUs the family keeps busy: it runs as it ran there)."""
        if c.pred_peak_mem_mib * (1 + c.margin) <= self.config.gpu_types[c.gpu_type].memory_gib * 1024:
            return f"peak {c.pred_peak_mem_mib / 1024:.1f} GiB per GPU fits"
        held = next(h for h in (self.bundle.history.held_bound_gib(sf["family"], sf["log_tokens"], n)
                                for n in (c.gpus, asked_gpus)) if h is not None)
        return (f"fits: its family's runs held on {held:g} GiB cards at this batch or larger "
                f"(predicted peak {c.pred_peak_mem_mib / 1024:.1f} GiB per GPU)")

    def estimate_mib(self, sf: Mapping[str, Any], req: Mapping[str, Any], gt: GpuType, gpus: int) -> float:
        """The job's peak per GPU on GPUS of GT before the margin its stratum was calibrated to
        (``Bundle.peak_estimate_mib``): what the bound the fit test reads (with ``margin``) stands on."""
        from slurmgpu.pipeline.features import card_features, job_features

        f = job_features(sf, req, card_features(gt, sf["precision_bits"]), gpus, self.bundle.history, gt.name)
        return float(self.bundle.peak_estimate_mib(f, sf))

    def fit_hint(self, request: JobRequest, sf: Mapping[str, Any], req: Mapping[str, Any], baseline: Row,
                 table: Sequence[Row], seen: set[str], offered: Sequence[Partition]) -> str:
        """For a request predicted not to fit: the largest batch size that fits the requested card
        (the bundle evaluated again with the batch changed, when the script writes one), and the
        smallest request that holds the job as written: a larger card from the table, or, for a
        ZeRO-sharded job, more GPUs of the requested type. Every figure is the one tested."""
        from slurmgpu.pipeline.features import card_features, command_lines, job_features, main_command, option_values

        gt = self.config.gpu_types[baseline.gpu_type]
        gpu = card_features(gt, sf["precision_bits"])
        hints: list[str] = []

        def peak(feats: Mapping[str, Any], gpus: int) -> tuple[float, float]:
            """Predicted peak and the margin its fit test uses (as in the table)."""
            peak_mib = self.bundle.peak_mib(job_features(feats, req, gpu, gpus, self.bundle.history, gt.name), feats)
            return float(peak_mib), self.margin(f"{gpus}x{gt.name}" in seen)

        batch = int(sf["batch_size"])
        words = main_command(command_lines(request.script.text if request.script else "")).split()
        if batch > 1 and "batch_size" in option_values(words):
            def at(b: int) -> tuple[bool, float]:
                feats = {**sf, "batch_size": float(b), "log_tokens": log_size(b * float(sf["seq_len"]))}
                p, margin = peak(feats, baseline.gpus)
                return self.fits(p, margin, gt, feats, baseline.gpus, gt.memory_gib), p

            ok, low_peak = at(1)
            if ok:  # the prediction grows with the batch (near enough): the largest batch that still fits
                lo, hi, found = 1, batch - 1, (1, low_peak)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    fit, p = at(mid)
                    if fit:
                        lo, found = mid, (mid, p)
                    else:
                        hi = mid - 1
                margin = self.margin(f"{baseline.gpus}x{gt.name}" in seen)
                hints.append(f"batch size {found[0]} would fit {baseline.gpus} x {gt.name} "
                             f"({fit_evidence(found[1], margin, gt.memory_gib)})")
        mem = self.config.gpu_types
        larger = [c for c in table if c.fits and c.gpus == baseline.gpus and mem[c.gpu_type].memory_gib > gt.memory_gib]
        holds = []
        if larger:
            c = min(larger, key=lambda c: (mem[c.gpu_type].memory_gib, c.pred_peak_mem_mib))
            holds.append(f"{c.gpus} x {c.gpu_type} ({mem[c.gpu_type].memory_gib:g} GiB, "
                         f"{fit_evidence(c.pred_peak_mem_mib, c.margin, mem[c.gpu_type].memory_gib, False)})")
        if float(sf.get("zero", 0.0)) > 0 and request.main.nodes == 1:
            most = max((p.gpus_per_node for p in offered if gt.name in p.gpu_types), default=0)
            for k in range(baseline.gpus + 1, most + 1):
                p, margin = peak(sf, k)
                if self.fits(p, margin, gt, sf, k, None):
                    shown = f"predicted peak {p / 1024:.1f} GiB per GPU" if by_prediction(p, margin, gt.memory_gib) \
                        else fit_evidence(p, margin, gt.memory_gib)
                    holds.append(f"{k} x {gt.name} with ZeRO sharding ({shown})")
                    break
        if holds:
            hints.append("smallest request that holds it: " + " or ".join(holds))
        return "; hint: " + "; ".join(hints) if hints else ""


def by_prediction(peak_mib: float, margin: float, card_gib: float) -> bool:
    """Whether a fit rests on the prediction (the peak with its margin within the card); a fit
    that does not rests on the family's past runs on such cards (MemoryBound.fits)."""
    return peak_mib * (1 + margin) <= card_gib * 1024


def fit_evidence(peak_mib: float, margin: float, card_gib: float, of_card: bool = True) -> str:
    """What a fit claim rests on, in words: the predicted peak (``of 32 GiB`` when OF_CARD), or,
    where that peak is above the card, the family's past runs, with the prediction said as such."""
    peak = f"predicted peak {peak_mib / 1024:.1f} GiB"
    if by_prediction(peak_mib, margin, card_gib):
        return f"{peak} of {card_gib:g} GiB" if of_card else peak
    # a peak past any figure (infinite, not a number) is said without it: no reason shows inf or nan
    above = f"the {peak} is above the card" if math.isfinite(peak_mib) else "no usable peak is predicted"
    return f"by its family's runs, which held on {card_gib:g} GiB cards at this batch or larger; {above}"


def borderline(c: Row, gt: GpuType) -> str:
    """A note when a fitting choice's predicted peak, with the margin, is within 15% of its card."""
    margin = c.margin
    with_margin = c.pred_peak_mem_mib * (1 + margin) / 1024
    if not c.fits or with_margin < (1 - BORDERLINE) * gt.memory_gib or with_margin > gt.memory_gib:
        return ""
    return (f"; borderline: predicted peak {with_margin:.1f} GiB (with the {margin:.0%} margin) "
            f"of {gt.memory_gib:g} GiB on {gt.name}")
