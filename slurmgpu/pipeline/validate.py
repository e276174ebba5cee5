"""Checks on an answer from ``slurmgpu serve`` before anything of it is applied.

The daemon is trusted infrastructure, but it is reached over a socket path an environment
variable can change, and a daemon with a bug (or a stale config) must not be able to send a job
to a GPU type the site does not have, ask for 100000 GPUs, or move it to a partition the config
never offers. gsbatch calls ``check_plan`` on the daemon's plan; the job_submit.lua hook mirrors
``check_decision`` (see templates/lua/job_submit.lua.j2). Each returns None when the answer may
be applied, else one line saying why not; the caller then leaves the request as written.

Standard library only: gsbatch's fast path imports this and nothing of the decision code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slurmgpu.pipeline.config import Config

GPU_OPTIONS = ("gres", "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket")
REWRITABLE = ("partition", *GPU_OPTIONS)  # the only options a rewrite may set
ENV_OF = {"SBATCH_PARTITION": "partition", "SBATCH_GRES": "gres", "SBATCH_GPUS": "gpus",
          "SBATCH_GPUS_PER_NODE": "gpus-per-node", "SBATCH_GPUS_PER_TASK": "gpus-per-task",
          "SBATCH_GPUS_PER_SOCKET": "gpus-per-socket"}
_SHORT = {"-p": "partition", "-G": "gpus"}


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


def _token_problem(token: str, allowed: Mapping[str, Sequence[str]], config: Config, max_total: int) -> str | None:
    """A ``--name=value`` word a rewrite may have written: why it may not, or None."""
    name, eq, value = token.removeprefix("--").partition("=")
    if not token.startswith("--") or not eq or name not in REWRITABLE:
        return f"unexpected option {token[:60]!r}"
    return _value_problem(name, value.strip("'\""), allowed, config, max_total)


def _value_problem(name: str, value: str, allowed: Mapping[str, Sequence[str]], config: Config,
                   max_total: int) -> str | None:
    if name == "partition":
        return None if value in allowed["partition"] else f"partition {value!r} is not the decided one"
    for entry in value.split(","):
        words = entry.split(":")
        if name == "gres" and words[0] != "gpu":
            if entry not in allowed["other"]:
                return f"GRES entry {entry!r} was not in the request"
            continue
        for word in words[1:] if name == "gres" else words:
            if word.isdigit():
                if int(word) > max_total:
                    return f"GPU count {word} exceeds the decided {max_total}"
            elif word not in allowed["types"] or word not in config.gpu_types:
                return f"GPU type {word!r} is not the decided one"
    return None


def _removal_ok(tokens: Sequence[str], i: int) -> bool:
    """May the rewrite have removed tokens[i]: a partition/GPU option, or the value after one."""
    token = tokens[i]
    name = token.removeprefix("--").partition("=")[0]
    if token.startswith("--") and name in REWRITABLE:
        return True
    if token[:2] in _SHORT:
        return True
    prev = tokens[i - 1] if i else ""
    return prev in _SHORT or (prev.startswith("--") and "=" not in prev and prev[2:] in REWRITABLE)


def _changed_tokens(old: Sequence[str], new: Sequence[str], allowed: Mapping[str, Sequence[str]],
                    config: Config, max_total: int, where: str) -> str | None:
    added = Counter(new) - Counter(old)
    removed = Counter(old) - Counter(new)
    for token in added:
        if problem := _token_problem(token, allowed, config, max_total):
            return f"{where}: {problem}"
    for i, token in enumerate(old):
        if removed.get(token) and not _removal_ok(old, i):
            return f"{where}: {token[:60]!r} was removed"
    return None


def _directive_tokens(text: str) -> list[str]:
    return [w for line in text.splitlines() if line.startswith("#SBATCH") for w in line.split()[1:]]


def _commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def check_plan(plan: Any, config: Config, script_text: str | None, options: Sequence[str],
               admits: Callable[[str], str | None] | None = None) -> str | None:
    """Why gsbatch must not submit the daemon's plan for this script and these sbatch options,
    or None when it may: the decision passes ``check_decision``, and the submission differs from
    what the user wrote only in partition and GPU options set to the decided values (the
    script's commands are untouched; comments may be added)."""
    if not isinstance(plan, Mapping) or not isinstance(plan.get("submission"), Mapping):
        return "the plan has no submission"
    decision, sub = plan.get("decision"), plan["submission"]
    record = plan.get("record")
    original = record.get("original_request") if isinstance(record, Mapping) else None
    if problem := check_decision(decision, config, original if isinstance(original, Mapping) else None, admits):
        return problem
    assert isinstance(decision, Mapping)
    new_text, words, env = sub.get("script_text"), sub.get("cli_words"), sub.get("env_overrides", {})
    if not (new_text is None or isinstance(new_text, str)) or not isinstance(words, list) \
            or not all(isinstance(w, str) for w in words) or not isinstance(env, Mapping):
        return "the submission is malformed"
    if not decision.get("changes"):
        if new_text != script_text or list(words) != list(options) or env or sub.get("changed"):
            return "the submission differs from the request though nothing was decided"
        return None
    comp = original if isinstance(original, Mapping) else {}
    types = {c.get("gpu_type") for c in decision["changes"]} | {comp.get("gpu_type")}
    types |= set(comp.get("gpu_types") or ()) if isinstance(comp.get("gpu_types"), list) else set()
    totals = [c.get("gpus_total") for c in decision["changes"]] + [comp.get("gpus_total")]
    max_total = max((t for t in totals if _is_count(t)), default=0)
    old_directives = _directive_tokens(script_text or "")
    other = [e for w in [*old_directives, *options] for e in w.split("=", 1)[-1].split(",") if not e.startswith("gpu")]
    allowed: dict[str, Sequence[str]] = {
        "partition": [c["partition"] for c in decision["changes"] if isinstance(c.get("partition"), str)],
        "types": [t for t in types if isinstance(t, str)], "other": other}
    if (script_text is None) != (new_text is None):
        return "the submission adds or drops the script"
    if script_text is not None and new_text is not None:
        if _commands(new_text) != _commands(script_text):
            return "the script's commands were changed"
        if problem := _changed_tokens(old_directives, _directive_tokens(new_text), allowed, config, max_total,
                                      "script"):
            return problem
    if problem := _changed_tokens(list(options), list(words), allowed, config, max_total, "command line"):
        return problem
    for key, value in env.items():
        if key not in ENV_OF or not isinstance(value, str):
            return f"environment: {str(key)[:40]!r} may not be set"
        if problem := _value_problem(ENV_OF[key], value, allowed, config, max_total):
            return f"environment: {problem}"
    return None
