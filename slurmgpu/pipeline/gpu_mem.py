"""``--gpu-mem``: a GPU type with at least this much memory per GPU, chosen by the policy's objective.

The user's own ask, so it is never dropped: met in the job's partition, else in another that has
such a type and admits the job, else refused with a line naming the option. The decider's other
changes do not apply (a model cannot move the job to a smaller card); a model decider only adds
its predicted peak to the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

from slurmgpu.pipeline.candidates import usable
from slurmgpu.pipeline.config import Config, GpuType, Partition
from slurmgpu.pipeline.policy import Admits, ComponentChange, Decider, Decision, ModelDecider, RuleDecider
from slurmgpu.pipeline.request import JobRequest

# A partition's GPUs as Slurm's nodes hold them: type -> (most on one node, all in the partition);
# None when Slurm cannot say. For a partition the admin config does not describe.
PartitionGpus = Callable[[str], "Mapping[str, tuple[int, int]] | None"]


class GpuMemAsk(NamedTuple):
    """``--gpu-mem``: at least this much memory per GPU, as the user spelled it and where."""

    gib: float
    spelled: str
    where: str  # "command line" or "FILE:LINE"

    @property
    def shown(self) -> str:
        """The size in GiB as shown: two decimals at most, the figure compared is ``gib`` itself."""
        return f"{self.gib:.2f}".rstrip("0").rstrip(".")

    @property
    def label(self) -> str:
        """``--gpu-mem 24 GiB``, with the user's spelling when it was not in G (``24000M``)."""
        plain = self.spelled.strip().upper().removesuffix("B").removesuffix("I") == f"{self.shown}G"
        return f"--gpu-mem {self.shown} GiB" + ("" if plain else f" ({self.spelled.strip()})")

    def refusal(self, why: str) -> str:
        """Why the ask cannot be met, led by where it was made (``command line: --gpu-mem ...``)."""
        return f"{self.where}: {self.label}: {why}"


def _gib(value: float) -> str:
    return f"{value:g} GiB"


def decide_gpu_mem(decider: Decider, request: JobRequest, ask: GpuMemAsk, config: Config | None = None,
                   live: PartitionGpus | None = None) -> Decision:
    """``--gpu-mem``: a typed request for a GPU type with at least ``ask.gib`` per GPU, chosen by
    the policy's objective among the job's partition's types, else in another configured partition
    that has one and admits the job (the decider's ``admits``, where it has one). The count stays
    as asked (1 GPU when the job asks for none); the decider's other changes do not apply, so a
    model cannot move the job to a smaller card. A model decider adds its predicted peak to the
    reason. No such type anywhere, or a request that cannot carry it, is a refusal naming the option.
    A decider without a config of its own (``decider = "keep"``, a model that cannot be used) reads
    the site's CONFIG; with none at all the ask cannot be met and is refused: the user's own ask is
    never dropped. ``live``: what Slurm's nodes hold in a partition the config does not describe, so a
    partition the user named is kept when its cards hold the ask."""
    own = getattr(decider, "config", None)
    config = own if isinstance(own, Config) else config
    name = getattr(decider, "name", "keep")
    if not isinstance(config, Config):
        why = "; ".join(r.removesuffix("; request kept") for r in decider.decide(request).reasons)
        return Decision(refusal=ask.refusal(f"cannot be met without a usable slurmgpu config ({why or 'none'}); "
                                            "nothing submitted"), decider=name)
    decision = _gpu_mem(decider, config, request, ask, live)
    return decision if decision.refusal else decision._replace(asked=ask.label)


def _gpu_mem(decider: Decider, config: Config, request: JobRequest, ask: GpuMemAsk,
             live: PartitionGpus | None = None) -> Decision:
    """decide_gpu_mem with the config to decide by."""
    name = getattr(decider, "name", "keep")
    label, comp = ask.label, request.main
    admits: Admits | None = getattr(decider, "admits", None)

    def refuse(why: str) -> Decision:
        return Decision(refusal=ask.refusal(why), decider=name)

    if request.is_hetjob:
        return refuse("not for heterogeneous jobs; write the GPU type in each component")
    if comp.rewrite_blocker:
        return refuse(f"the GPU request cannot be rewritten ({comp.rewrite_blocker})")
    if request.script is not None and config.by_precision:  # the cards' speeds as this job runs at them
        from slurmgpu.pipeline.features import script_features
        config = config.at_precision(script_features(request.script.text)["precision_bits"])
    types = config.gpu_types
    largest = max(types.values(), key=lambda t: t.memory_gib)
    if largest.memory_gib < ask.gib:
        return refuse(f"no configured GPU type has that much memory per GPU (largest: {largest.name}, "
                      f"{_gib(largest.memory_gib)})")
    pinned = [t for t in (config.type_for_feature(f) for f in comp.constraint_gpu_types) if t]
    current = comp.gpu_type if comp.gpu_type in types else None
    if current is None and comp.gpu_type:
        current = config.type_for_feature(comp.gpu_type)
    if current and types[current].memory_gib >= ask.gib:
        pool = [current]  # the type asked for already holds it: it stays
    elif pinned:
        pool = [t for t in dict.fromkeys(pinned) if types[t].memory_gib >= ask.gib]
        if not pool:
            return refuse(f"--constraint pins {', '.join(f'{t} ({_gib(types[t].memory_gib)})' for t in pinned)}")
    else:
        pool = [t for t in types if types[t].memory_gib >= ask.gib]
    count = comp.gpus_total or 1
    if count > 1:  # a MIG instance is one process's device: a multi-GPU job needs whole cards
        pool = [t for t in pool if not types[t].is_slice]
        if not pool:
            return refuse(f"only MIG slices hold it, and a slice cannot be one of {count} GPUs of a job")
    per_node = comp.gpus_per_node if comp.gpus and (comp.nodes_set or any(g.per != "job" for g in comp.gpus)) \
        else (1 if not comp.gpus else None)

    def room(p: Partition) -> bool:
        return (per_node or 0) <= p.gpus_per_node and count <= p.gpus_per_node * p.nodes

    rules = getattr(decider, "rules", decider)
    cannot = rules.cannot_start if isinstance(rules, RuleDecider) else None

    def startable(p: Partition) -> list[str]:
        """The pool's types P offers that its live nodes (where the decider knows them) can start."""
        return [t for t in p.gpu_types if t in pool and (cannot is None or cannot(p.name, t, comp, count) is None)]

    asked = comp.partitions or ([config.default_partition] if config.default_partition else [])
    known = [config.partitions[p] for p in asked if p in config.partitions]
    own = list(dict.fromkeys(t for p in known if room(p) for t in startable(p)))
    # the config's types that hold the ask but no live node of the partition can start
    idle = "" if own or not any(t in pool for p in known if room(p) for t in p.gpu_types) else " its nodes can start"
    target: Partition | None = None
    moved = ""
    if not own and not known and live is not None:  # a partition the config does not describe: Slurm's nodes
        held = [(p, live(p) or {}) for p in asked]
        own = list(dict.fromkeys(t for _, gpus in held for t, (most, total) in gpus.items()
                                 if t in pool and (per_node or 0) <= most and count <= total))
        where = ",".join(asked)
        moved = f"; partition {where} (not in the slurmgpu config) has it on Slurm's nodes" if own else ""
    if own:
        choice = _by_objective(own, types, config.policy.objective)
    else:
        others = [p for p in config.partitions.values() if p not in known and room(p) and startable(p)]
        refused = {p.name: admits(p.name, comp) for p in others} if admits else {}
        open_to_job = [p for p in others if refused.get(p.name) is None]
        where = ",".join(asked) or "(default)"
        if not open_to_job:
            why = "; ".join(f"{n}: {r}" for n, r in refused.items() if r)
            return refuse(f"partition {where} has no GPU type with that much memory{idle}"
                          + (f" and no partition that has one admits the job ({why})" if why else
                             " for this request, nor does any other configured partition"))
        choice = _by_objective(list(dict.fromkeys(t for p in open_to_job for t in startable(p))), types,
                               config.policy.objective)
        target = next(p for p in open_to_job if choice in startable(p))
        moved = (f"; partition {where} is not in the slurmgpu config" if not known else
                 f"; partition {where} has none that large{idle}") + f", moved to {target.name}, which has {choice}"
    small = list(dict.fromkeys(t for p in known for t in p.gpu_types if types[t].memory_gib < ask.gib))
    if current and current in small and current not in pool:
        small = [current, *(t for t in small if t != current)]
    too_small = "".join(f"{t} has {_gib(types[t].memory_gib)}, " for t in small)
    if choice == current and target is None:
        why = f"{label}: the requested {choice} has {_gib(types[choice].memory_gib)}; request kept"
    elif choice == current:
        why = f"{label}: the requested {choice} has {_gib(types[choice].memory_gib)}{moved}"
    else:
        rule = {"balanced": "the smallest card that holds it"}.get(config.policy.objective)
        why = (f"{label}: {too_small}{choice} ({_gib(types[choice].memory_gib)}) chosen "
               f"({config.policy.objective}{': ' + rule if rule else ''}){moved}")
    if not comp.gpus:
        why += f"; the job asked for no GPU: {count} x {choice} added"
    predicted = decider.evidence.peak_mib(request, choice, count) if isinstance(decider, ModelDecider) else None
    if predicted is not None and usable(predicted, math.inf):
        why += f"; asked for >= {ask.shown} GiB per GPU; predicted peak {predicted / 1024:.1f} GiB"
    if choice == current and target is None:
        return Decision(reasons=(why,), decider=name)
    change = ComponentChange(comp.index, gpu_type=choice if choice != current or not comp.gpus else None,
                             gpus_total=count if not comp.gpus else None,
                             partition=target.name if target else None)
    return Decision((change,), (why,), decider=name)


def _by_objective(names: list[str], types: Mapping[str, GpuType], objective: str) -> str:
    """Without a prediction for the job, a type by the hardware figures alone: ``fastest`` the
    highest relative speed, ``cheapest`` the least cost for the same work (cost / speed),
    ``balanced`` the smallest card that holds the request. Ties go to the smaller card."""
    def key(n: str) -> tuple[float, ...]:
        t = types[n]
        work_cost = t.cost / max(t.relative_speed, 1e-9)
        if objective == "fastest":
            return (-t.relative_speed, t.memory_gib, work_cost)
        if objective == "cheapest":
            return (work_cost, t.memory_gib)
        return (t.memory_gib, work_cost)
    return min(names, key=key)
