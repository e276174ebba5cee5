"""gsbatch: sbatch with the GPU request put right.

Takes exactly sbatch's arguments plus ``--dry-run``, ``--diff``, ``--explain``,
``--no-rewrite`` and ``--gs-config=PATH``. The job always reaches sbatch: bad user input is
refused with sbatch-style one-line errors (exit 1), and any failure of slurmgpu itself falls
back to submitting the job exactly as written, with a warning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from slurmgpu.apps.site import DECIDED_MARKER, load_site
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.sbatch_options import OptionError, split_options
from slurmgpu.slurm.backend import CliBackend, SlurmBackend, Submitted

if TYPE_CHECKING:  # decided in this process, these load on demand; the daemon's plan needs none
    from slurmgpu.pipeline.config import Config
    from slurmgpu.pipeline.plan import Plan
    from slurmgpu.pipeline.policy import Decider, Decision
    from slurmgpu.pipeline.request import JobRequest

OWN_FLAGS = ("--dry-run", "--diff", "--explain", "--no-rewrite")
PASS_THROUGH = {"help", "usage", "version"}
HELP = """
gsbatch options (everything else is sbatch's):
      --dry-run          print the script that would be submitted; submit nothing
      --diff             print a unified diff of the rewrite; submit nothing
      --explain          show the decision and its reasons on stderr
      --no-rewrite       submit exactly as written (as does a '#GSBATCH --no-rewrite' line)
      --gs-config=PATH   slurmgpu config file (default: $SLURMGPU_CONFIG, /etc/slurmgpu/slurmgpu.toml)
"""


class Invocation(NamedTuple):
    """gsbatch's command line, split into its own flags, sbatch's options, script and args."""

    flags: frozenset[str] = frozenset()
    config: str | None = None
    options: tuple[str, ...] = ()
    script: str | None = None
    script_args: tuple[str, ...] = ()
    wrap: bool = False
    pass_through: bool = False

    def sbatch_words(self, options: Sequence[str] | None = None, script: str | None = None) -> list[str]:
        words = list(self.options if options is None else options)
        if self.script is not None or script is not None:
            words.append(script or self.script or "")
        return words + list(self.script_args)


def parse_invocation(argv: Sequence[str]) -> Invocation:
    """Split the command line the way sbatch will, taking out gsbatch's own flags.

    Own flags are long options sbatch does not know, so sbatch's own splitting already stops
    short of the script with them in place; they are removed from what sbatch gets.
    """
    words = list(argv)
    try:
        opts, operand = split_options(words)
    except OptionError:
        return Invocation(options=tuple(words), pass_through=True)  # let sbatch word the error itself
    flags, config, own = set(), None, set()
    for o in opts:
        if not o.known and o.name in OWN_FLAGS:
            flags.add(o.name)
            own.add(o.first)
        elif not o.known and o.name == "--gs-config":
            config = o.value
            own.add(o.first)
    options = tuple(w for j, w in enumerate(words[:operand]) if j not in own)
    names = {o.name for o in opts}
    wrap = "wrap" in names
    base = Invocation(frozenset(flags), config, options, wrap=wrap, pass_through=bool(names & PASS_THROUGH))
    tail = tuple(words[operand:])
    if tail[:1] == (":",):  # a command-line hetjob: passed on untouched
        return base._replace(options=options + tail, pass_through=True)
    if tail and not wrap:
        return base._replace(script=tail[0], script_args=tail[1:])
    return base._replace(script_args=tail)


def _note(stream: TextIO, kind: str, text: str) -> None:
    print(f"gsbatch: {kind}: {text}", file=stream)


def explain_text(request: JobRequest, decision: Decision) -> str:
    from slurmgpu.pipeline.rewrite import describe

    lines = [f"decider: {decision.decider}"]
    for comp in request.components:
        lines.append(f"request{f' (component {comp.index})' if request.is_hetjob else ''}: {describe(comp)}")
    if decision.refusal:
        lines.append(f"refused: {decision.refusal}")
    for c in decision.changes:
        parts = [f"{k}={v}" for k, v in (("gpu_type", c.gpu_type), ("gpus_total", c.gpus_total),
                                            ("partition", c.partition)) if v is not None]
        lines.append(f"change (component {c.index}): {', '.join(parts)}")
    lines.extend(f"reason: {r}" for r in decision.reasons)
    if decision.per_type:
        lines.append(f"{'type':>6} {'gpus':>4} {'fits':>4} {'peak GiB':>8} {'runtime':>9} {'wait':>7}")
        lines.extend(f"{c.gpu_type:>6} {c.gpus:>4} {'yes' if c.fits else 'no':>4} {c.pred_peak_mem_mib / 1024:>8.1f} "
                     f"{c.pred_runtime_s / 60:>7.0f} m {c.expected_wait_s / 60:>5.0f} m" for c in decision.per_type)
    if not decision.changed and not decision.refusal:
        lines.append("result: request kept as written")
    return "\n".join("gsbatch: explain: " + line for line in lines)


def plan(inv: Invocation, env: Mapping[str, str], decider: Decider, stdin: TextIO | None = None) -> Plan:
    """Parse, decide and rewrite in this process; raises InputError for bad user input."""
    from slurmgpu.pipeline.plan import make_plan
    from slurmgpu.pipeline.script import parse_script, read_script

    script = None
    stdin_data = None
    if not inv.wrap:
        if inv.script is not None:
            script = read_script(inv.script)
        else:
            stream = stdin if stdin is not None else sys.stdin
            stdin_data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read().encode()
            script = parse_script(stdin_data, "<stdin>")
    features: set[str] = getattr(getattr(decider, "config", None), "gpu_features", set)()
    made = make_plan(script, inv.options, env, decider, features, no_rewrite="--no-rewrite" in inv.flags)
    return made._replace(stdin=stdin_data)


def daemon_plan(inv: Invocation, env: Mapping[str, str], config: Config,
                timeout_s: float = 0.5) -> dict[str, Any] | None:
    """The plan made by ``slurmgpu serve`` (the fast path: templates and model are loaded there),
    or None when there is no daemon, it serves another config, or it does not answer in time.
    Raises InputError when the daemon found the user's input bad, as the in-process plan would."""
    from slurmgpu.apps.daemon_client import DEFAULT_SOCKET, call

    socket_path = env.get("SLURMGPU_SOCKET") or DEFAULT_SOCKET
    if inv.flags or (inv.script is None and not inv.wrap) or not os.path.exists(socket_path):
        return None  # dry runs, explanations and stdin scripts are planned here
    data = None
    if inv.script is not None:
        try:
            with open(inv.script, "rb") as fh:
                data = fh.read()
        except OSError:
            return None  # the in-process path words the error as sbatch does
    text = data.decode("utf-8", "surrogateescape") if data is not None else None
    # No user name: the daemon takes it from the kernel (SO_PEERCRED), never from the request.
    reply = call(socket_path, {
        "op": "plan", "config": os.path.realpath(config.path), "script_name": inv.script, "options": list(inv.options),
        "script": text, "env": {k: v for k, v in env.items() if k.startswith("SBATCH_")}}, timeout_s)
    if not reply:
        return None
    if reply.get("ok") and isinstance(reply.get("plan"), dict):
        from slurmgpu.pipeline.validate import check_plan

        problem = check_plan(reply["plan"], config, text, inv.options)
        if problem is None:
            return dict(reply["plan"], stdin=None)
        from slurmgpu.pipeline.policy import KeepDecider

        _note(sys.stderr, "warning", f"slurmgpu serve's answer not applied ({problem}); request kept as written")
        kept = plan(inv, env, KeepDecider(f"the daemon's answer was not applied ({problem}); request kept"))
        return dict(kept.to_json(), stdin=kept.stdin)
    if isinstance(reply.get("input_error"), str):
        raise InputError(reply["input_error"])
    return None


def submit(inv: Invocation, p: Mapping[str, Any], backend: SlurmBackend, env: Mapping[str, str]) -> Submitted:
    """Hand the plan to sbatch; a rewritten script goes through a private temporary file
    with the same name, so the job's default name and output file names do not change."""
    sub = p["submission"]
    # Tells the site's job_submit.lua hook that this job was already decided.
    child_env = {**env, **sub["env_overrides"], DECIDED_MARKER: "1"}
    if not sub["changed"]:
        return backend.submit(inv.sbatch_words(), child_env, p["stdin"])
    text = sub["script_text"]
    data = text.encode("utf-8", "surrogateescape") if text is not None else None
    if inv.script is None:
        return backend.submit(inv.sbatch_words(sub["cli_words"]), child_env,
                              data if p["stdin"] is not None else None)
    import shutil
    import tempfile

    tmpdir = tempfile.mkdtemp(prefix="gsbatch-")
    try:
        path = os.path.join(tmpdir, os.path.basename(inv.script))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data or b"")
        return backend.submit(inv.sbatch_words(sub["cli_words"], path), child_env)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def record(config: Config | None, env: Mapping[str, str], inv: Invocation, p: Mapping[str, Any],
           result: Submitted) -> None:
    """Leave a submission record in the spool for the ingest; never fails the submission."""
    from slurmgpu.pipeline.spool import (
        PERSONAL_SPOOL,
        ensure_personal_spool,
        new_record,
        submission_spool,
        write_record,
    )

    site = config.site if config else None
    directory = submission_spool(site.submission_spool if site else None, env)
    fields = p["record"]
    try:
        if directory.startswith(os.path.expanduser(PERSONAL_SPOOL)):
            ensure_personal_spool(directory)
        write_record(directory, new_record(
            cluster=site.cluster if site else None, job_id=result.job_id, sbatch_exit=result.code,
            script_sha256=fields["script_sha256"],
            features={"script": fields["script_features"],
                      "script_name": os.path.basename(inv.script) if inv.script else None,
                      "sbatch_options": list(inv.options), "wrap": inv.wrap},
            original_request=fields["original_request"], decision=fields["decision"], changed=fields["changed"]))
    except (OSError, TypeError, ValueError) as exc:
        _note(sys.stderr, "warning", f"submission record not written to {directory}: {exc}")


def _decide(inv: Invocation, env: Mapping[str, str], config: Config | None, backend: SlurmBackend,
            decider: Decider | None) -> dict[str, Any]:
    """The plan in JSON form: from the daemon when it answers, else made here (and explained,
    when asked). Raises InputError for bad user input."""
    if decider is None and config is not None:
        answered = daemon_plan(inv, env, config)
        if answered is not None:
            return answered
    if decider is None:
        from slurmgpu.apps.site import site_decider

        decider = site_decider(config, backend, env)
    p = plan(inv, env, decider)
    if "--explain" in inv.flags and p.request is not None:
        print(explain_text(p.request, p.decision), file=sys.stderr)
    made = p.to_json()
    made["stdin"] = p.stdin
    made["original_text"] = p.request.script.text if p.request and p.request.script else ""
    return made


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
         backend: SlurmBackend | None = None, decider: Decider | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    backend = backend or CliBackend()
    inv = parse_invocation(argv)
    if inv.pass_through:
        code = backend.submit(inv.sbatch_words(), env).code
        if {"--help", "-h"} & set(inv.options):
            print(HELP, end="")
        return code
    config = None
    try:
        config = load_site(inv.config, env)
    except InputError as exc:
        from slurmgpu.pipeline.policy import KeepDecider

        _note(sys.stderr, "warning", f"slurmgpu config unusable ({exc}); submitting as written")
        decider = KeepDecider("config unusable")
    try:
        p = _decide(inv, env, config, backend, decider)
    except InputError as exc:
        _note(sys.stderr, "error", str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - any slurmgpu fault must not stop the job
        if "--dry-run" in inv.flags or "--diff" in inv.flags:
            _note(sys.stderr, "error", f"slurmgpu failed: {type(exc).__name__}: {exc}")
            return 1
        _note(sys.stderr, "warning", f"slurmgpu failed ({type(exc).__name__}: {exc}); submitting as written")
        return backend.submit(inv.sbatch_words(), env).code
    decision, sub = p["decision"], p["submission"]
    for text in p["notes"]:
        _note(sys.stderr, "note", text)
    if decision["refused"]:
        _note(sys.stderr, "error", f"{inv.script or 'job'}: {decision['refused']}")
        return 1
    if sub["changed"]:
        _note(sys.stderr, "note", f"GPU request changed: {'; '.join(decision['reasons'])}")
        if list(sub["cli_words"]) != list(inv.options) or sub["env_overrides"]:
            extra = " ".join(sub["cli_words"]) + "".join(f" {k}={v}" for k, v in sub["env_overrides"].items())
            _note(sys.stderr, "note", f"sbatch options now: {extra.strip()}")
    if "--dry-run" in inv.flags or "--diff" in inv.flags:
        original = p["original_text"]
        new = sub["script_text"] if sub["script_text"] is not None else original
        out = sys.stdout.buffer
        if "--diff" in inv.flags:
            import difflib

            name = inv.script or "<stdin>"
            diff = difflib.unified_diff(original.splitlines(True), new.splitlines(True), name, name + " (gsbatch)")
            out.write("".join(diff).encode("utf-8", "surrogateescape"))
        else:
            out.write(new.encode("utf-8", "surrogateescape"))
        out.flush()
        return 0
    result = submit(inv, p, backend, env)
    if "--test-only" not in inv.options:
        record(config, env, inv, p, result)
    return result.code


def entry() -> None:
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    # Everything gsbatch wrote is flushed and its files are closed: skip the interpreter's
    # teardown of every loaded module, a few milliseconds of each submission.
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        code = code or 1
    os._exit(code)
