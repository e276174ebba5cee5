"""The decision: which GPU type, how many, and in which partition a job should run.

Deciders share one small interface (``decide(request) -> Decision``) so the rule-based one
here and the learned one later are interchangeable. A decision is data: what to change, why,
and — when the request cannot be satisfied at all — why it is refused before submission.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from slurmgpu.config import Config
from slurmgpu.request import ComponentRequest, JobRequest


class ComponentChange(NamedTuple):
    """New values for one component; None means 'leave as the user wrote it'."""

    index: int
    gpu_type: str | None = None
    gpus_total: int | None = None
    partition: str | None = None


class Decision(NamedTuple):
    changes: tuple[ComponentChange, ...] = ()
    reasons: tuple[str, ...] = ()
    refusal: str | None = None
    decider: str = "keep"

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
        }


KEEP = Decision()


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

    def __init__(self, config: Config) -> None:
        self.config = config

    def decide(self, request: JobRequest) -> Decision:
        changes: list[ComponentChange] = []
        reasons: list[str] = []
        for comp in request.components:
            if not comp.gpus:
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
            target = offering[0]
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
        if new_type:
            reasons.append(f"{label}--constraint names {comp.gpu_type}, but an untyped GPU request may get "
                           f"any GPU type on a node with several; asked for {new_type} explicitly")
        if target or new_type:
            change = ComponentChange(comp.index, gpu_type=new_type, partition=target.name if target else None)
            return change, reasons, None
        return None, reasons, None


def make_decider(config: Config | None) -> Decider:
    if config is None:
        return KeepDecider("no slurmgpu config installed; request kept")
    if config.policy.decider == "keep":
        return KeepDecider("policy.decider = keep")
    return RuleDecider(config)
