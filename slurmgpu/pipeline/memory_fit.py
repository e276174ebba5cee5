"""Whether the GPUs a submission goes to hold the job's predicted peak memory, read from a plan's
JSON form (``Plan.to_json``) after the admin's mode and waivers.

Apart from ``plan`` so that gsbatch, holding the daemon's plan as JSON, loads none of the decision
code (policy, features, rewrite) to say it: a kept decision costs reading the script, one round
trip to the daemon and sbatch.
"""

from __future__ import annotations

from collections.abc import Mapping

from slurmgpu.typing_lite import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any


def oom_warning(plan: Mapping[str, Any], memory_gib: Mapping[str, float]) -> str | None:
    """One line when the prediction says the job will not fit the GPUs it goes to: the shape as
    submitted (the decided one when the submission is changed, else as written: kept, advised or
    waived) is a row of the decision's table that does not fit. ``plan``: ``Plan.to_json`` form,
    after the mode and waivers; ``memory_gib``: the config's memory per GPU type."""
    decision, record = plan.get("decision") or {}, plan.get("record") or {}
    original = record.get("original_request") or {}
    shape = (original.get("gpu_type"), original.get("gpus_total"))
    if (plan.get("submission") or {}).get("changed"):
        change: Mapping[str, Any] = next((c for c in decision.get("changes") or [] if c.get("index", 0) == 0), {})
        shape = (change.get("gpu_type") or shape[0], change.get("gpus_total") or shape[1])
    row = next((c for c in decision.get("per_type") or [] if (c.get("gpu_type"), c.get("gpus")) == shape), None)
    gpu_type = shape[0]
    if row is None or row.get("fits") or not isinstance(gpu_type, str) or gpu_type not in memory_gib:
        return None
    peak, margin = float(row["pred_peak_mem_mib"]) / 1024, float(row.get("margin", 0.0))
    return (f"predicted to run out of GPU memory: peak {peak:.1f} GiB per GPU ({peak * (1 + margin):.1f} GiB with "
            f"the {margin:.0%} margin) does not fit {shape[1]} x {gpu_type} ({memory_gib[gpu_type]:g} GiB each)")
