"""One submission's plan: the request as sbatch reads it, the decision, and the rewrite.

gsbatch makes it in its own process, or ``slurmgpu serve`` makes it for gsbatch when the daemon
answers (templates and model already loaded there). Both call ``make_plan`` and hand gsbatch
the same JSON form (``Plan.to_json``), so what is submitted cannot depend on where it was made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, NamedTuple

from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.gpu_mem import GpuMemAsk, PartitionGpus, decide_gpu_mem
from slurmgpu.pipeline.policy import Decider, Decision, KeepDecider
from slurmgpu.pipeline.request import COMMAND_LINE, JobRequest, build_request
from slurmgpu.pipeline.rewrite import RewriteError, Submission, apply
from slurmgpu.pipeline.script import UNKNOWN_GS, BatchScript, parse_gpu_mem

if TYPE_CHECKING:
    from slurmgpu.pipeline.config import Config


class Plan(NamedTuple):
    """What to submit, and what to tell the user about it."""

    request: JobRequest | None
    decision: Decision
    submission: Submission
    stdin: bytes | None = None
    tag: str | None = None  # the model's decision tag; its id goes into the record, which names the job
    unread: str | None = None  # why the script was not read (it goes as written)

    def to_json(self) -> dict[str, Any]:
        """Everything gsbatch needs to report, submit and record the plan."""
        sub = self.submission
        return {"decision": self.decision.to_json(),
                "submission": {"script_text": sub.script_text, "cli_words": list(sub.cli_words),
                               "env_overrides": dict(sub.env_overrides), "changed": sub.changed},
                "record": record_fields(self), "notes": notes(self), "warnings": warnings(self), "tag": self.tag}


def make_plan(script: BatchScript | None, options: Sequence[str], env: Mapping[str, str], decider: Decider,
              gpu_features: Set[str], no_rewrite: bool = False, gpu_mem: str | None = None,
              config: Config | None = None, live: PartitionGpus | None = None) -> Plan:
    """Read the request as sbatch will, decide, rewrite; raises InputError for bad user input.
    ``gpu_mem``: gsbatch's ``--gpu-mem`` from the command line, which wins over the script's;
    ``config``: the site's, which a ``--gpu-mem`` is met by when the decider has none of its own;
    ``live``: the GPUs Slurm's nodes hold in a partition the config does not describe."""
    request = build_request(script, options, env, gpu_features)
    ask = gpu_mem_ask(script, gpu_mem)
    # Over the budget the decider reads the request alone, as for a job without a script.
    read = request._replace(script=None) if over_budget(script) else request
    if no_rewrite or (script is not None and script.keep_marker):
        why = "--no-rewrite given; request kept" if no_rewrite or script is None else script.keep_reason
        decision = KeepDecider(why).decide(request)
        if ask is not None:  # two asks of the user's that cannot both be met: neither is dropped silently
            opt_out = "--no-rewrite" if no_rewrite or script is None else f"'{script.keep_spelled}'"
            decision = Decision(refusal=ask.refusal(f"cannot be applied: {opt_out} keeps the request as "
                                                    "written; drop one of them"), decider=decision.decider)
    elif ask is not None:
        decision = decide_gpu_mem(decider, read, ask, config, live)
    else:
        decision = decider.decide(read)
    try:
        submission = apply(request, decision)
    except RewriteError as exc:
        if ask is None:
            raise  # the model's or the rules' own change: the job goes as written, with a warning
        # the user asked for this memory: submitted without it, the job could land on a smaller card
        decision = Decision(refusal=ask.refusal(f"the GPU request cannot be rewritten ({exc})"),
                            decider=decision.decider)
        submission = apply(request, decision)
    return Plan(request, decision, submission, tag=_tag(request, decision))


def unread_plan(why: str, text: str, options: Sequence[str]) -> Plan:
    """The job as written, for a script gsbatch does not read (``script.Unread``): nothing is
    decided, and one note says why."""
    return Plan(None, Decision(reasons=(f"{why}: request kept",)), Submission(text, list(options)),
                unread=f"{why}: not read, submitted as written")


def _tag(request: JobRequest, decision: Decision) -> str | None:
    """The decision tag (``pipeline.decision_tag``) of the model's decisions: its id goes into the record,
    which names the job; the job's Comment stays the user's."""
    from slurmgpu.pipeline.decision_tag import decision_tag, new_decision_id

    if decision.decider != "model":
        return None
    main = request.main
    return decision_tag(decision.to_json(), new_decision_id(), main.gpu_type, main.gpus_total)


def gpu_mem_ask(script: BatchScript | None, cli: str | None) -> GpuMemAsk | None:
    """``--gpu-mem`` as asked: the command line's, else the script's ``#GSBATCH`` line's; a size
    that cannot be read is an InputError naming the option (and the line, in the script)."""
    if cli is not None:
        try:
            return GpuMemAsk(parse_gpu_mem(cli), cli, COMMAND_LINE)
        except InputError as exc:
            raise exc.located(file=COMMAND_LINE) from None
    if script is None or script.gpu_mem is None:
        return None
    value, line = script.gpu_mem
    try:
        return GpuMemAsk(parse_gpu_mem(value), value, f"{script.path}:{line}")
    except InputError as exc:
        raise exc.located(file=script.path, line=line) from None


# The most characters of commands (the script after its directives) a decision reads. Reading is
# linear, but not free: Slurm takes a 4 MB script in 40 ms, and reading one took gsbatch seconds.
# Past it the decision rests on the directives alone; they end at the first command, so every one
# sbatch reads is still read (the request is the same).
READ_BUDGET = 64 * 1024


def commands_size(script: BatchScript) -> int:
    """Characters from the script's first command line to its end (0 without commands)."""
    first = script.first_command_line
    return 0 if first is None else len(script.text) - script.line_starts[first - 1]


def over_budget(script: BatchScript | None) -> bool:
    return script is not None and commands_size(script) > READ_BUDGET


def budget_note(script: BatchScript) -> str:
    return (f"{script.path}: its commands are {commands_size(script) / 1024:.0f} KiB, more than gsbatch reads "
            f"({READ_BUDGET // 1024} KiB): decided from its #SBATCH directives alone")


LEGACY_KEEP_NOTE = ("'#SLURMGPU keep' is deprecated: plain sbatch refuses a script with it (\"Change from #SLURM "
                    "to #SBATCH\"); write '#GSBATCH --no-rewrite' instead, which sbatch ignores")


def notes(plan: Plan) -> list[str]:
    """What the user should hear about the script itself, one line each."""
    script = plan.request.script if plan.request else None
    said = [LEGACY_KEEP_NOTE] if script is not None and script.legacy_keep else []
    said += [plan.unread] if plan.unread else []
    return said + ([budget_note(script)] if script is not None and over_budget(script) else [])


def warnings(plan: Plan) -> list[str]:
    """What the user must hear though the job goes: a #GSBATCH option gsbatch does not know (a typo
    of --gpu-mem would otherwise leave the job without the memory asked, unsaid)."""
    script = plan.request.script if plan.request else None
    if script is None:
        return []
    return [f"{script.path}:{d.line}: {d.reason}; the line is ignored"
            for d in script.ignored if d.reason.startswith(UNKNOWN_GS)]


def record_fields(plan: Plan) -> dict[str, Any]:
    """What the submission record says of the plan: the script's hash and features (the
    learner's input), the request as read, and the decision."""
    from slurmgpu.pipeline.features import hexdigest, script_features

    script = plan.request.script if plan.request else None
    features = None
    if script is not None and not over_budget(script):  # over it, the record goes without, as the decider did
        try:
            features = script_features(script.text)  # read once: the decider's, when it read them
        except ValueError:  # e.g. a byte that is not UTF-8 in the command: the record goes without
            features = None
    return {"script_sha256": hexdigest("sha256", script.data) if script else None,
            "script_features": features,
            "original_request": plan.request.to_json() if plan.request else None,
            "decision": {**plan.decision.to_json(), **_tag_id(plan.tag)}, "changed": plan.submission.changed}


def _tag_id(tag: str | None) -> dict[str, str]:
    from slurmgpu.pipeline.decision_tag import parse_tag

    fields = parse_tag(tag)
    return {"id": fields["d"]} if fields else {}
