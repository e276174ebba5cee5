"""The decision: which GPU type, how many, and in which partition a job should run.

Deciders share one small interface (``decide(request) -> Decision``) so the rule-based one
here and the learned one later are interchangeable. A decision is data: what to change, why,
and — when the request cannot be satisfied at all — why it is refused before submission.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

from slurmgpu.pipeline.candidates import (
    Candidate,
    CandidateTable,
    clear_gain,
    fewest_fitting,
    finite,
    in_time_limit,
    score,
    sooner_probability,
    usable,
)
from slurmgpu.pipeline.capacity import Capacity, need_of
from slurmgpu.pipeline.config import Config, GpuType, Partition
from slurmgpu.pipeline.evidence import FamilyEvidence
from slurmgpu.pipeline.memory_bound import borderline
from slurmgpu.pipeline.queue import Waits
from slurmgpu.pipeline.request import ComponentRequest, JobRequest, format_time

# What the gain in a reason measures, by objective (pipeline/candidates.py score): a percentage shown next
# to two finish times must not read as their ratio when the cost weighs in too.
GAIN_WORDS = {"fastest": "sooner", "cheapest": "cheaper in GPU cost",
              "balanced": "better, time to result and GPU cost weighed equally"}


class ComponentChange(NamedTuple):
    """New values for one component; None means 'leave as the user wrote it'."""

    index: int  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema
    gpu_type: str | None = None
    gpus_total: int | None = None
    partition: str | None = None
    # A longer time limit, for a move to a card the job is predicted to run slower on (LIMIT_MARGIN):
    # the one written would kill it there. Never shorter than written.
    time_limit_s: int | None = None


class Decision(NamedTuple):
    changes: tuple[ComponentChange, ...] = ()
    reasons: tuple[str, ...] = ()
    refusal: str | None = None
    decider: str = "keep"
    per_type: tuple[Candidate, ...] = ()
    # The user's own ask this decision carries out (``--gpu-mem 24 GiB``): advise mode and waivers
    # govern slurmgpu's own changes, never what the user asked for.
    asked: str | None = None
    # Why the request as written can never run (a GPU type its partition does not have): advice must
    # not compare the decision with a job that would never start.
    unrunnable: str | None = None

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def to_json(self) -> dict[str, Any]:
        out = {
            "decider": self.decider,
            "changed": self.changed,
            "refused": self.refusal,
            "changes": [c._asdict() for c in self.changes],
            "reasons": list(self.reasons),
            "per_type": [c._asdict() for c in self.per_type],
        }
        extra = {k: v for k, v in (("asked", self.asked), ("unrunnable", self.unrunnable)) if v}
        return {**out, **extra}


KEEP = Decision()
# A move made only because the request is predicted to run out of GPU memory, onto a card that holds it
# only with the margin doubted for a shape the family never ran (UNSEEN_PENALTY), and predicted to
# finish more than this many times as late as the request, goes instead to the soonest larger card
# that holds it with the plain ``memory_margin`` (the scenario, seed 4242 at load 0.6: jobs of a few
# minutes, predicted at 54 GiB, moved to the one 141 GiB type and waited there for days while the
# 80 GiB cards were free).
LATE_FIT = 10.0
# A request that only its bound's margin keeps off its card (the peak estimate itself fits there) stays
# as asked where every card that holds the bound would finish it more than this many times as late: an
# out-of-memory end costs minutes and a resubmission, the move the whole wait (the scenario, seed 4242
# at load 0.6: 8-GPU jobs estimated at 78.5 GiB, bounded at 97.8, on 80 GiB cards moved to the 16
# H200s with 300-600 h predicted waits, while the H100s they ran on as asked were free).
AS_ASKED_LATE = 2.0
# A move to a card the job is predicted to run slower on, that its time limit would not cover there,
# takes the limit the user wrote times the predicted slowdown times this margin (rounded up to whole
# minutes), where the partition's MaxTime admits it: the user's limit says how long the job may run
# on the card asked (users pad it), the slowdown is the model's comparison of the two cards for this
# job, better known than its runtime itself, and the margin covers that comparison's error. The
# scenario at load 0.9 (seed 7): mean JCT 2.89 h without raising limits (1.31x the oracle's; 177 jobs
# failed), 2.75 h with a margin of 1.25 but 195 failed (119 timeouts: the requests' 189), 2.83 h
# with 1.5 (178 failed), 2.90 h with 2.0 (172).
LIMIT_MARGIN = 1.5
# The rules' reason when they change nothing; not repeated beside a change the model makes (one
# reason per change).
FITS_AS_ASKED = "the request fits the partition it asks for"


# Whether Slurm would take this component in that partition: None when it would, else why not.
Admits = Callable[[str, ComponentRequest], "str | None"]
# The time limit (seconds) Slurm gives a job that writes none in that partition: its DefaultTime, else
# its MaxTime; None where unlimited or not known.
GivenLimit = Callable[[str], "int | None"]


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
    would only leave it pending forever or reject it with a less helpful message. With the live
    nodes (``capacity``), a move goes only where they can start the job, and a request no node
    set of its partition can start is kept as asked, saying why.
    """

    name = "rules"

    def __init__(self, config: Config, admits: Admits | None = None, capacity: Capacity | None = None) -> None:
        self.config, self.admits, self.capacity = config, admits, capacity

    def decide(self, request: JobRequest) -> Decision:
        changes: list[ComponentChange] = []
        reasons: list[str] = []
        unrunnable: list[str] = []
        for comp in request.components:
            if not comp.gpus_total:  # no GPU option, or only zero counts (Slurm skips those)
                continue
            change, why, refusal = self._component(comp, request.is_hetjob)
            if refusal:
                return Decision(reasons=tuple(reasons), refusal=refusal, decider=self.name)
            kept = change is None and bool(why) and why[-1].endswith("request kept")  # and said why already
            if not kept and (change is None or change.partition is None) and (live := self.unstartable(comp)):
                label = f"component {comp.index}: " if request.is_hetjob else ""
                change, why = None, [f"{label}kept as asked: {live}"]
            reasons.extend(why)
            if change:
                changes.append(change)
            if (gone := self._missing_type(comp, request.is_hetjob)) is not None:
                unrunnable.append(gone)
        if not reasons:
            reasons.append(FITS_AS_ASKED)
        return Decision(tuple(changes), tuple(reasons), decider=self.name, unrunnable="; ".join(unrunnable) or None)

    def cannot_start(self, partition: str, gpu_type: str | None, comp: ComponentRequest,
                     gpus: int | None = None) -> str | None:
        """Why the live nodes of PARTITION cannot start GPUS (the count asked when None) of GPU_TYPE
        with COMP's options; None when they can, or without a view of the nodes."""
        if self.capacity is None:
            return None
        return self.capacity.why_not(partition, gpu_type, need_of(comp, gpus or comp.gpus_total))

    def unstartable(self, comp: ComponentRequest) -> str | None:
        """Why no partition the component asks for can start it as written, by the live nodes; None
        when one can or nothing says (no node view, Slurm's own default partition). An untyped
        count is any GPUs of a node (Slurm mixes types; a --constraint picks nodes, not cards)."""
        cfg = self.config
        asked = comp.partitions or ([cfg.default_partition] if cfg.default_partition else [])
        if self.capacity is None or not asked or not comp.gpus_total:
            return None
        typed = comp.gpu_type if any(g.type for g in comp.gpus) else None
        whys = [self.cannot_start(p, typed, comp) for p in asked]
        return "; ".join(w for w in whys if w) if all(whys) else None

    def _missing_type(self, comp: ComponentRequest, het: bool) -> str | None:
        """Why Slurm can never start the component as written: its GPU type is in none of the
        partitions it names, all of them described by the config (else Slurm may know better)."""
        cfg = self.config
        asked = comp.partitions or ([cfg.default_partition] if cfg.default_partition else [])
        gtype = cfg.type_for_feature(comp.gpu_type) if comp.gpu_type and not any(g.type for g in comp.gpus) \
            else comp.gpu_type
        if not asked or not gtype or any(p not in cfg.partitions for p in asked) \
                or any(gtype in cfg.partitions[p].gpu_types for p in asked):
            return None
        label = f"component {comp.index}: " if het else ""
        return f"{label}GPU type {gtype} is not in partition {','.join(asked)}"

    def _component(self, comp: ComponentRequest, het: bool) -> tuple[ComponentChange | None, list[str], str | None]:
        label = f"component {comp.index}: " if het else ""
        cfg = self.config
        asked = comp.partitions or ([cfg.default_partition] if cfg.default_partition else [])
        known = [cfg.partitions[p] for p in asked if p in cfg.partitions]
        if len(known) < len(asked) or not known:
            # Slurm may start the job in a partition the config does not describe: nothing can be
            # refused or moved on what the config knows of the rest
            where = ",".join(p for p in asked if p not in cfg.partitions) or "(default)"
            return None, [f"{label}partition {where} is not in the slurmgpu config; request kept"], None
        from_constraint = not any(g.type for g in comp.gpus)
        gtype = cfg.type_for_feature(comp.gpu_type) if from_constraint and comp.gpu_type else comp.gpu_type
        target = None
        reasons: list[str] = []
        if gtype and not any(gtype in p.gpu_types for p in known):
            offering = cfg.partitions_with(gtype)
            if not offering:
                return None, [f"{label}no configured partition offers GPU type {gtype}; request kept"], None
            refused = {p.name: (self.admits(p.name, comp) if self.admits else None)
                       or self.cannot_start(p.name, gtype, comp) for p in offering}
            open_to_job = [p for p in offering if refused.get(p.name) is None]
            if not open_to_job:
                why = "; ".join(r for r in refused.values() if r)
                verb = "admits the job" if self.capacity is None else "admits the job and can start it"
                return None, [f"{label}GPU type {gtype} is not in partition {','.join(asked)}, and no partition "
                              f"offering it {verb} ({why}); request kept"], None
            target = open_to_job[0]
            if shared := _shared_in_hetjob(comp, ["partition"], het):
                return None, [f"{label}GPU type {gtype} is not in partition {','.join(asked)}, but {shared}; "
                              "request kept"], None
            reasons.append(f"{label}GPU type {gtype} is not in partition {','.join(asked)}; "
                           f"moved to {target.name}, which has it")
        check = [target] if target else [p for p in known if not gtype or gtype in p.gpu_types]
        per_node = comp.gpus_per_node if (comp.nodes_set or any(g.per != "job" for g in comp.gpus)) else None

        def room(p: Partition) -> int:
            """GPUs a node of P can give the request: gpus_per_node of its one type, or, untyped or of
            several types, of each type the partition has (a node may hold them all: Slurm mixes them)."""
            return p.gpus_per_node * (1 if gtype else max(len(p.gpu_types), 1))

        fits = [p for p in check if (per_node or 0) <= room(p) and comp.gpus_total <= room(p) * p.nodes]
        if not fits:
            p = check[0]
            of = f" ({p.gpus_per_node} of each of its types)" if room(p) != p.gpus_per_node else ""
            if per_node and per_node > room(p):
                return None, reasons, (f"{label}asks for {per_node} GPUs per node but partition {p.name} "
                                       f"has at most {room(p)} per node{of}")
            return None, reasons, (f"{label}asks for {comp.gpus_total} GPUs but partition {p.name} has "
                                   f"at most {room(p) * p.nodes} in all{of}")
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

    def __init__(self, config: Config, bundle: Any, free_gpus: Callable[[], Mapping[str, int]],
                 user: str | None = None, admits: Admits | None = None,
                 wait: Waits | None = None, capacity: Capacity | None = None,
                 given_limit: GivenLimit | None = None) -> None:
        """``given_limit``: the limit a job that writes none runs under in a partition (else such a
        job's moves are not held to any). ``wait(type, gpus, ...)``: expected seconds until that many
        GPUs of the type start the job (an array's tasks: their mean), from the queue
        (pipeline/queue.py); without it, idle GPUs now or an assumed wait (pipeline/candidates.py).
        ``capacity``: the live nodes, which keep a type, count or partition they cannot start out of
        the candidates."""
        self.config, self.bundle, self.free_gpus, self.user, self.admits = config, bundle, free_gpus, user, admits
        self.given_limit = given_limit
        self.rules = RuleDecider(config, admits, capacity)
        self.evidence = FamilyEvidence(config, bundle)  # what the family's history says beyond the models
        # the figures of each shape the job may run on: runtime, memory fit, wait
        self.candidates = CandidateTable(config, bundle, wait)

    def _keep(self, rule: Decision, why: str, per_type: tuple[Candidate, ...] = (), hint: str = "") -> Decision:
        """The rules' decision, with the model's reason WHY for adding nothing to it: "request kept"
        only where the rules changed nothing either (a note must not call a rewritten request kept)."""
        kept = "no further change" if rule.changes else "request kept"
        return rule._replace(reasons=(*rule.reasons, f"{why}; {kept}{hint}"), decider=self.name, per_type=per_type)

    def decide(self, request: JobRequest) -> Decision:
        from slurmgpu.pipeline.features import script_features
        from slurmgpu.pipeline.launch import request_launch_need

        rule = self.rules.decide(request)
        if rule.refusal:
            return rule
        comp = request.main
        if not request.is_hetjob and not rule.changes and self.rules.unstartable(comp):  # kept as asked, saying why
            return rule._replace(decider=self.name)
        if request.is_hetjob or not comp.gpus_total or request.script is None:
            return self._keep(rule, "model: heterogeneous, GPU-less or script-less job")
        if comp.constraint_gpu_types:
            return self._keep(rule, "model: the request pins its GPU type")
        if comp.rewrite_blocker:
            return self._keep(rule, f"model: {comp.rewrite_blocker}")
        sf = script_features(request.script.text)
        fam_n = self.bundle.history.family(sf["family"]).get("n", 0)
        policy = self.config.policy
        cfg = self.config.at_precision(sf["precision_bits"])  # its cards' speeds, as this job runs at them
        target = rule.changes[0].partition if rule.changes else None
        parts = [target] if target else (comp.partitions or [self.config.default_partition or ""])
        offered = [p for p in (self.config.partitions.get(n) for n in parts) if p]
        if len(offered) < len(parts) or not offered:  # a partition it cannot see may run the job
            return self._keep(rule, "model: partition unknown to the config")
        if policy.move_partitions and self.admits is not None:  # only where Slurm's rules are known
            offered += [p for p in self.config.partitions.values() if p not in offered]
        req_type, req_total = comp.gpu_type, comp.gpus_total
        # Fewer GPUs only as far as the launch follows (pipeline/launch.py); else only the type changes.
        need = request_launch_need(request).min_gpus
        # Or as far as the family's own runs on the asked count kept GPUs busy: the rest sat idle.
        busy = self.evidence.busy(sf, req_total) if need is None else None
        fewest = (busy[0] if busy else need) or req_total
        free = self.free_gpus() if self.candidates.wait is None else {}
        req = {**request.to_json(), "req_gpu_mem_gib": self.evidence.mem_gib(req_type)}
        shapes: list[tuple[GpuType, int]] = []
        slices = self.evidence.slices(request, sf, offered, need)
        for part in offered:
            for gtype in part.gpu_types:
                if gtype != req_type and not self.evidence.runs_there(sf, req_type, gtype):
                    continue
                if self.config.gpu_types[gtype].is_slice and gtype != req_type and gtype not in slices:
                    continue
                counts = range(min(fewest, req_total), min(req_total, part.gpus_per_node) + 1) \
                    if comp.nodes == 1 else [req_total]
                # only counts the user's unit can say: 3 GPUs over 2 tasks is no --gpus-per-task value,
                # and only shapes the partition's live nodes can start
                shapes.extend((self.config.gpu_types[gtype], c) for c in counts
                              if c % comp.multiplier(comp.gpus[0].per) == 0
                              and self.rules.cannot_start(part.name, gtype, comp, c) is None)
        seen = self.candidates.seen(sf["family"], req_type, req_total)
        table = self.candidates.build(sf, req, shapes, min(fewest, req_total), free, busy[0] if busy else None)
        if slices:
            table = self.candidates.on_slices(table, slices, req_type)
        # A row without a finite wait, runtime or peak has no finish time to compare: never a move (an
        # infinite wait: no node that large, or no end in sight), and a request whose own row it is stays.
        unbounded = [c for c in table if not finite(c)]
        table = [c for c in table if finite(c)]
        per_type = tuple(table)
        new_family = fam_n < policy.min_history

        def is_asked(c: Candidate) -> bool:
            return c.gpus == req_total and (req_type is None or c.gpu_type == req_type)

        too_new = f"model: {int(fam_n)} earlier jobs of this family (< {policy.min_history})"
        asked = [c for c in table if is_asked(c)]
        if not asked and (lost := next((c for c in unbounded if is_asked(c)), None)) is not None:
            return self._keep(rule, f"model: {_unbounded(lost)}", per_type)
        if new_family and (not asked or req_type is None):
            return self._keep(rule, too_new, per_type)
        if not asked:
            return self._keep(rule, "model: the requested type/count is outside the configured partitions",
                              per_type)
        baseline = min(asked, key=_done)
        effective = target or comp.partition or self.config.default_partition
        # Where each shape would run: the job's own partition when it has the type, else another
        # offered one, and only one whose Slurm rules admit the job (a move must not get it refused)
        # and whose live nodes can start it.
        open_parts = [p for p in offered if p.name == effective or self.admits is None
                      or self.admits(p.name, comp) is None]

        def home(c: Candidate) -> str | None:
            return next((p.name for p in open_parts if c.gpu_type in p.gpu_types
                         and self.rules.cannot_start(p.name, c.gpu_type, comp, c.gpus) is None), None)
        if new_family:
            # Its predictions are not trusted, but a card with at least the memory and the datasheet
            # speed of the one asked, as many of them, holds whatever the request holds and runs it
            # no slower: such a move needs no prediction of the job's own peak.
            asked_gt = cfg.gpu_types[req_type or ""]
            enough: list[Candidate | None] = [
                c for c in table if c.gpus == req_total and c.gpu_type != req_type
                and cfg.gpu_types[c.gpu_type].memory_gib >= asked_gt.memory_gib
                and cfg.gpu_types[c.gpu_type].relative_speed >= asked_gt.relative_speed]
        else:
            enough = [fewest_fitting(self.config, c, table) for c in table if c.fits and c.gpus == req_total]
        limits: dict[tuple[str, int], int] = {}  # shape -> the longer time limit its move takes

        def limit_of(c: Candidate) -> int | None:
            """The job's time limit where C would run: the one written, else the partition's given one."""
            part = home(c)
            if comp.time_limit_s or self.given_limit is None or part is None:
                return comp.time_limit_s
            return self.given_limit(part)

        def timely(c: Candidate) -> bool:
            """Whether C finishes within the job's time limit, or within a longer one (limits)."""
            if in_time_limit(cfg, self.bundle, c, baseline, limit_of(c)):
                return True
            longer = longer_limit(comp.time_limit_s, c, baseline) if policy.lengthen_time_limit else None
            part = home(c)
            if longer is None or part is None or self.admits is None or \
                    self.admits(part, comp._replace(time_limit_s=longer)) is not None or \
                    not in_time_limit(cfg, self.bundle, c, baseline, longer):
                return False
            limits[(c.gpu_type, c.gpus)] = longer
            return True
        in_time = [c for c in enough if c is not None and home(c) is not None and timely(c)]

        def rank(c: Candidate) -> float:
            """The candidate's score against the request as asked (lower is better)."""
            return score(self.config, c, baseline)

        def sure(c: Candidate | None) -> float | None:
            """Under ``fastest``, where the family measured both shapes: how likely C finishes sooner
            than the request, if at least ``confidence`` (such a move needs no ``min_gain``). Only
            onto cards of at least the asked one's memory and datasheet speed, with no longer a wait:
            the confidence is in the measured speed, not in the queue's estimate; a gain under
            ``min_gain`` is not worth the memory bound's own risk on a smaller card, nor the time
            limit's on a slower one (the scenario, seed 1 at load 0.6: mean JCT 2.41 h with this,
            2.75 h with confident moves onto slower cards)."""
            types = cfg.gpu_types
            if c is None or same_shape(c, baseline) or policy.objective != "fastest" or c.expected_wait_s > \
                    baseline.expected_wait_s or types[c.gpu_type].memory_gib < types[baseline.gpu_type].memory_gib \
                    or types[c.gpu_type].relative_speed < types[baseline.gpu_type].relative_speed:
                return None
            p = sooner_probability(c, baseline)
            return p if p is not None and p >= policy.confidence else None

        # a choice whose score is unbounded (cheapest: too slow to count) gains nothing
        choices = [c for c in in_time if (clear_gain(cfg, c, baseline) or sure(c))
                   and math.isfinite(rank(c))]
        risky = min((c for c in in_time if c not in choices), key=rank, default=None)
        best = prior_ranked(cfg, min(choices, key=rank, default=None), baseline, choices, rank)
        gain = 1.0 - rank(best) / rank(baseline) if best is not None else 0.0
        hint = ""  # what would make the request as asked fit (or how close it runs): part of the reason
        if new_family:
            if best is None or gain < policy.min_gain:
                return self._keep(rule, too_new, per_type)
        else:
            hint = self.candidates.memory.fit_hint(request, sf, req, baseline, table, seen, offered) \
                if not baseline.fits else borderline(baseline, self.config.gpu_types[baseline.gpu_type])
            if not baseline.fits:  # the job as asked would run out of GPU memory: any fitting choice wins
                gain = 1.0
        weak = best is None or (gain < policy.min_gain and sure(best) is None)  # a gain too small to move for
        freed = None  # GPUs the family's runs left idle, given back where the job finishes no later
        if busy and baseline.fits and weak:
            done = _done(baseline)
            freed = min((c for c in table if c.gpu_type == baseline.gpu_type and busy[0] <= c.gpus < req_total
                         and c.fits and _done(c) <= done and home(c) is not None),
                        key=lambda c: c.gpus,
                        default=None)
            best = freed or best
        if risky is not None and freed is None and \
                1.0 - rank(risky) / rank(baseline) >= policy.min_gain and (
                weak or same_shape(best, baseline)):
            # The move the prediction's error vetoed is why the request stands: say so, not "best".
            upper = risky.expected_wait_s + risky.pred_runtime_s * risky.runtime_margin
            return self._keep(rule, f"model: {risky.gpus} x {risky.gpu_type}, slower than as asked, is predicted to "
                              f"finish in {_done(risky) / 60:.0f} min but in "
                              f"{upper / 60:.0f} min at its upper runtime, vs "
                              f"{_done(baseline) / 60:.0f} min as asked: "
                              "a gain within the prediction's error", per_type, hint)
        if risky is not None and freed is None and rank(risky) < rank(baseline) and (
                best is None or same_shape(best, baseline)):
            # Predicted sooner, by less than min_gain, and not sure enough to move for: not "best as asked".
            return self._keep(rule, f"model: best choice gains {1.0 - rank(risky) / rank(baseline):.0%} "
                              f"(< {policy.min_gain:.0%})", per_type, hint)
        if best is None:
            return self._keep(rule, "model: no other candidate fits the predicted memory within the time limit",
                              per_type, hint)
        if freed is None and same_shape(best, baseline):
            return self._keep(rule, f"model: the request as asked is predicted best ({policy.objective})",
                              per_type, hint)
        if freed is None and weak:
            return self._keep(rule, f"model: best choice gains {gain:.0%} (< {policy.min_gain:.0%})", per_type, hint)
        late = ""  # the card that holds it with the doubted margin, where another is taken for being late
        if not new_family and not baseline.fits and freed is None and _done(best) > AS_ASKED_LATE * _done(baseline):
            types, plain = self.config.gpu_types, 1 + policy.memory_margin
            nearer = min((c for c in table if c.gpus == best.gpus and c.margin > policy.memory_margin
                          and types[c.gpu_type].memory_gib > types[baseline.gpu_type].memory_gib
                          and c.pred_peak_mem_mib * plain <= types[c.gpu_type].memory_gib * 1024
                          and _done(c) < _done(best) and home(c) is not None
                          and in_time_limit(cfg, self.bundle, c, baseline, limit_of(c))),
                         key=_done, default=None) if _done(best) > LATE_FIT * _done(baseline) else None
            if nearer is not None:
                late = (f"; {best.gpus} x {best.gpu_type}, which holds it with the {best.margin:.0%} margin, is "
                        f"predicted to finish in {_done(best) / 60:.0f} min, more than {LATE_FIT:g}x the "
                        f"{_done(baseline) / 60:.0f} min as asked: {nearer.gpu_type} (never run by this family) "
                        f"holds it with the {policy.memory_margin:.0%} margin of a shape it ran, in "
                        f"{_done(nearer) / 60:.0f} min")
                best = nearer._replace(fits=True, margin=policy.memory_margin)
                per_type = tuple(best if same_shape(c, best) else c for c in per_type)  # the row as judged
            elif _done(soonest := min(in_time, key=_done, default=best)) > AS_ASKED_LATE * _done(baseline) and \
                    (estimate := self.candidates.memory.estimate_mib(sf, req, types[baseline.gpu_type],
                                                                     baseline.gpus)) \
                    <= types[baseline.gpu_type].memory_gib * 1024:
                # Only the bound's margin keeps the request off its card, and every card that holds the bound
                # is far later: the user's own choice stands (an out-of-memory run ends in minutes).
                return self._keep(rule, f"model: {baseline.gpus} x {baseline.gpu_type} as asked holds the estimated "
                                  f"peak of {estimate / 1024:.1f} GiB per GPU but not its bound of "
                                  f"{baseline.pred_peak_mem_mib / 1024:.1f} GiB (with the "
                                  f"{baseline.margin:.0%} margin); {soonest.gpus} x {soonest.gpu_type}, the soonest "
                                  f"that holds the bound, is predicted to finish in {_done(soonest) / 60:.0f} min, "
                                  f"more than {AS_ASKED_LATE:g}x the {_done(baseline) / 60:.0f} min as asked",
                                  per_type, hint)
        partition = home(best)
        change = ComponentChange(0, gpu_type=best.gpu_type if best.gpu_type != req_type else None,
                                 gpus_total=best.gpus if best.gpus != req_total else None,
                                 partition=partition if (target or partition != effective) else None,
                                 time_limit_s=limits.get((best.gpu_type, best.gpus)))
        times = f"predicted to finish in {_done(best) / 60:.0f} min vs {_done(baseline) / 60:.0f} min as asked"
        finish = f"{times} ({gain:.0%} {GAIN_WORDS[policy.objective]})"
        if gain < policy.min_gain and (p := sure(best)) is not None:
            finish += (f", {p:.0%} likely sooner by this family's runs on both (a gain under {policy.min_gain:.0%} "
                       f"taken at {policy.confidence:.0%} confidence)")
        if freed:
            why = f"model: {best.gpus} x {best.gpu_type} of the {req_total} asked, {times}"
        elif new_family:
            asked_gt, best_gt = cfg.gpu_types[baseline.gpu_type], cfg.gpu_types[best.gpu_type]
            why = (f"{too_new}: only a card at least as large and fast as asked; {best.gpus} x {best.gpu_type} "
                   f"({best_gt.memory_gib:g} GiB, speed {best_gt.relative_speed:g} vs {asked_gt.memory_gib:g} GiB, "
                   f"{asked_gt.relative_speed:g}) {finish}")
        elif not baseline.fits:
            why = (f"model: predicted peak {baseline.pred_peak_mem_mib / 1024:.1f} GiB per GPU does not fit "
                   f"{baseline.gpu_type} (with the {baseline.margin:.0%} margin); {best.gpus} x {best.gpu_type}: "
                   f"{self.candidates.memory.fit_words(best, sf, req_total)} ({best.margin:.0%} margin){late}{hint}")
        else:
            why = (f"model ({self.config.policy.objective}): {best.gpus} x {best.gpu_type} {finish}, "
                   f"{self.candidates.memory.fit_words(best, sf, req_total)}"
                   f"{borderline(best, self.config.gpu_types[best.gpu_type])}")
        if busy and best.gpus < req_total:
            why += f"; this family's {busy[1]} runs on {req_total} GPUs kept at most {busy[0]} busy"
        if best.gpu_type in slices:
            why += f"; {slices[best.gpu_type]}"
        if change.time_limit_s is not None and comp.time_limit_s:
            why += (f"; time limit {format_time(comp.time_limit_s)} -> {format_time(change.time_limit_s)}: the limit "
                    f"written x {best.pred_runtime_s / baseline.pred_runtime_s:.2f} (predicted {best.gpus} x "
                    f"{best.gpu_type} runtime {best.pred_runtime_s / 60:.1f} min over "
                    f"{baseline.pred_runtime_s / 60:.1f} min as asked) x {LIMIT_MARGIN:g}, rounded up to a minute")
        return Decision((change,), (*self._rule_reasons(rule), why), decider=self.name, per_type=per_type,
                        unrunnable=rule.unrunnable)

    @staticmethod
    def _rule_reasons(rule: Decision) -> tuple[str, ...]:
        """The rules' reasons that go with a change the model makes: their own changes' reasons."""
        return tuple(r for r in rule.reasons if r != FITS_AS_ASKED)


def longer_limit(limit_s: int | None, c: Candidate, baseline: Candidate) -> int | None:
    """The time limit a move to C may take (LIMIT_MARGIN), in whole minutes; None where the job wrote
    none or it would be no longer than the one written."""
    if not limit_s or not baseline.pred_runtime_s > 0 or not math.isfinite(c.pred_runtime_s):
        return None
    longer = math.ceil(limit_s * c.pred_runtime_s / baseline.pred_runtime_s * LIMIT_MARGIN / 60) * 60
    return longer if longer > limit_s else None


def _done(c: Candidate) -> float:
    """Predicted seconds to result: the wait and the runtime."""
    return c.expected_wait_s + c.pred_runtime_s


def same_shape(a: Candidate | None, b: Candidate) -> bool:
    """Whether A is B's GPU type and count (a row of the table is one shape)."""
    return a is not None and (a.gpu_type, a.gpus) == (b.gpu_type, b.gpus)


def prior_ranked(config: Config, best: Candidate | None, baseline: Candidate, choices: list[Candidate],
                 rank: Callable[[Candidate], float]) -> Candidate | None:
    """Between moves, the hardware prior decides unless the estimate parts them: under ``fastest`` a
    datasheet-faster type of the same count replaces BEST when BEST's score is not at least
    ``min_gain`` better than its (the fastest such). Where work is hidden from the script two types'
    estimates a few percent apart say nothing of which is faster: in the decision benchmark the
    estimate put a K80 job on a P100 0.5% ahead of a V100 measured 1.7 times faster. Where the family
    measured both against the request and BEST is ``confidence`` likely the sooner, it stays. The
    request itself is no such alternative (a move must gain on its own against it), nor, when best,
    replaced."""
    if best is None or config.policy.objective != "fastest" or same_shape(best, baseline):
        return best
    speed = config.gpu_types[best.gpu_type].relative_speed
    close = [c for c in choices if not same_shape(c, baseline) and c.gpus == best.gpus
             and config.gpu_types[c.gpu_type].relative_speed > speed
             and rank(best) > (1.0 - config.policy.min_gain) * rank(c)
             and not (c.ratio_sd is not None and (sooner_probability(best, c) or 0.0) >= config.policy.confidence)]
    return max(close, key=lambda c: config.gpu_types[c.gpu_type].relative_speed, default=best)


def _unbounded(c: Candidate) -> str:
    """Why the request as asked has no finish time to compare with, in words without the figure."""
    shape = f"{c.gpus} x {c.gpu_type}"
    if not usable(c.expected_wait_s):
        return (f"the queue view sees no time {shape} starts (no node holds that many, or jobs without a time "
                "limit hold them)")
    if not usable(c.pred_peak_mem_mib, math.inf):
        return f"no usable peak memory predicted for {shape} as asked"
    return f"no usable runtime predicted for {shape} as asked"


def make_decider(config: Config | None, model: Any = None, free_gpus: Callable[[], Mapping[str, int]] | None = None,
                 user: str | None = None, admits: Admits | None = None,
                 wait: Waits | None = None, capacity: Capacity | None = None,
                 given_limit: GivenLimit | None = None) -> Decider:
    """The configured decider; the model decider needs a loaded bundle (else: keep). ``admits``
    (when given) keeps both deciders from moving a job to a partition Slurm would refuse it in,
    ``capacity`` (the live nodes) from choosing what no node there can start."""
    if config is None:
        return KeepDecider("no slurmgpu config installed; request kept")
    if config.policy.decider == "keep":
        return KeepDecider("policy.decider = keep")
    if config.policy.decider == "model" and model is not None:
        return ModelDecider(config, model, free_gpus or (lambda: {}), user, admits, wait, capacity, given_limit)
    return RuleDecider(config, admits, capacity)
