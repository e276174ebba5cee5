"""Apply a decision to the script, command line and environment that sbatch will see.

Each changed value is changed where it was set — a script directive, a command-line word or
an ``SBATCH_*`` variable — because sbatch lets the command line override the environment and
the environment override the script. New text comes from the Jinja templates in
``templates/rewrite``; the user's script is only ever sliced and concatenated, never rendered,
so nothing in it (``{{ }}`` included) can be interpreted. Everything not changed stays
byte-identical.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cache
from types import MappingProxyType
from typing import Any, NamedTuple

from slurmgpu.pipeline.policy import ComponentChange, Decision
from slurmgpu.pipeline.request import ComponentRequest, GpuAsk, JobRequest, Origin, format_time
from slurmgpu.pipeline.sbatch_options import BY_NAME, BY_SHORT, ENV_BY_OPTION, Arg

_PLAIN = re.compile(r"^[A-Za-z0-9_.,:/@%+=-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RewriteError(RuntimeError):
    """The decision cannot be expressed in the user's syntax; the job goes as written."""


def templates_dir() -> str:
    """Templates ship inside the wheel; a source checkout reads the top-level folder."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the slurmgpu package
    packaged = os.path.join(here, "_templates")
    return packaged if os.path.isdir(packaged) else os.path.join(os.path.dirname(here), "templates")


def sbatch_quote(value: object) -> str:
    """Quote a value so sbatch's directive tokenizer reads it back as one word."""
    text = str(value)
    if _PLAIN.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment_safe(value: object) -> str:
    """Make a value safe inside a one-line shell comment."""
    return _CONTROL.sub("?", str(value))


@cache
def _macros() -> Any:
    import jinja2  # deferred: a job whose request stands never pays for the import

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        autoescape=False,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["sbatch_quote"] = sbatch_quote
    env.filters["comment"] = comment_safe
    return env.get_template("rewrite/directives.j2").module


class Submission(NamedTuple):
    """What gsbatch hands to sbatch: script text, command-line words and environment changes."""

    script_text: str | None
    cli_words: list[str]
    env_overrides: Mapping[str, str] = MappingProxyType({})
    changed: bool = False


def describe(comp: ComponentRequest) -> str:
    """A short human form of a component's GPU request, for notes and provenance."""
    asks = ", ".join(_ask_text(g) for g in comp.gpus) or "no GPUs"
    return f"{asks} in partition {comp.partition or '(default)'}"


def _ask_text(g: GpuAsk) -> str:
    kind = f"{g.type}:" if g.type else ""
    return f"--{g.option}={'gpu:' if g.option == 'gres' else ''}{kind}{g.count}"


def _new_gpu_value(comp: ComponentRequest, change: ComponentChange) -> tuple[GpuAsk, str]:
    """The new value for the component's GPU option, in the unit the user chose; a component
    that asks for no GPU gets ``--gres=gpu:TYPE:N`` (per node), after any other gres it names."""
    if not comp.gpus:
        if not change.gpu_type or not change.gpus_total:
            raise RewriteError("no GPU request to change; not rewritten")
        other = comp.options["gres"].value if "gres" in comp.options else None
        entry = f"gpu:{change.gpu_type}:{change.gpus_total}"
        origin = comp.options["gres"].origin if "gres" in comp.options else Origin("script")
        return GpuAsk(change.gpu_type, change.gpus_total, "node", "gres", origin), ",".join(
            [e for e in (other or "").split(",") if e and e.lower() != "none"] + [entry])
    ask = comp.gpus[0]
    if len({g.option for g in comp.gpus}) > 1:
        raise RewriteError("GPUs requested through several options; not rewritten")
    total = change.gpus_total if change.gpus_total is not None else comp.gpus_total
    unit = comp.multiplier(ask.per)
    if total % unit:
        raise RewriteError(f"{total} GPUs cannot be split evenly over {unit} {ask.per}s")
    count = total // unit
    if change.gpu_type and comp.constraint_gpu_types and change.gpu_type not in comp.constraint_gpu_types:
        raise RewriteError(f"--constraint pins GPU type {','.join(comp.constraint_gpu_types)}; not rewritten")
    gtype = change.gpu_type or (ask.type if len(comp.gpu_types) <= 1 else None)
    if ask.option == "gres":
        gpu = f"gpu:{gtype}:{count}" if gtype else f"gpu:{count}"
        return ask, ",".join([gpu, *ask.other_gres])
    return ask, f"{gtype}:{count}" if gtype else str(count)


class _Edits:
    """Collected edits, applied at the end so offsets stay valid."""

    def __init__(self) -> None:
        self.script: list[tuple[int, int, str]] = []  # (start, end, text)
        self.cli: dict[int, tuple[int, list[str]]] = {}  # first word -> (last word, new words)
        self.cli_prepend: list[str] = []
        self.env: dict[str, str] = {}


def _flags_before(text: str, name: str) -> str:
    """The flags an option cluster holds before option NAME ('-s' of '-sp gpu-small' or '-sG1'), which
    its rewrite keeps: only flags without a value can come before an option that takes one."""
    short = BY_NAME[name].short
    if text.startswith("--") or not short or not text.startswith("-") or text[1:2] == short:
        return ""
    at = text.find(short, 1)
    if at < 0 or any(c not in BY_SHORT or BY_SHORT[c].arg is not Arg.NONE for c in text[1:at]):
        raise RewriteError(f"{name} is set inside the option cluster {text.split()[0]!r}; not rewritten")
    return text[:at]


def _set_option(req: JobRequest, comp: ComponentRequest, name: str, value: str, edits: _Edits) -> None:
    origin: Origin | None = comp.options[name].origin if name in comp.options else None
    m = _macros()
    if origin is None:
        if req.script is None:
            edits.cli_prepend.append(m.option(name, value))
            return
        # Not set anywhere: a new directive after the line of the component's last directive word (a value
        # may stand on the line after its option's) or after the shebang.
        ends = [d.end for d in req.script.component_directives(comp.index)]
        if not ends and comp.index > 0:  # after the shebang it would be the first component's
            raise RewriteError(f"component {comp.index} has no directive line to add --{name} after; not rewritten")
        newline = req.script.text.find("\n", max(ends)) if ends else -1
        at = newline + 1 if newline >= 0 else req.script.line_end(len(req.script.line_starts) if ends else 1)
        edits.script.append((at, at, m.directive(name, value) + "\n"))
    elif origin.source == "script":
        assert req.script is not None
        d = [d for d in req.script.component_directives(comp.index) if d.name == name and d.line == origin.line][-1]
        kept = _flags_before(req.script.text[d.start:d.end], name)
        edits.script.append((d.start, d.end, f"{kept} {m.option(name, value)}".lstrip()))
    elif origin.source == "wrapper":
        edits.script.append(_wrapper_edit(req, name, value, origin, comp.options[name].value or ""))
    elif origin.source == "env":
        edits.env[ENV_BY_OPTION[name]] = value
    else:
        assert origin.index is not None and origin.last is not None
        kept = _flags_before(req.cli_words[origin.index], name)
        edits.cli[origin.index] = (origin.last, [*([kept] if kept else []), "--" + name + "=" + value])


def _wrapper_edit(req: JobRequest, name: str, value: str, origin: Origin, old: str) -> tuple[int, int, str]:
    """A new value in the #PBS/#BSUB word that spells the old one (``-q gpu-small``, ``-qgpu-small``,
    ``--destination=gpu-small``): sbatch reads that line after every #SBATCH line, so only there
    does a change take effect."""
    assert req.script is not None
    if origin.span is None:
        raise RewriteError(f"--{name} is derived from line {origin.line}'s resource list; not rewritten")
    if req.is_hetjob:
        raise RewriteError(f"line {origin.line} sets --{name} for every hetjob component; not rewritten")
    start, end = origin.span
    raw = req.script.text[start:end]
    prefix = raw[: len(raw) - len(old)]
    if not old or not raw.endswith(old) or (prefix and not prefix.startswith("-")):
        raise RewriteError(f"--{name} on line {origin.line} is quoted or escaped; not rewritten")
    return start, end, prefix + sbatch_quote(value)


def apply(req: JobRequest, decision: Decision) -> Submission:
    """Render the submission for a decision; the keep decision returns the input untouched."""
    original = req.script.text if req.script else None
    if not decision.changed:
        return Submission(original, list(req.cli_words))
    if req.script is not None and req.script.keep_marker:
        return Submission(original, list(req.cli_words))
    edits = _Edits()
    was, now = [], []
    for change in decision.changes:
        comp = req.components[change.index]
        was.append(describe(comp))
        if change.gpu_type is not None or change.gpus_total is not None:
            ask, value = _new_gpu_value(comp, change)
            _set_option(req, comp, ask.option, value, edits)
        if change.partition is not None:
            _set_option(req, comp, "partition", change.partition, edits)
        if change.time_limit_s is not None:
            _set_option(req, comp, "time", format_time(change.time_limit_s), edits)
        now.append(_describe_after(comp, change))
    text = original
    if req.script is not None and original is not None:
        edits.script.append((req.script.line_end(1), req.script.line_end(1),
                             _macros().provenance("; ".join(was), "; ".join(now), decision.reasons, decision.decider)))
        text = splice(original, edits.script)
    words = list(edits.cli_prepend)
    i = 0
    while i < len(req.cli_words):
        if i in edits.cli:
            last, new = edits.cli[i]
            words.extend(new)
            i = last + 1
            continue
        words.append(req.cli_words[i])
        i += 1
    return Submission(text, words, edits.env, changed=True)


def splice(text: str, edits: list[tuple[int, int, str]]) -> str:
    """Apply (start, end, new) edits to ``text``; every byte outside the edited spans stays.

    New lines are written newline-terminated, to go at a line's start. At the end of a text whose
    last line has no newline (sbatch reads such a line all the same) they would be glued onto it
    (``#!/bin/bash# slurmgpu: ...``), so there the newline moves to the front: the last line ends
    where it did, and the text still ends without one. Of several edits at one point, the one
    listed last comes first.
    """
    open_end, cr_end = (len(text) if not text.endswith("\n") else -1), text.endswith("\r")
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        if start == open_end and new.endswith("\n"):
            if cr_end:  # the newline would make a DOS line break, which sbatch refuses
                raise RewriteError("the script ends in a carriage return without a newline; not rewritten")
            new = "\n" + new[:-1]
        text = text[:start] + new + text[end:]
    return text


def _describe_after(comp: ComponentRequest, change: ComponentChange) -> str:
    gtype = change.gpu_type or comp.gpu_type
    total = change.gpus_total if change.gpus_total is not None else comp.gpus_total
    part = change.partition or comp.partition or "(default)"
    limit = f", time limit {format_time(change.time_limit_s)}" if change.time_limit_s is not None else ""
    return f"{total} x {gtype or 'any'} GPU{'s' if total != 1 else ''} in partition {part}{limit}"
