"""Checks on an answer from ``slurmgpu serve`` before anything of it is applied.

The daemon is trusted infrastructure, but it is reached over a socket path an environment
variable can change, and a daemon with a bug (or a stale config) must not be able to send a job
to a GPU type the site does not have, ask for 100000 GPUs, or move it to a partition the config
never offers. gsbatch calls ``check_plan`` on the daemon's plan; the job_submit.lua hook mirrors
``check_decision`` (see templates/lua/job_submit.lua.j2). Each returns None when the answer may
be applied, else one line saying why not; the caller then leaves the request as written.

Standard library only: gsbatch's fast path imports this and, to read the submission as sbatch
will, the request reader; nothing of the decision code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.request import ComponentRequest, JobRequest, build_request, parse_gres
from slurmgpu.pipeline.sbatch_options import OptionError, split_options
from slurmgpu.pipeline.script import BatchScript, encode, parse_script
from slurmgpu.typing_lite import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

GPU_OPTIONS = ("gres", "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket")
REWRITABLE = ("partition", *GPU_OPTIONS)  # the options a rewrite may set
# ... and this one, only as a change's longer time limit says (a move to a slower card: policy.LIMIT_MARGIN)
TIME_OPTION = "time"
ENV_OF = {"SBATCH_PARTITION": "partition", "SBATCH_GRES": "gres", "SBATCH_GPUS": "gpus",
          "SBATCH_GPUS_PER_NODE": "gpus-per-node", "SBATCH_GPUS_PER_TASK": "gpus-per-task",
          "SBATCH_GPUS_PER_SOCKET": "gpus-per-socket", "SBATCH_TIMELIMIT": TIME_OPTION}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _component(original: Mapping[str, Any] | None, index: int) -> Mapping[str, Any]:
    comps = (original or {}).get("components")
    if isinstance(comps, list) and 0 <= index < len(comps) and isinstance(comps[index], dict):
        return comps[index]
    return original or {} if index == 0 else {}


def check_decision(decision: Any, config: Config, original: Mapping[str, Any] | None = None,
                   admits: Callable[[str], str | None] | None = None) -> str | None:
    """Why the decision's changes may not be applied, or None when they may.

    ``original`` is the request as read (``JobRequest.to_json()``: top level for the main
    component, ``components`` for each); ``admits`` says why Slurm would refuse the job in a
    partition (None when it would not). A change is applied only when its GPU type is in the
    config and in the partition the job ends up in, its count is a whole number within that
    partition's GPUs (per node for a one-node job), and a new partition is in the config and
    admits the job.
    """
    if not isinstance(decision, Mapping):
        return "the decision is not an object"
    changes = decision.get("changes", [])
    refused = decision.get("refused")
    if refused is not None and not isinstance(refused, str):
        return "'refused' is not a string"
    if not isinstance(changes, list):
        return "'changes' is not a list"
    for change in changes:
        if not isinstance(change, Mapping):
            return "a change is not an object"
        index, gtype, total, part = (change.get(k) for k in ("index", "gpu_type", "gpus_total", "partition"))
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return f"change index {index!r} is not a component"
        comp = _component(original, index)
        if gtype is not None and (not isinstance(gtype, str) or gtype not in config.gpu_types):
            return f"GPU type {gtype!r} is not in the slurmgpu config"
        if part is not None and (not isinstance(part, str) or part not in config.partitions):
            return f"partition {part!r} is not in the slurmgpu config"
        if total is not None and (not _is_count(total) or total < 1):
            return f"GPU count {total!r} is not a positive whole number"
        limit, written = change.get("time_limit_s"), comp.get("time_limit_s")
        if limit is not None and (not _is_count(limit) or limit % 60 or not _is_count(written) or limit <= written):
            return f"time limit {limit!r} s is not whole minutes longer than the job's {written!r}"
        if part is not None and admits is not None and (why := admits(part)):
            return f"partition {part} would not take the job: {why}"
        where = part or comp.get("partition") or config.default_partition
        names = [n for n in str(where or "").split(",") if n]
        known = [config.partitions[n] for n in names if n in config.partitions]
        if (gtype is not None or total is not None) and not known:
            return f"the job's partition {where or '(default)'} is not in the slurmgpu config"
        kind = gtype if gtype is not None else comp.get("gpu_type")
        if gtype is not None and not any(gtype in p.gpu_types for p in known):
            return f"GPU type {gtype} is not offered in partition {','.join(names)}"
        if part is not None and isinstance(kind, str) and kind in config.gpu_types \
                and kind not in config.partitions[part].gpu_types:
            return f"partition {part} does not offer the job's GPU type {kind}"
        if total is not None:
            fitting = [p for p in known if kind is None or kind in p.gpu_types] or known
            one_node = comp.get("nodes") in (None, 1) and comp.get("nodes_max") in (None, 1)
            limit = max(p.gpus_per_node if one_node else p.gpus_per_node * p.nodes for p in fitting)
            if total > limit:
                per = " per node" if one_node else ""
                return f"{total} GPUs exceed the {limit} partition {','.join(names)} has{per}"
    return None


def check_plan(plan: Any, config: Config, script_text: str | None, options: Sequence[str],
               admits: Callable[[str], str | None] | None = None,
               env: Mapping[str, str] | None = None) -> str | None:
    """Why gsbatch must not submit the daemon's plan for this script, these sbatch options and
    this environment (its ``SBATCH_*`` variables), or None when it may.

    The decision must pass ``check_decision`` against the request as read here, and the plan's
    record (by which the admin's modes and waivers are resolved) must give that request. The
    submitted script must equal the original but for directive lines that set a partition or GPU
    option, new directive lines and slurmgpu's provenance comment, all before the first command,
    from which on it is byte for byte the original. And what sbatch will read from the submission,
    read again with the request reader, must be the request as written in every option but
    partition and GPUs, and carry the decided partition, GPU type and count.
    """
    if not isinstance(plan, Mapping) or not isinstance(plan.get("submission"), Mapping):
        return "the plan has no submission"
    decision, sub = plan.get("decision"), plan["submission"]
    new_text, words, overrides = sub.get("script_text"), sub.get("cli_words"), sub.get("env_overrides", {})
    if not (new_text is None or isinstance(new_text, str)) or not isinstance(words, list) \
            or not all(isinstance(w, str) for w in words) or not isinstance(overrides, Mapping):
        return "the submission is malformed"
    env = dict(env or {})
    try:
        before = _read(script_text, options, env, config)
    except InputError as exc:
        return f"the request cannot be read ({exc})"
    read = before.to_json()
    if problem := check_decision(decision, config, read, admits):
        return problem
    record = plan.get("record")
    said = record.get("original_request") if isinstance(record, Mapping) else None
    if not isinstance(said, Mapping) or {**said, "script": None} != {**read, "script": None}:
        return "the plan's record does not give the request as written"  # mode and waivers go by it
    assert isinstance(decision, Mapping)
    changes = {c["index"]: c for c in decision.get("changes") or []}
    if not changes:
        if new_text != script_text or list(words) != list(options) or overrides or sub.get("changed"):
            return "the submission differs from the request though nothing was decided"
        return None
    for key, value in overrides.items():
        if key not in ENV_OF or not isinstance(value, str):
            return f"environment: {str(key)[:40]!r} may not be set"
    if (script_text is None) != (new_text is None):
        return "the submission adds or drops the script"
    if split_options(list(words))[1] != len(words):
        return "the command line holds a word that is not an option"
    try:
        after = _read(new_text, words, {**env, **overrides}, config)
    except (InputError, OptionError) as exc:
        return f"sbatch would refuse the submission ({exc})"
    if before.script is not None and after.script is not None \
            and (problem := _script_problem(before.script, after.script)):
        return problem
    return _request_problem(before, after, changes)


# The first words of each line of the comment pipeline/rewrite.py writes below the shebang.
PROVENANCE = "# slurmgpu: "
# Request fields a decision may change; every other field of to_json must stay as written.
DECIDED_FIELDS = ("gpu_type", "gpu_types", "gpus_total", "gpus_by_type", "gpus_per_node", "gpu_requests", "partition")


def _read(text: str | None, options: Sequence[str], env: Mapping[str, str], config: Config) -> JobRequest:
    """The request as sbatch will read it (InputError where it would refuse it)."""
    script = parse_script(encode(text), "<script>") if text is not None else None
    return build_request(script, options, env, config.gpu_features())


def _script_problem(old: BatchScript, new: BatchScript) -> str | None:
    """Why the submitted script differs from the original in more than the lines a rewrite writes."""
    old_lines, new_lines = old.text.split("\n"), new.text.split("\n")
    if old_lines[0] != new_lines[0]:
        return "the script's first line (#!) was changed"
    # the first command's index in the lines (past the end when there is none): head, then commands
    cut_old = (old.first_command_line or len(old_lines) + 1) - 1
    cut_new = (new.first_command_line or len(new_lines) + 1) - 1
    if old_lines[cut_old:] != new_lines[cut_new:]:
        return f"the script was changed from its first command (line {cut_old + 1}) on"
    rewritable = {d.line for d in old.directives if d.name in (*REWRITABLE, TIME_OPTION)}  # time: _request_problem
    directive_lines = {d.line for d in new.directives}
    head = [(j + 1, line) for j, line in enumerate(new_lines[:cut_new]) if not line.startswith(PROVENANCE)]
    # Walk the original's lines before the first command: each is in the submission, in order,
    # as written (past directive lines the rewrite added) or, where it set a partition or GPU
    # option, rewritten as a directive line.
    j = 0
    for i, line in enumerate(old_lines[:cut_old], 1):
        k = j
        while k < len(head) and head[k][1] != line and head[k][0] in directive_lines:
            k += 1
        if k < len(head) and head[k][1] == line:
            j = k + 1
        elif i in rewritable and j < len(head) and head[j][0] in directive_lines:
            j += 1
        else:
            return f"line {i} of the script was changed or removed, and it sets no partition or GPU option"
    if added := next((n for n, _ in head[j:] if n not in directive_lines), None):
        return f"line {added} of the submitted script is neither a directive nor slurmgpu's comment"
    return None


def _request_problem(before: JobRequest, after: JobRequest, changes: Mapping[int, Mapping[str, Any]]) -> str | None:
    """Why what sbatch will read differs from the request in anything but the decided partition,
    GPU type and count."""
    if len(after.components) != len(before.components):
        return f"the submission has {len(after.components)} job components, the request {len(before.components)}"
    if after.unknown_options != before.unknown_options:
        return f"the submission's unknown options {list(after.unknown_options)[:4]!r} are not the request's"
    for old, new in zip(before.components, after.components, strict=True):
        where = f"component {old.index}: " if before.is_hetjob else ""
        change = changes.get(old.index, {})
        limit = change.get("time_limit_s")
        if limit is not None and new.time_limit_s != limit:
            return f"{where}sbatch would read a time limit of {new.time_limit_s} s, the decision says {limit} s"
        decided = (*DECIDED_FIELDS, "time_limit_s") if limit is not None else DECIDED_FIELDS
        for name in sorted(set(old.options) | set(new.options)):
            was, now = (_value(c.options.get(name)) for c in (old, new))
            if name not in REWRITABLE and (name != TIME_OPTION or limit is None) and was != now:
                return f"{where}sbatch would read --{name} as {now}, the request says {was}"
        was_json, now_json = old.to_json(), new.to_json()
        if field := next((k for k in was_json if k not in decided and was_json[k] != now_json[k]), None):
            return f"{where}sbatch would read {field} as {now_json[field]!r}, the request says {was_json[field]!r}"
        want = change.get("partition") or old.partition
        if new.partition != want:
            return f"{where}sbatch would read partition {new.partition}, the decision says {want}"
        gtype, total = change.get("gpu_type"), change.get("gpus_total")
        types = {gtype} if gtype else set(old.gpus_by_type)
        total = total if total is not None else old.gpus_total
        if (gtype is None and change.get("gpus_total") is None and new.gpus_by_type != old.gpus_by_type) \
                or set(new.gpus_by_type) != types or new.gpus_total != total:
            return f"{where}sbatch would read GPUs {new.gpus_by_type}, the decision says {total} x {'/'.join(types)}"
        if not {g.option for g in new.gpus} <= ({g.option for g in old.gpus} or {"gres"}):
            return f"{where}the submission asks for GPUs through an option the request does not use"
        if _other_gres(new) != _other_gres(old):
            return f"{where}the submission's other GRES {_other_gres(new)} are not the request's {_other_gres(old)}"
    return None


def _value(option: Any) -> str:
    """An option's value as a message shows it ('unset' when the option is not given)."""
    return "unset" if option is None else repr(option.value)[:60] if option.value is not None else "set"


def _other_gres(comp: ComponentRequest) -> list[str]:
    gres = comp.options.get("gres")
    return sorted(parse_gres(gres.value)[1]) if gres is not None and gres.value else []
