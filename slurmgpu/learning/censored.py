"""What a job's outcome says about the GPU memory it needed: an interval, from sacct alone.

Most sites' accounting has no GPU-memory field, but every job's outcome bounds its need: a job that
ran to completion (or to its time limit, or long past its start) on a card of M MiB needed at most
M; one that ran out of GPU memory on it needed more than M; with telemetry the peak is known exactly.
These are interval-censored observations of the peak.

Only the upper bounds are acted on without telemetry: a job of a family that held on cards of M
GiB at this size or larger fits any card of at least M GiB. Fitting a distribution to the
intervals instead (an accelerated-failure-time model, CatBoost's ``SurvivalAft``) was tried and
measured: where a family never ran out of memory its peak is only known to lie below the card, the
fit's spread collapsed to the lower limit, and 12% of held-out peaks were under-predicted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# A job that ran at least this long before failing or being cancelled passed its first steps, where
# frameworks reach their peak (weights, optimizer state and the first batches are allocated there).
SURVIVED_S = 300
INF = math.inf


def memory_interval(example: Mapping[str, Any], card_mib: float) -> tuple[float, float] | None:
    """Bounds (MiB) on the per-GPU peak a job needed, from what it did on a card of CARD_MIB.

    ``example`` has ``peak`` (measured, or None), ``oom`` (it ran out of GPU memory), ``state``
    and ``elapsed`` (s). None when the outcome says nothing (an early failure, no card size)."""
    if example.get("oom") or example.get("state") == "OUT_OF_MEMORY":
        return (card_mib, INF) if card_mib > 0 else None
    if example.get("peak"):
        return float(example["peak"]), float(example["peak"])
    if card_mib <= 0:
        return None
    state = example.get("state")
    if state in ("COMPLETED", "TIMEOUT") or (state in ("FAILED", "CANCELLED") and
                                              (example.get("elapsed") or 0) >= SURVIVED_S):
        return 0.0, card_mib
    return None
