"""Fail-open on gsbatch's submit path, fault by fault.

Every fault of slurmgpu itself (its config, its model, its daemon, its spool, the disk, the
streams it writes to) must end with the job submitted once, exactly as written or as decided
(stdin included), with sbatch's exit code, at most one warning line and never a traceback.

Each fault runs the real ``gsbatch`` command twice: against a stand-in sbatch that records what
it was handed (unmarked: ``make test-unit`` runs it, and it compares the exact bytes), and,
marked ``slurm``, against the live cluster, where the held job's TRES must equal what plain
sbatch gives for the same script (as written) or for gsbatch's own ``--dry-run`` (as decided).
The submission record goes to a spool file, never to the database, so database faults cannot
reach this path; the spool and disk faults stand for them.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from test_slurm_gsbatch import job_info

from slurmgpu.apps import gsbatch
from slurmgpu.pipeline.bundle import BUNDLE_VERSION, Bundle, ModelFileError
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.errors import ConfigError
from slurmgpu.pipeline.features import NUMERIC
from slurmgpu.slurm.backend import Submitted

BIN = Path(sys.executable).parent
SAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml"
# The rules move it to partition gpu (a100 is not in gpu-small): as written and as decided differ.
SCRIPT = b"#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n#SBATCH -p gpu-small\nsleep 30\n"
TRES_FIELDS = ("Partition", "TRES", "TresPerNode", "TresPerJob", "TresPerTask", "TresPerSocket")

# A stand-in for sbatch: keeps its words, the script it was handed (the file named last, else
# stdin) and whether gsbatch marked the job decided, in a directory of its own per run.
FAKE_SBATCH = """#!/bin/sh
ulimit -f unlimited 2>/dev/null
out="$FAKE_SBATCH_DIR/$$"
mkdir -p "$out"
printf '%s\\n' "$@" > "$out/words"
for a; do last="$a"; done
if [ -n "$last" ] && [ -f "$last" ]; then cat "$last" > "$out/script"; else cat > "$out/script"; fi
echo "${SLURMGPU_DECIDED:-}" > "$out/decided"
echo "Submitted batch job $$"
"""


# ---------------------------------------------------------------- model files

TREE = {"trees": [{"splits": [[2, 1.5]], "leaves": [0.0, 0.1]}], "scale": 1.0, "bias": 0.0}


def bundle_data() -> dict[str, Any]:
    """A small valid model bundle (what `slurmgpu train` writes, with one tree per model)."""
    return {"version": BUNDLE_VERSION, "features": list(NUMERIC), "quantile": 0.9,
            "memory": json.loads(json.dumps(TREE)), "runtime": {**json.loads(json.dumps(TREE)), "bias": 7.0},
            "history": {"families": {}}}


def _with(change: Callable[[dict[str, Any]], None]) -> bytes:
    data = bundle_data()
    change(data)
    return json.dumps(data).encode()


MODEL_FAULTS: dict[str, bytes] = {
    "list": b"[]",
    "empty": b"",
    "truncated": json.dumps(bundle_data()).encode()[:150],
    "not-utf8": json.dumps(bundle_data()).encode().replace(b'"families"', b'"famili\xe9s"'),
    "nan-leaf": json.dumps(bundle_data()).encode().replace(b"0.1]", b"NaN]"),
    "infinite-bias": json.dumps(bundle_data()).encode().replace(b'"bias": 7.0', b'"bias": Infinity'),
    "string-leaves": _with(lambda d: d["memory"]["trees"][0].update(leaves=["0", "1"])),
    "string-feature": _with(lambda d: d["memory"]["trees"][0].update(splits=[["2", 1.5]])),
    "boolean-border": _with(lambda d: d["memory"]["trees"][0].update(splits=[[2, True]])),
    "missing-runtime": _with(lambda d: d.pop("runtime")),
    "missing-history": _with(lambda d: d.pop("history")),
    "missing-quantile": _with(lambda d: d.pop("quantile")),
    "no-trees": _with(lambda d: d["memory"].update(trees=[])),
    "unknown-feature": _with(lambda d: d["memory"]["trees"][0].update(splits=[[99, 1.5]])),
    "negative-feature": _with(lambda d: d["runtime"]["trees"][0].update(splits=[[-1, 1.5]])),
    "leaf-count": _with(lambda d: d["memory"]["trees"][0].update(leaves=[0.0, 0.1, 0.2])),
    "trees-not-list": _with(lambda d: d["memory"].update(trees={"0": 1})),
    "version": _with(lambda d: d.update(version=BUNDLE_VERSION + 1)),
    "stale-features": _with(lambda d: d.update(features=list(NUMERIC)[:-1])),
    "quantile-range": _with(lambda d: d.update(quantile=1.5)),
    "family-not-table": _with(lambda d: d["history"].update(families={"f": 3})),
    "family-string-n": _with(lambda d: d["history"].update(families={"f": {"n": "many"}})),
    "family-without-peak": _with(lambda d: d["history"].update(families={"f": {"n": 4}})),
    "family-huge-log": _with(lambda d: d["history"].update(families={"f": {"n": 4, "log_peak_max": 1e6,
                                                                            "log_tokens_at_max": 1.0}})),
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
    "huge-offset": _with(lambda d: d["memory"].update(offsets={"3:3": 1e300})),
    "negative-offset": _with(lambda d: d["memory"].update(default_offset=-1.0)),
    "offsets-not-table": _with(lambda d: d["memory"].update(offsets=[0.1])),
    "tree-strata-string": _with(lambda d: d["memory"].update(tree_strata="3:3")),
    "huge-rate": _with(lambda d: d["history"].update(families={"f": {"n": 4, "rate:1xv100": 800.0}})),
    "negative-size": _with(lambda d: d["history"].update(families={"f": {"n": 4, "params_b": -1e6, "b": 1.0}})),
    "arch-unknown-family": _with(lambda d: d["history"].update(archs={"resnetN": ["nowhere"]})),
    "runtime-upper-not-trees": _with(lambda d: d.update(runtime_upper={"trees": 3})),
    "card-offset-string": _with(lambda d: d["history"].update(type_offsets={"v100": "300"})),
    "card-offset-huge": _with(lambda d: d["history"].update(type_offsets={"v100": -1e9})),
    "card-offsets-not-table": _with(lambda d: d["history"].update(type_offsets=[300.0])),
}


def test_every_model_file_corruption_is_refused_at_load_with_a_value_error(tmp_path: Path) -> None:
    """A ValueError (ModelFileError) is what gsbatch and the daemon take as 'model unusable'."""
    path = tmp_path / "model.json"
    path.write_bytes(json.dumps(bundle_data()).encode())
    Bundle.load(str(path))  # the base itself is good
    for name, data in MODEL_FAULTS.items():
        path.write_bytes(data)
        with pytest.raises(ModelFileError) as caught:
            Bundle.load(str(path))
        assert "\n" not in str(caught.value) and str(caught.value), name


def test_a_config_that_is_not_utf8_is_a_config_error_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "slurmgpu.toml"
    path.write_bytes(SAMPLE.read_bytes() + b"# caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    lines = SAMPLE.read_bytes().count(b"\n") + 1
    assert str(caught.value) == f"{path}:{lines}: not UTF-8 text: byte 0xe9 cannot be decoded"


def test_a_corrupt_config_cache_is_read_past(tmp_path: Path) -> None:
    """The per-user cache of the parsed config is the user's to break: the file itself decides."""
    path = tmp_path / "slurmgpu.toml"
    path.write_bytes(SAMPLE.read_bytes())
    cache = tmp_path / "cache"
    good = load_config(path, str(cache))
    [kept] = list(cache.iterdir())
    stored = json.loads(kept.read_text())
    stored["config"]["gpu_types"] = 5
    kept.write_text(json.dumps(stored))
    assert load_config(path, str(cache)) == good
    kept.write_text("[" * 100_000)
    assert load_config(path, str(cache)) == good


# ---------------------------------------------------------------- a daemon that misbehaves


class FakeDaemon:
    """Listens on a Unix socket and answers every connection in one wrong way."""

    def __init__(self, path: str, behaviour: str) -> None:
        self.path, self.behaviour, self.stop = path, behaviour, threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        replies = {
            "garbage": b"\x00\xffnot json at all\n",
            "half-reply": b'{"ok": true, "plan": {"decis',
            "not-an-object": b'[1, 2, 3]\n',
            "wrong-shape": json.dumps({"ok": True, "plan": {"decision": {"refused": None},
                                                            "submission": {"changed": "yes"}}}).encode() + b"\n",
            "input-error-not-text": b'{"ok": false, "input_error": 5}\n',
            # a hostile daemon cannot stop a job: its refusal or input error is not believed
            "refuses": json.dumps({"ok": True, "plan": {"decision": {"refused": "h100 x 100000 does not fit"}}})
            .encode() + b"\n",
            "input-error": b'{"ok": false, "input_error": "job.sh: line 2: invalid option --gres"}\n',
            "flood": b"x" * (3 << 20),
        }
        try:
            if self.behaviour == "close-early":
                return
            conn.settimeout(2)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            if self.behaviour == "hang":
                self.stop.wait(5)
                return
            conn.sendall(replies[self.behaviour])
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


DAEMON_FAULTS = ["hang", "garbage", "close-early", "half-reply", "not-an-object", "wrong-shape",
                 "input-error-not-text", "refuses", "input-error", "flood"]


# ---------------------------------------------------------------- the faults


class Fault(NamedTuple):
    """One way slurmgpu can fail, and what must come of the job."""

    expect: str  # "written" (exactly as written), "decided" (as gsbatch decides when healthy), or "either"
    warning: str | None = None  # text of the one warning line (None: no warning line at all)
    stdin: bool = False  # the script comes on stdin
    stdout: str | None = None  # "closed", "full" or "broken" (a pipe nobody reads)
    stderr_closed: bool = False
    fsize_zero: bool = False  # RLIMIT_FSIZE 0: no file can be written (a full disk)


def _config(tmp: Path, **policy: object) -> Path:
    text = SAMPLE.read_text()
    for key, value in policy.items():
        text = text.replace(next(line for line in text.splitlines() if line.startswith(f"{key} ")),
                            f"{key} = {json.dumps(value)}")
    path = tmp / "slurmgpu.toml"
    path.write_text(text)
    return path


def setup(name: str, tmp: Path) -> tuple[dict[str, str], Callable[[], None]]:
    """Make the fault: files under ``tmp``; the environment it needs; how to undo it."""
    kind, _, what = name.removesuffix(" (stdin)").partition(":")
    env: dict[str, str] = {}
    undo: Callable[[], None] = lambda: None  # noqa: E731
    if kind == "config":
        path = tmp / "broken.toml"
        good = SAMPLE.read_bytes()
        if what == "not-utf8":
            path.write_bytes(good + b"# caf\xe9\n")
        elif what == "truncated-mid-key":
            path.write_bytes(good[: good.index(b"[gpu_types.v100]") + 5])
        elif what == "truncated-at-line":
            path.write_bytes(good[: good.index(b"gpus_per_node = 4")])
        elif what == "directory":
            path.mkdir()
        elif what == "empty":
            path.write_bytes(b"")
        elif what == "binary":
            path.write_bytes(bytes(range(256)) * 4)
        elif what == "nested":
            path.write_bytes(b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n")
        elif what == "wrong-types":
            path.write_bytes(good.replace(b"memory_gib = 80", b"memory_gib = 'lots'"))
        elif what != "missing":
            raise AssertionError(name)
        env["SLURMGPU_CONFIG"] = str(path)
    elif kind == "config-cache":
        load_config(_config(tmp), str(tmp / "cache" / "slurmgpu"))  # the cache gsbatch will find
        for kept in (tmp / "cache" / "slurmgpu").glob("config-*.json"):
            stored = json.loads(kept.read_text())
            stored["config"] = {"gpu_types": 5} if what == "wrong-types" else stored["config"]
            kept.write_text(json.dumps(stored) if what == "wrong-types" else "{\"key\": [")
    elif kind == "model":
        env["SLURMGPU_CONFIG"] = str(_config(tmp, decider="model", min_history=0))
        path = tmp / "model.json"
        if what == "directory":
            path.mkdir()
        elif what == "overflow":  # loads, then fails while deciding: exp() of a huge prediction
            path.write_bytes(_with(lambda d: d["memory"]["trees"][0].update(leaves=[1e6, 1e6])))
        else:
            path.write_bytes(MODEL_FAULTS[what])
        env["SLURMGPU_MODEL"] = str(path)
    elif kind == "daemon":
        directory = tempfile.mkdtemp(prefix="gsbatch-fault-", dir="/tmp")  # a short socket path
        env["SLURMGPU_SOCKET"] = os.path.join(directory, "d.sock")
        if what == "not-a-socket":
            Path(env["SLURMGPU_SOCKET"]).write_text("")
            undo = lambda: _rmtree(directory)  # noqa: E731
        else:
            fake = FakeDaemon(env["SLURMGPU_SOCKET"], what)
            undo = lambda: (fake.close(), _rmtree(directory))  # noqa: E731
    elif kind == "spool":
        if what == "missing":
            env["SLURMGPU_SUBMISSION_SPOOL"] = str(tmp / "no" / "such" / "spool")
        else:
            (tmp / "spool-file").write_text("")
            env["SLURMGPU_SUBMISSION_SPOOL"] = str(tmp / "spool-file")
    elif kind not in ("disk", "stream", "healthy"):
        raise AssertionError(name)
    return env, undo


def _rmtree(directory: str) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


MODEL_UNUSABLE = "unusable"
CONFIG_UNUSABLE = "slurmgpu config unusable"
FAULTS: dict[str, Fault] = {
    **{f"config:{w}": Fault("written", CONFIG_UNUSABLE) for w in (
        "not-utf8", "truncated-mid-key", "truncated-at-line", "directory", "missing", "empty", "binary", "nested",
        "wrong-types")},
    "config:not-utf8 (stdin)": Fault("written", CONFIG_UNUSABLE, stdin=True),
    "config-cache:wrong-types": Fault("decided"),
    "config-cache:truncated": Fault("decided"),
    **{f"model:{w}": Fault("written", MODEL_UNUSABLE) for w in (*MODEL_FAULTS, "directory")},
    "model:list (stdin)": Fault("written", MODEL_UNUSABLE, stdin=True),
    "model:unknown-feature (stdin)": Fault("written", MODEL_UNUSABLE, stdin=True),
    "model:overflow": Fault("written", "slurmgpu failed (OverflowError"),
    "model:overflow (stdin)": Fault("written", "slurmgpu failed (OverflowError", stdin=True),
    **{f"daemon:{w}": Fault("decided") for w in DAEMON_FAULTS if w != "wrong-shape"},
    "daemon:wrong-shape": Fault("either", ""),  # in-process plan, or as written with a warning
    "daemon:not-a-socket": Fault("decided"),
    "spool:missing": Fault("decided", "submission record not written"),
    "spool:a-file": Fault("decided", "submission record not written"),
    "disk:full": Fault("written", "rewritten script not written", fsize_zero=True),
    "disk:full (stdin)": Fault("decided", "submission record not written", stdin=True, fsize_zero=True),
    "stream:stdout-closed": Fault("decided", stdout="closed"),
    "stream:stdout-closed (stdin)": Fault("decided", stdout="closed", stdin=True),
    "stream:stdout-full": Fault("decided", stdout="full"),
    "stream:stdout-broken-pipe": Fault("decided", stdout="broken"),
    "stream:stderr-closed": Fault("decided", stderr_closed=True),
}


# ---------------------------------------------------------------- running gsbatch


class Run(NamedTuple):
    code: int
    stderr: str
    seconds: float


def _wrapped(fault: Fault, argv: list[str]) -> list[str]:
    """argv run by a shell that first puts the fault's limits and closed streams in place
    (not preexec_fn: the fake daemon's threads are running)."""
    steps = []
    if fault.fsize_zero:
        steps.append("ulimit -S -f 0")
    if fault.stdout == "closed":
        steps.append("exec 1>&-")
    if fault.stderr_closed:
        steps.append("exec 2>&-")
    return ["/bin/sh", "-c", "; ".join([*steps, 'exec "$@"']), "sh", *argv] if steps else argv


def run_gsbatch(tmp: Path, name: str, path_dirs: list[str], tag: str, args: list[str] | None = None) -> Run:
    """The gsbatch command, with the fault in place; sbatch is whichever comes first on PATH."""
    fault = FAULTS.get(name, Fault("decided"))
    script = tmp / "job.sh"
    script.write_bytes(SCRIPT)
    (tmp / "spool").mkdir(exist_ok=True)
    env = {"PATH": ":".join([*path_dirs, str(BIN), "/usr/bin", "/bin"]), "HOME": str(tmp),
           "XDG_CACHE_HOME": str(tmp / "cache"), "SLURMGPU_CONFIG": str(_config(tmp)),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp / "spool"), "SLURMGPU_SOCKET": str(tmp / "no-daemon.sock"),
           "FAKE_SBATCH_DIR": str(tmp / "sbatch-saw"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    extra, undo = setup(name, tmp)
    env.update(extra)
    argv = [str(BIN / "gsbatch"), "--hold", f"--comment={tag}", *(args or [])]
    if not fault.stdin:
        argv.append(str(script))
    stdout: Any = subprocess.DEVNULL
    reader = -1
    if fault.stdout == "full":
        stdout = open("/dev/full", "wb")  # noqa: SIM115
    elif fault.stdout == "broken":
        reader, stdout = os.pipe()
        os.close(reader)
    try:
        started = time.monotonic()
        res = subprocess.run(_wrapped(fault, argv), input=SCRIPT if fault.stdin else b"", stdout=stdout,
                             stderr=subprocess.PIPE, env=env, cwd=tmp, timeout=60, check=False)
        seconds = time.monotonic() - started
    finally:
        undo()
        if fault.stdout == "full":
            stdout.close()
        elif fault.stdout == "broken":
            os.close(stdout)
    return Run(res.returncode, res.stderr.decode("utf-8", "replace"), seconds)


def check_messages(name: str, run: Run) -> None:
    """sbatch's exit code (0), no traceback, and at most the one warning line the fault calls for."""
    fault = FAULTS[name]
    assert run.code == 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()
    assert all(line.startswith("gsbatch: ") for line in lines), run.stderr  # nothing else reaches the user
    warnings = [line for line in lines if line.startswith("gsbatch: warning: ")]
    errors = [line for line in lines if line.startswith("gsbatch: error: ")]
    assert not errors and len(warnings) <= 1, run.stderr
    if fault.stderr_closed:
        assert run.stderr == ""
    elif fault.warning is None:
        assert not warnings, run.stderr
    elif fault.warning:
        assert warnings and fault.warning in warnings[0], run.stderr
    if fault.expect == "written":  # nothing claims a change that was not made
        assert "GPU request changed" not in run.stderr, run.stderr


PARAMS = list(FAULTS)


# ---------------------------------------------------------------- without Slurm: what sbatch was handed


@pytest.fixture(scope="module")
def fake_sbatch(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("fake-sbatch")
    (directory / "sbatch").write_text(FAKE_SBATCH)
    (directory / "sbatch").chmod(0o755)
    return str(directory)


@pytest.fixture(scope="module")
def decided_script(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """What healthy gsbatch submits for SCRIPT (its --dry-run), to compare with."""
    tmp = tmp_path_factory.mktemp("healthy")
    script = tmp / "job.sh"
    script.write_bytes(SCRIPT)
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(_config(tmp)), "HOME": str(tmp),
           "SLURMGPU_SOCKET": str(tmp / "none.sock"), "XDG_CACHE_HOME": str(tmp / "cache")}
    res = subprocess.run([str(BIN / "gsbatch"), "--dry-run", str(script)], capture_output=True, env=env, check=True)
    assert res.stdout != SCRIPT and b"#SBATCH --partition=gpu\n" in res.stdout
    return res.stdout


@pytest.mark.parametrize("name", PARAMS)
def test_fault_submits_the_job_once_as_written_or_decided(name: str, tmp_path: Path, fake_sbatch: str,
                                                          decided_script: bytes) -> None:
    run = run_gsbatch(tmp_path, name, [fake_sbatch], "unit")
    check_messages(name, run)
    runs = list((tmp_path / "sbatch-saw").iterdir())
    assert len(runs) == 1, runs  # sbatch ran once: never a second submission
    handed = (runs[0] / "script").read_bytes()
    expect = FAULTS[name].expect
    allowed = {"written": [SCRIPT], "decided": [decided_script], "either": [SCRIPT, decided_script]}[expect]
    assert handed in allowed, handed
    words = (runs[0] / "words").read_text().splitlines()
    assert words[:2] == ["--hold", "--comment=unit"] and len(words) == (2 if FAULTS[name].stdin else 3)


# ---------------------------------------------------------------- on the live cluster


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory, decided_script: bytes) -> Iterator[dict[str, dict[str, str]]]:
    """The TRES plain sbatch gives the script as written and as gsbatch decides it."""
    tmp = tmp_path_factory.mktemp("oracle")
    out, ids = {}, []
    for kind, data in (("written", SCRIPT), ("decided", decided_script)):
        (tmp / "job.sh").write_bytes(data)
        res = subprocess.run(["sbatch", "--hold", "--parsable", str(tmp / "job.sh")], capture_output=True,
                             text=True, check=True)
        ids.append(res.stdout.strip().split(";")[0])
        info = job_info(ids[-1])
        out[kind] = {k: info.get(k, "") for k in TRES_FIELDS}
    assert out["written"] != out["decided"]
    yield out
    subprocess.run(["scancel", *ids], check=False)


def jobs_tagged(tag: str) -> list[str]:
    res = subprocess.run(["squeue", "-h", "-o", "%i|%k"], capture_output=True, text=True, check=True)
    return [line.split("|")[0] for line in res.stdout.splitlines() if line.split("|", 1)[1:] == [tag]]


@pytest.mark.slurm
@pytest.mark.parametrize("name", PARAMS)
def test_fault_on_the_live_cluster_leaves_the_job_held_with_the_right_tres(
        name: str, tmp_path: Path, oracle: dict[str, dict[str, str]]) -> None:
    tag = f"failopen-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        run = run_gsbatch(tmp_path, name, [], tag)
        check_messages(name, run)
        ids = jobs_tagged(tag)
        assert len(ids) == 1, ids  # submitted, and once
        info = job_info(ids[0])
        tres = {k: info.get(k, "") for k in TRES_FIELDS}
        expect = FAULTS[name].expect
        allowed = [oracle[k] for k in (("written", "decided") if expect == "either" else (expect,))]
        assert tres in allowed, (tres, allowed)
        assert info["JobState"] == "PENDING" and info["Reason"] == "JobHeldUser"
    finally:
        ids = jobs_tagged(tag)
        if ids:
            subprocess.run(["scancel", *ids], check=False)


# ---------------------------------------------------------------- in process: the backend itself fails


class Failing:
    """A backend whose sbatch may or may not have run before it failed."""

    name = "failing"

    def __init__(self, exc: Exception) -> None:
        self.exc, self.calls = exc, 0

    def submit(self, words: list[str], env: dict[str, str], stdin: bytes | None = None) -> Submitted:
        self.calls += 1
        raise self.exc

    def free_gpus(self) -> dict[str, int]:
        return {}


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "spool").mkdir(exist_ok=True)
    return {"SLURMGPU_CONFIG": str(SAMPLE), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool"),
            "SLURMGPU_SOCKET": str(tmp_path / "none.sock"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_a_backend_failure_after_sbatch_may_have_run_is_never_a_second_submission(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slurmgpu.slurm.backend import SlurmError

    script = tmp_path / "job.sh"
    script.write_bytes(SCRIPT)
    for exc, code in ((ChildProcessError(errno.ECHILD, "No child processes"), 1),
                      (SlurmError("sbatch not found on PATH"), 127)):
        backend = Failing(exc)
        assert gsbatch.main([str(script)], env=_env(tmp_path), backend=backend) == code  # type: ignore[arg-type]
        assert backend.calls == 1
        err = capsys.readouterr().err.splitlines()
        assert len([line for line in err if line.startswith("gsbatch: error:")]) == 1, err


def test_a_full_disk_for_the_private_copy_submits_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from test_gsbatch import Recorder

    def no_space(script: str, data: bytes) -> tuple[str, str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gsbatch, "private_copy", no_space)
    script = tmp_path / "job.sh"
    script.write_bytes(SCRIPT)
    backend = Recorder(code=3)
    assert gsbatch.main([str(script)], env=_env(tmp_path), backend=backend) == 3
    assert [c["words"] for c in backend.calls] == [[str(script)]] and backend.calls[0]["content"] == SCRIPT
    assert capsys.readouterr().err == ("gsbatch: warning: rewritten script not written (OSError: [Errno 28] No space "
                                       "left on device); submitting as written\n")


def test_a_full_disk_for_the_record_keeps_sbatchs_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from test_gsbatch import Recorder

    from slurmgpu.pipeline import spool

    def no_space(path: str, data: bytes, mode: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool, "atomic_write", no_space)
    script = tmp_path / "job.sh"
    script.write_bytes(SCRIPT)
    backend = Recorder(code=0)
    assert gsbatch.main([str(script)], env=_env(tmp_path), backend=backend) == 0
    assert len(backend.calls) == 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"gsbatch: warning: submission record not written to {tmp_path / 'spool'}: "
                        "No space left on device"]


@pytest.mark.parametrize("plan", [
    [], {"decision": {}, "submission": 5}, {"decision": {"refused": 1}, "submission": {}},
    {"decision": {"refused": None, "reasons": "r"}, "submission": {"changed": True, "cli_words": []}},
    {"decision": {"refused": None}, "submission": {"changed": True, "cli_words": [], "script_text": None}},
    {"decision": {"refused": None}, "submission": {"changed": False, "cli_words": [1]}},
    {"decision": {"refused": None}, "submission": {"changed": False, "cli_words": [], "env_overrides": {"A": 1}}},
])
def test_a_plan_of_the_wrong_shape_is_refused_before_anything_is_submitted(plan: Any) -> None:
    inv = gsbatch.parse_invocation(["job.sh"])
    with pytest.raises(TypeError):
        gsbatch.checked(inv, plan)


def test_stdout_that_fails_drops_sbatchs_lines_not_the_job() -> None:
    class Broken:
        def __init__(self) -> None:
            self.buffer = self

        def write(self, data: bytes) -> int:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    class Writes:
        name = "writes"

        def submit(self, words: list[str], env: dict[str, str], stdin: bytes | None = None) -> Submitted:
            for _ in range(3):
                sys.stdout.buffer.write(b"Submitted batch job 7\n")
                sys.stdout.buffer.flush()
            return Submitted(0, "7")

    real = sys.stdout
    sys.stdout = Broken()  # type: ignore[assignment]
    try:
        assert gsbatch.run_sbatch(Writes(), ["job.sh"], {}) == Submitted(0, "7")  # type: ignore[arg-type]
        assert sys.stdout.__class__ is Broken
        sys.stdout = None  # type: ignore[assignment]
        assert gsbatch.run_sbatch(Writes(), ["job.sh"], {}) == Submitted(0, "7")  # type: ignore[arg-type]
    finally:
        sys.stdout = real
