"""gsbatch: sbatch with the GPU request put right.

Takes exactly sbatch's arguments plus ``--dry-run``, ``--diff``, ``--explain``,
``--no-rewrite``, ``--gpu-mem=SIZE`` and ``--gs-config=PATH``. The job always reaches sbatch: bad user input is
refused with sbatch-style one-line errors (exit 1), and any failure of slurmgpu itself (config,
model, daemon, a bug) falls back to submitting the job exactly as written, stdin included, with
one warning line and sbatch's own output and exit code. Nothing after sbatch has run (the
submission record, a closed or broken stdout) can change that exit code.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from slurmgpu.apps.site import DECIDED_MARKER, load_site
from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import SBATCH_USAGE, ConfigError, InputError, one_line
from slurmgpu.pipeline.sbatch_options import OptionError, split_options
from slurmgpu.slurm.backend import CliBackend, Submitted
from slurmgpu.typing_lite import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # decided in this process, these load on demand; the daemon's plan needs none
    from typing import Any, TextIO

    from slurmgpu.pipeline.plan import Plan
    from slurmgpu.pipeline.policy import Decider, Decision
    from slurmgpu.pipeline.request import JobRequest
    from slurmgpu.slurm.backend import SlurmBackend

OWN_FLAGS = ("--dry-run", "--diff", "--explain", "--no-rewrite")
PASS_THROUGH = {"help", "usage", "version"}
HELP = """
gsbatch options (everything else is sbatch's):
      --dry-run          print the script that would be submitted; submit nothing
      --diff             print a unified diff of the rewrite; submit nothing
      --explain          show the decision and its reasons on stderr
      --no-rewrite       submit exactly as written (as does a '#GSBATCH --no-rewrite' line)
      --gpu-mem=SIZE     a GPU type with at least SIZE memory per GPU (24G, 40GB, 80GiB, 24000M);
                         wins over a '#GSBATCH --gpu-mem=SIZE' line
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
    gpu_mem: str | None = None  # --gpu-mem=SIZE as typed ("" when given without a size)
    unknown: tuple[str, ...] = ()  # options neither sbatch nor gsbatch knows, as typed: sbatch refuses them

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
        while gap := next((o for o in opts if not o.known and o.name == "--gpu-mem" and o.value is None
                           and o.first + 1 == operand < len(words)), None):
            # '--gpu-mem 24G': sbatch's splitting took the size for the script; it is the option's value
            words[gap.first:gap.first + 2] = [f"--gpu-mem={words[gap.first + 1]}"]
            opts, operand = split_options(words)
    except OptionError:
        return Invocation(options=tuple(words), pass_through=True)  # let sbatch word the error itself
    flags, config, own = set(), None, set()
    gpu_mem: str | None = None
    unknown: list[str] = []
    for o in opts:
        if not o.known and o.name in OWN_FLAGS:
            flags.add(o.name)
            own.add(o.first)
        elif not o.known and o.name == "--gs-config":
            config = o.value
            own.add(o.first)
        elif not o.known and o.name == "--gpu-mem":  # gsbatch's own: never handed to sbatch
            gpu_mem = o.value or ""
            own.add(o.first)
        elif not o.known:
            unknown.append(o.name)
    options = tuple(w for j, w in enumerate(words[:operand]) if j not in own)
    names = {o.name for o in opts}
    wrap = "wrap" in names
    base = Invocation(frozenset(flags), config, options, wrap=wrap, pass_through=bool(names & PASS_THROUGH),
                      gpu_mem=gpu_mem, unknown=tuple(unknown))
    tail = tuple(words[operand:])
    if tail[:1] == (":",):  # a command-line hetjob: passed on untouched
        return base._replace(options=options + tail, pass_through=True)
    if tail and not wrap:
        return base._replace(script=tail[0], script_args=tail[1:])
    return base._replace(script_args=tail)


def unrecognized(name: str) -> str:
    """sbatch's refusal of an option it does not know, with the name most likely meant."""
    from slurmgpu.pipeline.sbatch_options import active_long_names
    from slurmgpu.pipeline.script import closest

    long = name.startswith("--")
    near = closest(name, [*OWN_FLAGS, "--gpu-mem", "--gs-config", *("--" + n for n in active_long_names())]) \
        if long else None
    what = f"unrecognized option '{name}'" if long else f"invalid option -- '{name[1:]}'"
    return f"command line: {what}" + (f" (did you mean {near}?)" if near else "")


def _own_version() -> str:
    """slurmgpu's version under sbatch's: a bug report needs both."""
    from slurmgpu import __version__

    return f"gsbatch (slurmgpu) {__version__}\n"


def _note(stream: TextIO | None, kind: str, text: str) -> None:
    """One line on stderr, whatever the text holds (a daemon's reasons, a path: no control
    character reaches the terminal); a closed or broken stderr loses the line, never the job (and
    ``print(file=None)`` would write it to stdout)."""
    if stream is None:
        return
    try:
        print(f"gsbatch: {kind}: {one_line(text)}", file=stream, flush=True)
    except (OSError, ValueError):
        pass


def _fault(exc: BaseException) -> str:
    """An unexpected exception in a few words: its type and the start of its message."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def explain_text(request: JobRequest, decision: Decision, memory_gib: Mapping[str, float] | None = None) -> str:
    """The decision in lines; in the table a fit that rests on the family's past runs rather than
    the prediction (its peak is above the card: ``memory_gib``) reads ``runs``, not ``yes``."""
    from slurmgpu.pipeline.memory_bound import by_prediction
    from slurmgpu.pipeline.rewrite import describe

    def fits(c: Any) -> str:
        if not c.fits:
            return "no"
        card = (memory_gib or {}).get(c.gpu_type)
        return "runs" if card is not None and not by_prediction(c.pred_peak_mem_mib, c.margin, card) else "yes"

    lines = [f"decider: {decision.decider}"]
    for comp in request.components:
        lines.append(f"request{f' (component {comp.index})' if request.is_hetjob else ''}: {describe(comp)}")
    if decision.refusal:
        lines.append(f"refused: {decision.refusal}")
    for c in decision.changes:
        parts = [f"{k}={v}" for k, v in (("gpu_type", c.gpu_type), ("gpus_total", c.gpus_total),
                                            ("partition", c.partition), ("time_limit_s", c.time_limit_s))
                 if v is not None]
        lines.append(f"change (component {c.index}): {', '.join(parts)}")
    lines.extend(f"reason: {r}" for r in decision.reasons)
    if decision.per_type:
        lines.append(f"{'type':>6} {'gpus':>4} {'fits':>4} {'peak GiB':>8} {'margin':>6} {'runtime':>9} {'wait':>7}")
        lines.extend(f"{c.gpu_type:>6} {c.gpus:>4} {fits(c):>4} {c.pred_peak_mem_mib / 1024:>8.1f} "
                     f"{c.margin:>6.0%} {c.pred_runtime_s / 60:>7.0f} m {c.expected_wait_s / 60:>5.0f} m"
                     for c in decision.per_type)
        if any(fits(c) == "runs" for c in decision.per_type):
            lines.append("fits 'runs': the family's runs held on that card at this batch or larger; the predicted "
                         "peak is above it")
    if not decision.changed and not decision.refusal:
        lines.append("result: request kept as written")
    return "\n".join("gsbatch: explain: " + one_line(line) for line in lines)


def read_stdin(stream: TextIO | None = None) -> bytes:
    """The script sbatch would read from stdin, as bytes."""
    stream = stream if stream is not None else sys.stdin
    return stream.buffer.read() if hasattr(stream, "buffer") else stream.read().encode()


def plan(inv: Invocation, env: Mapping[str, str], decider: Decider, stdin: TextIO | None = None,
         stdin_data: bytes | None = None, config: Config | None = None,
         backend: SlurmBackend | None = None) -> Plan:
    """Parse, decide and rewrite in this process; raises InputError for bad user input.
    A script on stdin is ``stdin_data`` when the caller already read it, else read here.
    ``config``: the site's, by which a --gpu-mem is met whatever the decider; ``backend``: Slurm's
    node view, read only for a --gpu-mem in a partition the config does not describe."""
    from slurmgpu.pipeline.plan import make_plan, unread_plan
    from slurmgpu.pipeline.script import Unread, decode, parse_script, read_script

    script = None
    if inv.wrap or inv.script is not None:
        stdin_data = None
    if not inv.wrap:
        try:
            if inv.script is not None:
                script = read_script(inv.script)
            else:
                if stdin_data is None:
                    stdin_data = read_stdin(stdin)
                script = parse_script(stdin_data, "<stdin>")
        except Unread as exc:
            return unread_plan(str(exc), decode(exc.data), inv.options)._replace(stdin=stdin_data)
    features: set[str] = getattr(getattr(decider, "config", None), "gpu_features", set)()
    made = make_plan(script, inv.options, env, decider, features, no_rewrite="--no-rewrite" in inv.flags,
                     gpu_mem=inv.gpu_mem, config=config, live=partition_gpus(backend) if backend else None)
    return made._replace(stdin=stdin_data)


def partition_gpus(backend: SlurmBackend) -> Callable[[str], dict[str, tuple[int, int]] | None]:
    """A partition's GPUs by type as Slurm's nodes hold them (most on one node, all), read from
    sinfo once and only when asked; None when Slurm cannot say."""
    nodes: list[Any] | None = None

    def look(partition: str) -> dict[str, tuple[int, int]] | None:
        nonlocal nodes
        if nodes is None:
            try:
                nodes = backend.nodes()
            except Exception:  # noqa: BLE001 - no node view: the config alone decides
                nodes = []
        out: dict[str, tuple[int, int]] = {}
        for node in nodes:
            if partition in node.partitions:
                for gpu_type, n in node.gpus.items():
                    most, total = out.get(gpu_type, (0, 0))
                    out[gpu_type] = (max(most, n), total + n)
        return out or None

    return look


def daemon_plan(inv: Invocation, env: Mapping[str, str], config: Config,
                deadline: float) -> dict[str, Any] | None:
    """The plan made by ``slurmgpu serve`` (the fast path: templates and model are loaded there),
    or None when there is no daemon, it serves another config, or it does not answer by
    ``deadline`` (``time.monotonic()``), the submission's one deadline for all its daemon exchanges.
    None too when the daemon refuses the job or calls the input bad: only this process stops a
    job (it plans again and finds the same refusal or error, or none), so a daemon cannot make
    gsbatch refuse what sbatch accepts."""
    from slurmgpu.apps.daemon_client import DEFAULT_SOCKET, call

    socket_path = env.get("SLURMGPU_SOCKET") or DEFAULT_SOCKET
    if inv.flags or inv.gpu_mem is not None or (inv.script is None and not inv.wrap) \
            or (inv.script is not None and is_stream(inv.script)) or not os.path.exists(socket_path):
        return None  # dry runs, explanations, --gpu-mem, stdin and piped scripts are planned here
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
        "script": text, "env": {k: v for k, v in env.items() if k.startswith("SBATCH_")}},
        deadline - time.monotonic())
    if not reply:
        return None
    if reply.get("ok") and isinstance(reply.get("plan"), dict):
        from slurmgpu.pipeline.validate import check_plan

        decision = reply["plan"].get("decision")
        if isinstance(decision, dict) and (decision.get("refused") is not None or decision.get("asked")):
            return None  # the user's own ask (a '#GSBATCH --gpu-mem' line) is met here, whatever the mode

        problem = check_plan(reply["plan"], config, text, inv.options, env=env)
        if problem is None:
            return dict(reply["plan"], stdin=None, script_data=data)
        from slurmgpu.pipeline.policy import KeepDecider

        _note(sys.stderr, "warning", f"slurmgpu serve's answer not applied ({problem}); request kept as written")
        kept = plan(inv, env, KeepDecider(f"the daemon's answer was not applied ({problem}); request kept"),
                    config=config)
        return dict(kept.to_json(), stdin=kept.stdin, script_data=data)
    return None


class Outcome(NamedTuple):
    """A plan checked field by field, whether made here or by the daemon: what gsbatch reports,
    shows and submits. Anything of the wrong shape raised TypeError, and the job goes as written."""

    refused: str | None
    reasons: list[str]
    notes: list[str]
    warnings: list[str]
    changed: bool
    script_text: str | None
    cli_words: list[str]
    env_overrides: dict[str, str]
    original_text: str
    stdin: bytes | None


def _want(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"plan field {what} is {type(value).__name__}")
    return value


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"plan field {what} is not a list of strings")
    return value


def checked(inv: Invocation, p: Any) -> Outcome:
    """The plan's fields, each of the type gsbatch needs (TypeError otherwise)."""
    _want(p, dict, "plan")
    decision, sub = _want(p.get("decision"), dict, "decision"), _want(p.get("submission"), dict, "submission")
    overrides = _want(sub.get("env_overrides", {}), dict, "submission.env_overrides")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in overrides.items()):
        raise TypeError("plan field submission.env_overrides is not a mapping of strings")
    out = Outcome(_want(decision.get("refused"), (str, type(None)), "decision.refused"),
                  _strings(decision.get("reasons", []), "decision.reasons"), _strings(p.get("notes", []), "notes"),
                  _strings(p.get("warnings", []), "warnings"),
                  _want(sub.get("changed"), bool, "submission.changed"),
                  _want(sub.get("script_text"), (str, type(None)), "submission.script_text"),
                  _strings(sub.get("cli_words"), "submission.cli_words"), dict(overrides),
                  _want(p.get("original_text", ""), str, "original_text"),
                  _want(p.get("stdin"), (bytes, type(None)), "stdin"))
    if out.changed and not inv.wrap and out.script_text is None:
        raise TypeError("plan changes the request but holds no script")
    return out


class _PassOn:
    """``sys.stdout`` while sbatch runs (the backend passes sbatch's output on through it).

    When gsbatch's stdout is closed, full or a broken pipe, sbatch's lines are dropped, as they
    would be for sbatch itself, instead of failing a submission that has already happened: the
    job keeps sbatch's exit code, and the private copy is not removed before sbatch has read it.
    """

    def __init__(self, real: TextIO | None) -> None:
        self.real, self.broken = real, real is None
        self.buffer = self

    def write(self, data: bytes | str) -> int:
        if not self.broken and self.real is not None:
            try:
                if isinstance(data, bytes):
                    self.real.buffer.write(data)
                else:
                    self.real.write(data)
            except (OSError, ValueError, AttributeError):
                self.broken = True
        return len(data)

    def flush(self) -> None:
        if not self.broken and self.real is not None:
            try:
                self.real.flush()
            except (OSError, ValueError, AttributeError):
                self.broken = True


def run_sbatch(backend: SlurmBackend, words: Sequence[str], env: Mapping[str, str],
               stdin: bytes | None = None) -> Submitted:
    """sbatch, once. A failure of the backend itself is one error line and is never followed by
    a second submission: sbatch may have run already."""
    from slurmgpu.slurm.backend import SlurmError

    real = sys.stdout
    sys.stdout = _PassOn(real)
    try:
        return backend.submit(words, env, stdin)
    except SlurmError as exc:  # sbatch could not be started; a shell says 127 of a missing command
        _note(sys.stderr, "error", str(exc))
        return Submitted(127)
    except Exception as exc:  # noqa: BLE001 - after sbatch may have run: report, never resubmit
        _note(sys.stderr, "error", f"sbatch did not run or report cleanly ({_fault(exc)}); "
                                   "check squeue before submitting again")
        return Submitted(1)
    finally:
        sys.stdout = real


def as_written(inv: Invocation, backend: SlurmBackend, env: Mapping[str, str], stdin: bytes | None,
               why: str) -> int:
    """The fallback: the job exactly as the user wrote it (the bytes already read from stdin are
    sent on), one warning line, and sbatch's exit code."""
    _note(sys.stderr, "warning", f"{why}; submitting as written")
    return run_sbatch(backend, inv.sbatch_words(), env, stdin).code


def is_stream(path: str) -> bool:
    """Whether the script path is a pipe, FIFO or device (``/dev/stdin``, ``<(...)``): read once
    to decide, it is empty by the time sbatch opens it, so sbatch gets a copy of what was read."""
    import stat

    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # sbatch words the error itself


def private_copy(script: str, data: bytes) -> tuple[str, str]:
    """A rewritten script in a private temporary directory, under the script's own file name
    (mode 0600), so the job's default name and output file names do not change."""
    tmpdir = private_dir()
    try:
        path = os.path.join(tmpdir, os.path.basename(script))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except BaseException:
        _remove(tmpdir)
        raise
    return tmpdir, path


def private_dir() -> str:
    """A new directory of mode 0700 named ``gsbatch-RANDOM`` where ``tempfile.mkdtemp`` would put
    it ($TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp, the working directory: the first that takes
    it). Not tempfile itself: its import (shutil, random and the compression modules) costs a
    rewritten submission a few milliseconds, more than everything else it does here."""
    places = [os.environ[k] for k in ("TMPDIR", "TEMP", "TMP") if os.environ.get(k)]
    error: OSError = FileNotFoundError("no usable temporary directory")
    for place in [*places, "/tmp", "/var/tmp", "/usr/tmp", "."]:
        for _ in range(100):  # a name taken: another random one
            try:
                path = os.path.abspath(os.path.join(place, f"gsbatch-{os.urandom(6).hex()}"))
                os.mkdir(path, 0o700)
                return path
            except FileExistsError as exc:
                error = exc
            except OSError as exc:  # missing, not writable: the next place
                error = exc
                break
    raise error


def _remove(tmpdir: str) -> None:
    """The private directory and the script in it (nothing else is put there)."""
    try:
        for name in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, name))
        os.rmdir(tmpdir)
    except OSError:
        pass


def record(config: Config | None, env: Mapping[str, str], inv: Invocation, p: Mapping[str, Any],
           result: Submitted) -> None:
    """Leave a submission record in the spool for the ingest; never fails the submission
    (no spool, a full disk, a plan without the record's fields: one warning line)."""
    directory = "the submission spool"
    try:
        from slurmgpu.pipeline.spool import (
            PERSONAL_SPOOL,
            ensure_personal_spool,
            new_record,
            script_text,
            submission_spool,
            write_record,
        )

        site = config.site if config else None
        directory = submission_spool(site.submission_spool if site else None, env)
        fields = p["record"]
        if directory.startswith(os.path.expanduser(PERSONAL_SPOOL)):
            ensure_personal_spool(directory)
        data = p.get("script_data")
        write_record(directory, new_record(
            cluster=site.cluster if site else None, job_id=result.job_id, sbatch_exit=result.code,
            script_sha256=fields["script_sha256"],
            # the text only when its bytes are the ones hashed (the plan's hash is of the same bytes)
            script_text=script_text(data) if fields["script_sha256"] and isinstance(data, bytes) else None,
            source="gsbatch", model_version=model_version(p),
            features={"script": fields["script_features"],
                      "script_name": os.path.basename(inv.script) if inv.script else None,
                      "sbatch_options": list(inv.options), "wrap": inv.wrap},
            original_request=fields["original_request"], decision=fields["decision"], changed=fields["changed"]))
    except Exception as exc:  # noqa: BLE001 - the job is in; the record is a nicety
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else _fault(exc)
        _note(sys.stderr, "warning", f"submission record not written to {directory}: {why}")


def model_version(p: Mapping[str, Any]) -> str | None:
    """The model bundle's digest (Bundle.digest) when the model decided, else None (rules, keep)."""
    decision = p.get("decision")
    value = p.get("model_version")
    if not isinstance(decision, dict) or decision.get("decider") != "model" or not isinstance(value, str):
        return None
    return value if len(value) == 12 and all(c in "0123456789abcdef" for c in value) else None


def _decide(inv: Invocation, env: Mapping[str, str], config: Config | None, backend: SlurmBackend,
            decider: Decider | None, stdin_data: bytes | None = None) -> dict[str, Any]:
    """The plan in JSON form: from the daemon when it answers, else made here (and explained,
    when asked). Raises InputError for bad user input."""
    from slurmgpu.apps.daemon_client import PLAN_TIMEOUT_S

    deadline = time.monotonic() + PLAN_TIMEOUT_S  # for the daemon's plan and its decision together
    if decider is None and config is not None:
        answered = daemon_plan(inv, env, config, deadline)
        if answered is not None:
            return answered
    if decider is None:
        from slurmgpu.apps.site import site_decider

        decider = site_decider(config, backend, env, deadline)
    p = plan(inv, env, decider, stdin_data=stdin_data, config=config, backend=backend)
    if "--explain" in inv.flags and p.request is not None:
        config_of = getattr(decider, "config", None) or config
        text = explain_text(p.request, p.decision, config_of.memory_gib() if config_of is not None else None)
        try:
            print(text, file=sys.stderr)
        except (OSError, ValueError, AttributeError):
            pass
    made = p.to_json()
    made["stdin"] = p.stdin
    made["original_text"] = p.request.script.text if p.request and p.request.script else ""
    made["script_data"] = p.request.script.data if p.request and p.request.script else None
    bundle = getattr(decider, "bundle", None)  # the model decider's: which version decided (lineage)
    made["model_version"] = getattr(bundle, "digest", None) if p.decision.decider == "model" else None
    return made


def _load(inv: Invocation, env: Mapping[str, str]) -> tuple[Config | None, Decider | None, str | None]:
    """The site config; one that cannot be used (missing, unreadable, not UTF-8, invalid) gives
    the keep decider, so the job goes as written (bad input, and a --gpu-mem that cannot be met
    without the config, are still refused), and the warning to print when it does go."""
    try:
        return load_site(inv.config, env), None, None
    except Exception as exc:  # noqa: BLE001 - ConfigError, or any fault reading it
        from slurmgpu.pipeline.policy import KeepDecider

        why = f"slurmgpu config unusable ({str(exc) if isinstance(exc, ConfigError) else _fault(exc)})"
        return None, KeepDecider(why), f"{why}; submitting as written"


def _show(inv: Invocation, out: Outcome) -> int:
    """--dry-run / --diff: the script that would be submitted, or the diff, on stdout."""
    new = out.script_text if out.script_text is not None else out.original_text
    if "--diff" in inv.flags:
        import difflib

        name = inv.script or "<stdin>"
        text = "".join(difflib.unified_diff(out.original_text.splitlines(True), new.splitlines(True),
                                            name, name + " (gsbatch)"))
    else:
        text = new
    try:
        stream = sys.stdout.buffer
        stream.write(text.encode("utf-8", "surrogateescape"))
        stream.flush()
    except (OSError, ValueError, AttributeError) as exc:
        _note(sys.stderr, "error", f"cannot write to stdout: {getattr(exc, 'strerror', None) or _fault(exc)}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
         backend: SlurmBackend | None = None, decider: Decider | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    backend = backend or CliBackend()
    _use_running_slurm(backend, env)
    try:
        inv = parse_invocation(argv)
    except Exception as exc:  # noqa: BLE001 - a fault of ours: sbatch gets the words as typed
        _note(sys.stderr, "warning", f"slurmgpu failed ({_fault(exc)}); submitting as written")
        return run_sbatch(backend, argv, env).code
    if inv.pass_through:
        code = run_sbatch(backend, inv.sbatch_words(), env).code
        asked = set(inv.options)
        ours = HELP if {"--help", "-h"} & asked else _own_version() if {"--version", "-V"} & asked else ""
        try:
            print(ours, end="")
        except (OSError, ValueError, AttributeError):
            pass
        return code
    stdin_data = None
    if inv.script is None and not inv.wrap:
        try:
            stdin_data = read_stdin()
        except Exception as exc:  # noqa: BLE001 - sbatch reads whatever is left of stdin itself
            return as_written(inv, backend, env, None, f"stdin not readable ({_fault(exc)})")
    dry = bool({"--dry-run", "--diff"} & inv.flags)
    if dry and inv.unknown:  # sbatch would refuse it (a real submission hears it from sbatch itself)
        _note(sys.stderr, "error", unrecognized(inv.unknown[0]))
        return SBATCH_USAGE
    config, fallback, unusable = _load(inv, env)
    try:
        p = _decide(inv, env, config, backend, fallback or decider, stdin_data)
        p = resolve_mode(inv, config, p)
        out = checked(inv, p)
    except Exception as exc:  # noqa: BLE001 - any slurmgpu fault must not stop the job
        if isinstance(exc, InputError) and not isinstance(exc, ConfigError):
            _note(sys.stderr, "error", str(exc))  # the user's input: refused, as sbatch would
            return exc.exit_code
        if unusable:
            _note(sys.stderr, "warning", unusable)
        if dry:
            _note(sys.stderr, "error", f"slurmgpu failed: {_fault(exc)}")
            return 1
        return as_written(inv, backend, env, stdin_data, f"slurmgpu failed ({_fault(exc)})")
    if unusable and not out.refused:
        _note(sys.stderr, "warning", unusable)
    if config is not None and not out.refused:
        from slurmgpu.pipeline.memory_fit import oom_warning

        if (oom := oom_warning(p, config.memory_gib())) is not None:
            _note(sys.stderr, "warning", oom)
    for text in out.warnings:
        _note(sys.stderr, "warning", text)
    for text in out.notes:
        _note(sys.stderr, "note", text)
    _mode_notes(p)
    if out.refused:
        from slurmgpu.pipeline.request import COMMAND_LINE

        name = inv.script or "<stdin>"  # a refusal that names where its cause was set is not led by the script
        located = out.refused.startswith((f"{COMMAND_LINE}: ", f"{name}:")) and not inv.wrap
        _note(sys.stderr, "error", out.refused if located else f"{inv.script or 'job'}: {out.refused}")
        return 1
    if dry:
        _change_notes(inv, out)
        return _show(inv, out)
    words, data, tmpdir = inv.sbatch_words(), out.stdin, None
    read = p.get("script_data")  # a piped script kept as written: the bytes read, which sbatch would not find
    piped = read if not out.changed and isinstance(read, bytes) and inv.script is not None \
        and is_stream(inv.script) else None
    if out.changed or piped is not None:
        data = piped if piped is not None else \
            out.script_text.encode("utf-8", "surrogateescape") if out.script_text is not None else None
        if inv.script is None:
            words, data = inv.sbatch_words(out.cli_words), data if out.stdin is not None else None
        else:
            try:
                tmpdir, path = private_copy(inv.script, data or b"")
            except Exception as exc:  # noqa: BLE001 - no space, no writable TMPDIR: nothing sent yet
                return as_written(inv, backend, env, None, f"rewritten script not written ({_fault(exc)})")
            words, data = inv.sbatch_words(out.cli_words, path), None
    _change_notes(inv, out)
    # Tells the site's job_submit.lua hook that this job was already decided.
    child_env = {**env, **out.env_overrides, DECIDED_MARKER: str(int(time.time()))}
    try:
        result = run_sbatch(backend, words, child_env, data)
    finally:
        if tmpdir is not None:
            _remove(tmpdir)
    if "--test-only" not in inv.options:
        record(config, env, inv, p, result)
    return result.code


def _use_running_slurm(backend: SlurmBackend, env: Mapping[str, str]) -> None:
    """Read options as the sbatch that will run does: a long option's prefix resolves against
    that version's table (``--ext`` is -B in 22.05, ambiguous in 24.11, which adds --extra)."""
    from slurmgpu.apps.site import cached_slurm_version
    from slurmgpu.pipeline.sbatch_options import use_slurm_version

    try:
        use_slurm_version(cached_slurm_version(env, getattr(backend, "sinfo", "sinfo")))
    except Exception:  # noqa: BLE001 - unknown version: the union of the tables reads every option
        use_slurm_version(None)


def _account(user: str | None) -> str | None:
    """The user's default Slurm account (the one a job naming none is charged to), or None."""
    import subprocess

    if not user:
        return None
    try:
        done = subprocess.run(["sacctmgr", "-nP", "show", "user", user, "format=defaultaccount"],
                              capture_output=True, text=True, timeout=2, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    name = done.stdout.strip().splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else ""
    return name or None


def resolve_mode(inv: Invocation, config: Config | None, p: dict[str, Any]) -> dict[str, Any]:
    """The plan as the admin's mode and waivers want it submitted (pipeline/modes.py): advise mode
    or a waiver puts the submission back as written, the decision kept in the record. The user is
    whom the kernel says gsbatch runs as, never an environment variable."""
    if config is None or (config.modes.trivial and not config.waivers):
        return p
    import pwd

    from slurmgpu.pipeline import modes

    record: dict[str, Any] = p["record"] if isinstance(p.get("record"), dict) else {}
    original = record.get("original_request") or {}
    features = record.get("script_features") or {}
    try:
        user: str | None = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = None
    account = original.get("account")
    if account is None and modes.needs_account(config.modes, config.waivers):
        account = _account(user)
    resolution = modes.resolve(config.modes, config.waivers, user=user, account=account,
                               partition=original.get("partition"), family=features.get("family"),
                               default_partition=config.default_partition)
    return modes.apply_resolution(p, resolution, inv.options)


def _mode_notes(p: Mapping[str, Any]) -> None:
    """One line when advise mode or a waiver kept a decision from being applied."""
    decision = p.get("decision") or {}
    if decision.get("waived"):
        _note(sys.stderr, "note", f"request kept as written: {'; '.join(decision.get('reasons') or [])}")
    elif decision.get("advised"):
        from slurmgpu.pipeline.modes import advice_line

        record = p.get("record") or {}
        _note(sys.stderr, "advice", advice_line(record.get("original_request"), decision))


def _change_notes(inv: Invocation, out: Outcome) -> None:
    if out.changed:
        _note(sys.stderr, "note", f"GPU request changed: {'; '.join(out.reasons)}")
        if out.cli_words != list(inv.options) or out.env_overrides:
            extra = " ".join(out.cli_words) + "".join(f" {k}={v}" for k, v in out.env_overrides.items())
            _note(sys.stderr, "note", f"sbatch options now: {extra.strip()}")


def entry() -> None:
    _open_closed_streams()
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # noqa: BLE001 - past every fallback: still one line, never a traceback
        _note(sys.stderr, "error", f"internal error ({_fault(exc)})")
        code = 1
    # Everything gsbatch wrote is flushed and its files are closed: skip the interpreter's
    # teardown of every loaded module, a few milliseconds of each submission. A stdout that
    # cannot take the rest drops it, as sbatch's own would: the exit code stays sbatch's.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _open_closed_streams() -> None:
    """A standard stream closed when gsbatch started (``gsbatch job.sh >&-``) is None in Python,
    and ``print(file=None)`` would write to stdout: put /dev/null in its place (it takes the
    closed descriptor, lowest first), as reading or writing the closed stream would come to."""
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            try:
                setattr(sys, name, open(os.devnull, mode))  # noqa: SIM115 - lives until os._exit
            except OSError:
                pass
