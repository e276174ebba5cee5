"""The decision tag: a short record of a decision that travels with the job in its AdminComment.

``slurmgpu:d=<decision id>;m=<decider>;p=<predicted peak GiB per GPU>;t=<predicted minutes>`` (p and t
only when the model predicted them). The hook
sets it in the job's AdminComment, which users cannot set (sbatch has no option for it; ``scontrol
update`` refuses it to them) and sacct keeps, so the ingest links the job to the daemon's record of the
decision. gsbatch, running as the user, cannot set it: its record names its job instead, and carries
the tag's decision id. A tag in the user's Comment is the user's text and never believed.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

PREFIX = "slurmgpu:"
TAG = re.compile(r"slurmgpu:d=(?P<d>[0-9a-f]{12})(?:;m=(?P<m>[a-z][a-z0-9.-]{0,23}))?(?:;p=(?P<p>\d{1,5}(?:\.\d)?))?"
                 r"(?:;t=(?P<t>\d{1,7}))?(?:;r=(?P<r>\d))?")
DECISION_ID = re.compile(r"[0-9a-f]{12}")


def new_decision_id() -> str:
    return secrets.token_hex(6)


def make_tag(decision_id: str, decider: str, peak_gib: float | None = None, minutes: float | None = None) -> str:
    """The tag for a decision: short, parseable, no spaces (a Slurm comment is one line)."""
    text = f"{PREFIX}d={decision_id};m={decider}"
    if peak_gib is not None and 0 <= peak_gib < 100000:
        text += f";p={peak_gib:.1f}"
    if minutes is not None and 0 <= minutes < 10**7:
        text += f";t={max(1, round(minutes))}"
    return text


def parse_tag(comment: str | None) -> dict[str, str] | None:
    """The tag's fields (d, m, p, t, r) when ``comment`` is exactly a tag, else None."""
    match = TAG.fullmatch(comment or "")
    return {k: v for k, v in match.groupdict().items() if v is not None} if match else None


def decision_tag(decision: Mapping[str, Any], decision_id: str, asked_type: str | None = None,
                 asked_gpus: int | None = None) -> str:
    """The tag for a decision in JSON form (``Decision.to_json``): the predicted peak and runtime of
    the type and count chosen (or kept: ``asked_*``), when the model weighed them."""
    decider = str(decision.get("decider") or "keep")
    decider = decider if re.fullmatch(r"[a-z][a-z0-9.-]{0,23}", decider) else "other"
    changes = decision.get("changes") or []
    chosen = changes[0] if changes and isinstance(changes[0], Mapping) else {}
    want_type = chosen.get("gpu_type") or asked_type
    want_gpus = chosen.get("gpus_total") or asked_gpus
    pick = next((c for c in decision.get("per_type") or [] if isinstance(c, Mapping)
                 and c.get("gpu_type") == want_type and c.get("gpus") == want_gpus), None)
    peak = pick.get("pred_peak_mem_mib") if pick else None
    runtime = pick.get("pred_runtime_s") if pick else None
    return make_tag(decision_id, decider, peak / 1024 if isinstance(peak, int | float) else None,
                    runtime / 60 if isinstance(runtime, int | float) else None)
