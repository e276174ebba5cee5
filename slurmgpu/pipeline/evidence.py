"""What a job family's own history says beyond the learned models: the evidence the decider reads
before it ranks shapes.

Its completed runs' GPU utilisation (a MIG slice holds the job: ``slices``), how many of the asked
GPUs they kept busy (``busy``), whether the job may run on a type at all (precision: ``runs_there``),
and the peak the model predicts on one shape (``peak_mib``, for ``--gpu-mem``'s reason). Each needs
``policy.min_history`` runs of the family; with fewer it says nothing and the request stands.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from slurmgpu.pipeline.config import Config, Partition
from slurmgpu.pipeline.features import busy_bound, util_bound
from slurmgpu.pipeline.hardware import supports_bf16
from slurmgpu.pipeline.request import JobRequest

# A script that talks between GPUs or processes: never moved to a MIG slice (an instance is one
# device to one process; NCCL has no peer-to-peer or NVLink between instances).
_DISTRIBUTED = re.compile(r"NCCL|torch\.distributed|init_process_group|DistributedDataParallel|deepspeed|horovod"
                          r"|\bmpirun\b|\bmpiexec\b|--multi[_-]gpu", re.IGNORECASE)


class FamilyEvidence:
    """The family's history (the bundle's per-family statistics) read under the site's config."""

    def __init__(self, config: Config, bundle: Any) -> None:
        self.config, self.bundle = config, bundle

    def slices(self, request: JobRequest, sf: Mapping[str, Any], offered: Iterable[Partition],
               need: int | None) -> dict[str, str]:
        """The MIG slices among the offered types the job may move to, each with the evidence in
        words: only for ``balanced`` and ``cheapest`` (a slice is never faster), a one-GPU, one-node
        job asked on a whole card whose script shows nothing distributed, and whose family's
        completed one-GPU runs on that card (at least ``min_history``, with the collector's figures)
        kept it busy no more of the time than the slice's share of that card's speed: a kernel
        running ``u`` of the time on a card of speed ``s`` runs at most ``u * s / slice speed`` of
        the time on the slice, so the job's wall time stays that of the card. The memory test is
        the table's, on the prediction alone (pipeline/candidates.py ``CandidateTable.on_slices``). The
        speeds are those of the job's precision (``Config.at_precision``)."""
        comp, types = request.main, self.config.at_precision(sf["precision_bits"]).gpu_types
        slice_types = [t for p in offered for t in p.gpu_types if types[t].is_slice]
        asked = types.get(comp.gpu_type or "")
        if not slice_types or asked is None or asked.is_slice or self.config.policy.objective == "fastest" \
                or comp.gpus_total != 1 or comp.nodes != 1 or (need or 1) > 1 or sf.get("nproc", 1) > 1 \
                or request.script is None or _DISTRIBUTED.search(request.script.text):
            return {}
        bound = util_bound(self.bundle.history.family(sf["family"]), asked.name)
        if bound is None or bound[1] < self.config.policy.min_history:
            return {}
        share = bound[0] / 100 * asked.relative_speed  # of the speed-1 card, the compute the job kept busy
        return {t: (f"{t} is a MIG slice ({types[t].compute_fraction:.3g} of {types[t].mig_of}, speed "
                    f"{types[t].relative_speed:g}): this family's {bound[1]} runs on 1 x {asked.name} (speed "
                    f"{asked.relative_speed:g}) kept it at most {bound[0]:.0f}% busy, {share:.3g} of speed 1")
                for t in dict.fromkeys(slice_types) if share <= types[t].relative_speed}

    def busy(self, sf: Mapping[str, Any], req_total: int) -> tuple[int, int] | None:
        """(the most GPUs busy, runs) where at least ``min_history`` of the family's completed runs on
        the asked count kept fewer GPUs busy than asked, and at least one (the collector's per-GPU
        figures): a script whose launch shows no count of its own may then be given that many."""
        bound = busy_bound(self.bundle.history.family(sf["family"]), req_total)
        # None busy says nothing of how many it drives (its work may sit below the threshold on all).
        if bound is None or bound[1] < self.config.policy.min_history or not 0 < bound[0] < req_total:
            return None
        return bound

    def peak_mib(self, request: JobRequest, gpu_type: str, gpus: int) -> float | None:
        """The per-GPU peak the model predicts for this job on ``gpus`` x ``gpu_type`` (MiB), or None
        when the model has no say: no script, a heterogeneous job, or too little history of the family."""
        from slurmgpu.pipeline.features import card_features, job_features, script_features

        if request.script is None or request.is_hetjob or gpu_type not in self.config.gpu_types:
            return None
        sf = script_features(request.script.text)
        fam = self.bundle.history.family(sf["family"])
        if fam.get("n", 0) < self.config.policy.min_history:
            return None
        comp = request.main
        gt = self.config.gpu_types[gpu_type]
        req = {**request.to_json(), "req_gpu_mem_gib": self.mem_gib(comp.gpu_type)}
        feats = job_features(sf, req, card_features(gt, sf["precision_bits"]), gpus, self.bundle.history, gt.name)
        return float(self.bundle.peak_mib(feats, sf))

    def runs_there(self, sf: Mapping[str, Any], req_type: str | None, gpu_type: str) -> bool:
        """Whether the job may move to ``gpu_type`` at all (pipeline/hardware.py): a bf16 job never to
        a card without bf16; an fp32 job from a TF32 card (Ampere and newer) to one without TF32 only
        where its family ran on that type (its speed there is many times the datasheet ratio off)."""
        if supports_bf16(gpu_type) is not False:
            return True
        if sf.get("bf16"):
            return False
        if sf.get("precision_bits", 32) >= 32 and req_type and supports_bf16(req_type):
            shapes = self.bundle.history.family(sf["family"]).get("shapes", ())
            return any(s.split("x", 1)[-1] == gpu_type for s in shapes)
        return True

    def mem_gib(self, gtype: str | None) -> float:
        t = self.config.gpu_types.get(gtype or "")
        return t.memory_gib if t else 0.0
