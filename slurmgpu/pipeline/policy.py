"""The decision: which GPU type, how many, and in which partition a job should run.

Deciders share one small interface (``decide(request) -> Decision``) so the rule-based one
here and the learned one later are interchangeable. A decision is data: what to change, why,
and — when the request cannot be satisfied at all — why it is refused before submission.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from slurmgpu.pipeline.config import Config, GpuType
from slurmgpu.pipeline.request import ComponentRequest, JobRequest


class ComponentChange(NamedTuple):
    """New values for one component; None means 'leave as the user wrote it'."""

    index: int  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema
    gpu_type: str | None = None
    gpus_total: int | None = None
    partition: str | None = None


class Candidate(NamedTuple):
    """One GPU type and count the model weighed, with its numbers (for --explain and predict)."""

    gpu_type: str
    gpus: int
    fits: bool
    pred_peak_mem_mib: float
    pred_runtime_s: float
    expected_wait_s: float


class Decision(NamedTuple):
    changes: tuple[ComponentChange, ...] = ()
    reasons: tuple[str, ...] = ()
    refusal: str | None = None
    decider: str = "keep"
    per_type: tuple[Candidate, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "decider": self.decider,
            "changed": self.changed,
            "refused": self.refusal,
            "changes": [c._asdict() for c in self.changes],
            "reasons": list(self.reasons),
            "per_type": [c._asdict() for c in self.per_type],
        }


KEEP = Decision()


# Whether Slurm would take this component in that partition: None when it would, else why not.
Admits = Callable[[str, ComponentRequest], "str | None"]


class Decider(Protocol):
    name: str

    def decide(self, request: JobRequest) -> Decision: ...


class KeepDecider:
    """Never changes anything: the opt-out, and the fallback when slurmgpu cannot decide."""

    name = "keep"

    def __init__(self, reason: str = "the user's request stands") -> None:
        self.reason = reason

    def decide(self, request: JobRequest) -> Decision:
        return Decision(reasons=(self.reason,), decider=self.name)


class RuleDecider:
    """Fixes requests the admin config proves wrong; leaves every other request alone.

    A typed request aimed at a partition that lacks that type moves to a partition that has
    it; a per-node count larger than any node of the partition holds is refused, since Slurm
    would only leave it pending forever or reject it with a less helpful message.
    """

    name = "rules"

    def __init__(self, config: Config, admits: Admits | None = None) -> None:
        self.config, self.admits = config, admits

    def decide(self, request: JobRequest) -> Decision:
        changes: list[ComponentChange] = []
        reasons: list[str] = []
        for comp in request.components:
            if not comp.gpus_total:  # no GPU option, or only zero counts (Slurm skips those)
                continue
            change, why, refusal = self._component(comp, request.is_hetjob)
            if refusal:
                return Decision(reasons=tuple(reasons), refusal=refusal, decider=self.name)
            reasons.extend(why)
            if change:
                changes.append(change)
        if not reasons:
            reasons.append("the request fits the partition it asks for")
        return Decision(tuple(changes), tuple(reasons), decider=self.name)

    def _component(self, comp: ComponentRequest, het: bool) -> tuple[ComponentChange | None, list[str], str | None]:
        label = f"component {comp.index}: " if het else ""
        cfg = self.config
        asked = comp.partitions or ([cfg.default_partition] if cfg.default_partition else [])
        known = [cfg.partitions[p] for p in asked if p in cfg.partitions]
        if not known:
            where = ",".join(asked) or "(default)"
            return None, [f"{label}partition {where} is not in the slurmgpu config; request kept"], None
        from_constraint = not any(g.type for g in comp.gpus)
        gtype = cfg.type_for_feature(comp.gpu_type) if from_constraint and comp.gpu_type else comp.gpu_type
        target = None
        reasons: list[str] = []
        if gtype and not any(gtype in p.gpu_types for p in known):
            offering = cfg.partitions_with(gtype)
            if not offering:
                return None, [f"{label}no configured partition offers GPU type {gtype}; request kept"], None
            refused = {p.name: self.admits(p.name, comp) for p in offering} if self.admits else {}
            open_to_job = [p for p in offering if refused.get(p.name) is None]
            if not open_to_job:
                why = "; ".join(r for r in refused.values() if r)
                return None, [f"{label}GPU type {gtype} is not in partition {','.join(asked)}, and no partition "
                              f"offering it admits the job ({why}); request kept"], None
            target = open_to_job[0]
            if shared := _shared_in_hetjob(comp, ["partition"], het):
                return None, [f"{label}GPU type {gtype} is not in partition {','.join(asked)}, but {shared}; "
                              "request kept"], None
            reasons.append(f"{label}GPU type {gtype} is not in partition {','.join(asked)}; "
                           f"moved to {target.name}, which has it")
        check = [target] if target else [p for p in known if not gtype or gtype in p.gpu_types]
        per_node = comp.gpus_per_node if (comp.nodes_set or any(g.per != "job" for g in comp.gpus)) else None
        fits = [p for p in check if (per_node or 0) <= p.gpus_per_node
                and comp.gpus_total <= p.gpus_per_node * p.nodes]
        if not fits:
            p = check[0]
            if per_node and per_node > p.gpus_per_node:
                return None, reasons, (f"{label}asks for {per_node} GPUs per node but partition {p.name} "
                                       f"has at most {p.gpus_per_node} per node")
            return None, reasons, (f"{label}asks for {comp.gpus_total} GPUs but partition {p.name} has "
                                   f"{p.gpus_per_node * p.nodes} in all")
        new_type = gtype if from_constraint else None
        blocker = comp.rewrite_blocker or _shared_in_hetjob(comp, {g.option for g in comp.gpus}, het)
        if new_type and blocker:
            # Writing the type into one entry (or one shared value) would change what Slurm reads elsewhere.
            reasons.append(f"{label}--constraint names {comp.gpu_type}, but the GPU request is left as written: "
                           f"{blocker}")
            new_type = None
        elif new_type:
            reasons.append(f"{label}--constraint names {comp.gpu_type}, but an untyped GPU request may get "
                           f"any GPU type on a node with several; asked for {new_type} explicitly")
        if target or new_type:
            change = ComponentChange(comp.index, gpu_type=new_type, partition=target.name if target else None)
            return change, reasons, None
        return None, reasons, None


def _shared_in_hetjob(comp: ComponentRequest, names: Iterable[str], het: bool) -> str | None:
    """Why changing these options for one component of a heterogeneous job would change the others
    too: sbatch applies a command-line or SBATCH_* value to every component."""
    for name in sorted(names) if het else ():
        ov = comp.options.get(name)
        if ov is not None and ov.origin.source != "script":
            where = "command line" if ov.origin.source == "cli" else f"environment ({ov.origin.variable})"
            return f"--{name} is set on the {where}, which applies to every component"
    return None


class ModelDecider:
    """Chooses type and count from the learned models, and only when that is clearly better.

    The user's request stands when the job family has too little history, when the request is
    pinned (a GPU feature in --constraint, a heterogeneous job, no script to read), or when the
    best choice gains less than ``policy.min_gain``. A type whose predicted peak memory plus the
    margin exceeds the card is never chosen, and the count never goes below the requested count's
    memory need. The admin rules still apply first (a refusal stands).
    """

    name = "model"
    busy_wait_s = 1800.0  # assumed wait when a type has too few idle GPUs right now
    unseen_penalty = 1.6  # memory and runtime on a type or count the job family has never run on

    def __init__(self, config: Config, bundle: Any, free_gpus: Callable[[], Mapping[str, int]],
                 user: str | None = None, admits: Admits | None = None,
                 wait: Callable[[str, int], float] | None = None) -> None:
        """``wait(type, gpus)``: expected seconds until that many GPUs of the type start the job, from
        the queue (pipeline/queue.py); without it, idle GPUs now or ``busy_wait_s``."""
        self.config, self.bundle, self.free_gpus, self.user, self.admits = config, bundle, free_gpus, user, admits
        self.wait = wait
        self.rules = RuleDecider(config, admits)

    def _keep(self, rule: Decision, why: str, per_type: tuple[Candidate, ...] = ()) -> Decision:
        return rule._replace(reasons=(*rule.reasons, why), decider=self.name, per_type=per_type)

    def decide(self, request: JobRequest) -> Decision:
        from slurmgpu.pipeline.features import job_features, script_features
        from slurmgpu.pipeline.hardware import supports_bf16
        from slurmgpu.pipeline.launch import launch_need

        rule = self.rules.decide(request)
        if rule.refusal:
            return rule
        comp = request.main
        if request.is_hetjob or not comp.gpus_total or request.script is None:
            return self._keep(rule, "model: heterogeneous, GPU-less or script-less job; request kept")
        if comp.constraint_gpu_types:
            return self._keep(rule, "model: the request pins its GPU type; request kept")
        if comp.rewrite_blocker:
            return self._keep(rule, f"model: {comp.rewrite_blocker}; request kept as written")
        sf = script_features(request.script.text)
        fam_n = self.bundle.history.family(sf["family"]).get("n", 0)
        policy = self.config.policy
        if fam_n < policy.min_history:
            return self._keep(rule, f"model: {int(fam_n)} earlier jobs of this family (< {policy.min_history}); "
                                    "request kept")
        target = rule.changes[0].partition if rule.changes else None
        parts = [target] if target else (comp.partitions or [self.config.default_partition or ""])
        offered = [p for p in (self.config.partitions.get(n) for n in parts) if p]
        if not offered:
            return self._keep(rule, "model: partition unknown to the config; request kept")
        req_type, req_total = comp.gpu_type, comp.gpus_total
        # Fewer GPUs only as far as the launch follows (pipeline/launch.py); else only the type changes.
        need = launch_need(request.script.text, per_task=comp.gpus[0].per == "task").min_gpus
        fewest = need or req_total
        free = self.free_gpus() if self.wait is None else {}
        req = {**request.to_json(), "req_gpu_mem_gib": self._mem_gib(req_type)}
        options: list[tuple[GpuType, int, dict[str, float]]] = []
        for part in offered:
            for gtype in part.gpu_types:
                if sf.get("bf16") and gtype != req_type and supports_bf16(gtype) is False:
                    continue  # pipeline/hardware.py: a bf16 job is never moved to a card without bf16
                gt = self.config.gpu_types[gtype]
                gpu = {"memory_gib": gt.memory_gib, "relative_speed": gt.relative_speed}
                counts = range(min(fewest, req_total), min(req_total, part.gpus_per_node) + 1) \
                    if comp.nodes == 1 else [req_total]
                # only counts the user's unit can say: 3 GPUs over 2 tasks is no --gpus-per-task value
                counts = [c for c in counts if c % comp.multiplier(comp.gpus[0].per) == 0]
                options.extend((gt, c, job_features(sf, req, gpu, c, self.bundle.history)) for c in counts)
        preds = self.bundle.predict_many([f for _, _, f in options], sf["family"])
        # A type or count the family never ran on is a prediction from other families: doubt it more.
        seen = set(self.bundle.history.family(sf["family"]).get("shapes", ())) | {f"{req_total}x{req_type}"}
        asked_pred = next((p for (gt, c, _), p in zip(options, preds, strict=True)
                           if (gt.name, c) == (req_type, req_total)), None)
        table = []
        for (gt, c, _), pred in zip(options, preds, strict=True):
            known = f"{c}x{gt.name}" in seen
            peak = pred.peak_mem_mib * (1.0 if known else self.unseen_penalty)
            if known:
                runtime = pred.runtime_s
            elif asked_pred is None or req_type is None:
                runtime = pred.runtime_s * self.unseen_penalty
            else:
                runtime = self._plausible_runtime(pred.runtime_s, asked_pred.runtime_s, req_type, req_total,
                                                  gt.name, c, min(need or req_total, req_total))
            fits = peak * (1 + policy.memory_margin) <= gt.memory_gib * 1024
            if getattr(self.bundle, "memory_source", "telemetry") == "outcomes":
                # No measured peaks: only a card the family's outcomes show it holds on (or the
                # request itself, where the estimate allows) counts as fitting.
                held = self.bundle.history.held_bound_gib(sf["family"], sf["log_tokens"], c)
                asked_shape = c == req_total and (req_type is None or gt.name == req_type)
                fits = (held is not None and held <= gt.memory_gib) or (asked_shape and fits)
            table.append(Candidate(gt.name, c, fits, peak,
                                   runtime, self._expected_wait(gt.name, c, free)))
        per_type = tuple(table)
        asked = [c for c in table if c.gpus == req_total and (req_type is None or c.gpu_type == req_type)]
        if not asked:
            return self._keep(rule, "model: the requested type/count is outside the configured partitions; "
                                    "request kept", per_type)
        baseline = min(asked, key=lambda c: c.expected_wait_s + c.pred_runtime_s)
        effective = target or comp.partition or self.config.default_partition
        # Where each type would run: the job's own partition when it has the type, else another
        # offered one, and only one whose Slurm rules admit the job (a move must not get it refused).
        home: dict[str, str] = {}
        for p in offered:
            for gtype in p.gpu_types:
                if gtype not in home and (p.name == effective or self.admits is None
                                          or self.admits(p.name, comp) is None):
                    home[gtype] = p.name
        enough = [self._enough(c, table) for c in table if c.fits and c.gpus == req_total]
        choices = [c for c in enough if c is not None and c.gpu_type in home
                   and self._in_time(c, baseline, comp.time_limit_s)]
        if not choices:
            return self._keep(rule, "model: no other candidate fits the predicted memory within the time limit; "
                                    "request kept", per_type)
        best = min(choices, key=lambda c: self._score(c, baseline))
        gain = 1.0 - self._score(best, baseline) / self._score(baseline, baseline)
        if not baseline.fits:  # the job as asked would run out of GPU memory: any fitting choice wins
            gain = 1.0
        if (best.gpu_type, best.gpus) == (baseline.gpu_type, baseline.gpus) or gain < policy.min_gain:
            return self._keep(rule, f"model: best choice gains {gain:.0%} (< {policy.min_gain:.0%}); request kept",
                              per_type)
        partition = home[best.gpu_type]
        change = ComponentChange(0, gpu_type=best.gpu_type if best.gpu_type != req_type else None,
                                 gpus_total=best.gpus if best.gpus != req_total else None,
                                 partition=partition if (target or partition != effective) else None)
        if not baseline.fits:
            why = (f"model: predicted peak {baseline.pred_peak_mem_mib / 1024:.1f} GiB per GPU does not fit "
                   f"{baseline.gpu_type} (with margin); {best.gpus} x {best.gpu_type} fits "
                   f"({best.pred_peak_mem_mib / 1024:.1f} GiB)")
            return Decision((change,), (*rule.reasons, why), decider=self.name, per_type=per_type)
        why = (f"model ({self.config.policy.objective}): {best.gpus} x {best.gpu_type} predicted to finish in "
               f"{(best.expected_wait_s + best.pred_runtime_s) / 60:.0f} min vs "
               f"{(baseline.expected_wait_s + baseline.pred_runtime_s) / 60:.0f} min as asked "
               f"({gain:.0%} better), peak {best.pred_peak_mem_mib / 1024:.1f} GiB per GPU fits")
        return Decision((change,), (*rule.reasons, why), decider=self.name, per_type=per_type)

    def _plausible_runtime(self, model_s: float, asked_s: float, asked_type: str, asked_gpus: int,
                           gpu_type: str, gpus: int, used: int) -> float:
        """Runtime on a shape the family never ran on, held to the hardware: scaled from the
        family's own requested shape by the config's relative speed and by the GPUs the launch
        uses (``used``), the model's figure kept only where it is more cautious. A card or count
        faster on paper is never predicted slower than the request, a slower one never faster
        than its speed ratio says (issue: no faster card predicted slower without evidence)."""
        speed = self.config.gpu_types
        scale = (speed[asked_type].relative_speed / max(speed[gpu_type].relative_speed, 1e-9)
                 * min(asked_gpus, used) / max(min(gpus, used), 1))
        prior = asked_s * scale
        if scale <= 1.0:
            return min(max(model_s, prior), asked_s)
        return max(model_s, prior)

    def _expected_wait(self, gpu_type: str, gpus: int, free: Mapping[str, int]) -> float:
        if self.wait is not None:
            return self.wait(gpu_type, gpus)
        return 0.0 if free.get(gpu_type, 0) >= gpus else self.busy_wait_s

    def _in_time(self, c: Candidate, baseline: Candidate, limit_s: int | None) -> bool:
        """A change must not push the job past its own time limit (it would be killed): the predicted
        runtime with the margin newer jobs overran their predictions by (the bundle's runtime
        spread), at least ``scaling_factor``."""
        if limit_s is None or c == baseline:
            return True
        margin = max(self.config.policy.scaling_factor, math.exp(getattr(self.bundle, "runtime_spread", 0.0)))
        return c.pred_runtime_s * margin <= limit_s

    def _mem_gib(self, gtype: str | None) -> float:
        t = self.config.gpu_types.get(gtype or "")
        return t.memory_gib if t else 0.0

    def _enough(self, full: Candidate, table: list[Candidate]) -> Candidate | None:
        """The fewest GPUs of this type that fit and run within the scaling factor of ``full``."""
        limit = full.pred_runtime_s * self.config.policy.scaling_factor
        fewer = [c for c in table if c.gpu_type == full.gpu_type and c.fits and c.pred_runtime_s <= limit]
        return min(fewer, key=lambda c: c.gpus) if fewer else None

    def _score(self, c: Candidate, base: Candidate) -> float:
        """Lower is better, relative to the request as asked."""
        done = c.expected_wait_s + c.pred_runtime_s
        cost = c.pred_runtime_s * c.gpus * self.config.gpu_types[c.gpu_type].cost
        base_done = base.expected_wait_s + base.pred_runtime_s
        base_cost = base.pred_runtime_s * base.gpus * self.config.gpu_types[base.gpu_type].cost
        objective = self.config.policy.objective
        if objective == "fastest":
            return done / base_done
        if objective == "cheapest":
            return cost / base_cost if done <= base_done * self.config.policy.scaling_factor else math.inf
        return 0.5 * done / base_done + 0.5 * cost / base_cost


def make_decider(config: Config | None, model: Any = None, free_gpus: Callable[[], Mapping[str, int]] | None = None,
                 user: str | None = None, admits: Admits | None = None,
                 wait: Callable[[str, int], float] | None = None) -> Decider:
    """The configured decider; the model decider needs a loaded bundle (else: keep). ``admits``
    (when given) keeps both deciders from moving a job to a partition Slurm would refuse it in."""
    if config is None:
        return KeepDecider("no slurmgpu config installed; request kept")
    if config.policy.decider == "keep":
        return KeepDecider("policy.decider = keep")
    if config.policy.decider == "model" and model is not None:
        return ModelDecider(config, model, free_gpus or (lambda: {}), user, admits, wait)
    return RuleDecider(config, admits)
