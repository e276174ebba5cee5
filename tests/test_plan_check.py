"""What gsbatch submits from a daemon's plan is what the decision says, and nothing else.

A fake daemon answers each plan request with an honest plan made by ``serve.Service`` and then
tampered with: a line deleted, options moved below the first command (sbatch then ignores them),
the shebang replaced, task and CPU counts swapped, control characters in its reasons. gsbatch must
submit the job as written with one warning line, and print daemon text as one clean line. The live
tests check the effect where it is Slurm's: the held job has the time limit the user wrote.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gsbatch import Recorder
from test_serve import SAMPLE, socket_dir
from test_slurm_gsbatch import job_info
from test_validate import hostile

from slurmgpu.apps import gsbatch, serve
from slurmgpu.apps.site import _fresh_cache
from slurmgpu.pipeline.bundle import Bundle
from slurmgpu.pipeline.config import Config, load_config
from slurmgpu.pipeline.errors import ConfigError, InputError
from slurmgpu.pipeline.files import FileRefused, read_regular
from slurmgpu.pipeline.validate import check_plan
from slurmgpu.slurm.backend import CliBackend

# The rules move it to partition gpu (a100 is not in gpu-small): the honest plan changes one line.
SCRIPT = ("#!/bin/bash\n#SBATCH -p gpu-small\n#SBATCH --gres=gpu:a100:1\n#SBATCH --job-name=orig\n"
          "#SBATCH --time=00:10:00\n#SBATCH -n 1 -c 2\n# the job\nsleep 30\n")
OPTIONS = ["-n", "1", "-c", "2"]
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # any control character but the line's newline


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(SAMPLE)


def honest_plan(config: Config, text: str = SCRIPT, options: list[str] | None = None) -> dict[str, Any]:
    reply = serve.Service(config).handle(json.dumps({
        "op": "plan", "config": str(SAMPLE), "script": text, "script_name": "job.sh",
        "options": list(options or []), "env": {}}).encode())
    assert reply["ok"] and reply["plan"]["submission"]["changed"], reply
    assert "#SBATCH --partition=gpu" in reply["plan"]["submission"]["script_text"]
    return dict(reply["plan"])


def _script(edit: Callable[[str], str]) -> Callable[[dict[str, Any]], None]:
    def change(plan: dict[str, Any]) -> None:
        sub = plan["submission"]
        new = edit(sub["script_text"])
        assert new != sub["script_text"]
        sub["script_text"] = new
    return change


def _words(plan: dict[str, Any]) -> None:
    plan["submission"]["cli_words"] = ["-n", "2", "-c", "1"]


# Each forgery the old token-multiset check let through.
FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "gres-line-deleted": _script(lambda t: t.replace("#SBATCH --gres=gpu:a100:1\n", "")),
    "name-and-time-below-the-first-command": _script(
        lambda t: t.replace("#SBATCH --job-name=orig\n#SBATCH --time=00:10:00\n", "")
        .replace("sleep 30\n", "sleep 30\n#SBATCH --job-name=orig\n#SBATCH --time=00:10:00\n")),
    "shebang-replaced": _script(lambda t: t.replace("#!/bin/bash\n", "#!/bin/sh\n", 1)),
    "tasks-and-cpus-swapped-in-the-script": _script(lambda t: t.replace("-n 1 -c 2", "-n 2 -c 1")),
    "tasks-and-cpus-swapped-on-the-command-line": _words,
    "a-gsbatch-line-added": _script(lambda t: t.replace("sleep 30\n", "#GSBATCH --no-rewrite\nsleep 30\n")),
    "a-comment-deleted": _script(lambda t: t.replace("# the job\n", "")),
    "gres-typed-otherwise": _script(lambda t: t.replace("--gres=gpu:a100:1", "--gres=gpu:v100:1")),
    "record-names-another-partition": lambda plan: plan["record"]["original_request"].update(partition="debug"),
    "a-command-before-the-first": _script(lambda t: t.replace("sleep 30\n", "true\nsleep 30\n")),
}


@pytest.mark.parametrize("name", FORGERIES)
def test_check_plan_refuses_a_forged_submission(config: Config, name: str) -> None:
    options = OPTIONS if name.endswith("command-line") else []
    text = SCRIPT.replace("#SBATCH -n 1 -c 2\n", "") if options else SCRIPT
    plan = honest_plan(config, text, options)
    assert check_plan(plan, config, text, options) is None  # the honest plan passes
    FORGERIES[name](plan)
    problem = check_plan(plan, config, text, options)
    assert problem is not None and "\n" not in problem, name


def test_check_plan_passes_a_longer_time_limit_only_as_decided(config: Config) -> None:
    """A move to a slower card may lengthen the time limit (policy.LIMIT_MARGIN): the plan passes when
    sbatch would read the decision's limit, longer than the job's; not a limit other than decided, a
    shorter one, or one changed though the decision keeps it."""
    def plan_with(limit: int | None, written: str) -> dict[str, Any]:
        plan = honest_plan(config)
        plan["decision"]["changes"][0]["time_limit_s"] = limit
        plan["submission"]["script_text"] = plan["submission"]["script_text"].replace("--time=00:10:00", written)
        return plan

    assert check_plan(plan_with(1200, "--time=00:20:00"), config, SCRIPT, []) is None
    assert check_plan(plan_with(1200, "-t 20"), config, SCRIPT, []) is None
    for limit, written, said in ((1200, "--time=00:30:00", "the decision says 1200 s"),
                                 (300, "--time=00:05:00", "not whole minutes longer than the job's 600"),
                                 (1230, "--time=00:20:30", "not whole minutes longer"),
                                 (None, "--time=00:20:00", "sbatch would read --time")):
        problem = check_plan(plan_with(limit, written), config, SCRIPT, [])
        assert problem is not None and said in problem, (limit, written, problem)


@pytest.mark.parametrize(("text", "options", "env"), [
    (SCRIPT, [], {}),
    ("#!/bin/bash\n#SBATCH --gres=gpu:a100:1\nsrun x\n", ["-p", "gpu-small"], {}),
    ("#!/bin/bash\n#SBATCH --gres=gpu:a100:1\nsrun x\n", [], {"SBATCH_PARTITION": "gpu-small"}),
    ("#!/bin/bash\n#SBATCH -p gpu-small\n", [], {}),  # no command: the whole script is directives
    ("#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1 -t 5\n# the job\n\nsrun x\n#SBATCH -t 9\n", [], {}),
    ("#!/bin/bash\n#SBATCH -p gpu-small\n#SBATCH --gres=gpu:a100:1\n#SBATCH hetjob\n#SBATCH -p gpu\nsrun x\n",
     [], {}),
    (None, ["--wrap=srun x", "--gres=gpu:a100:1", "-p", "gpu-small"], {}),
    (None, ["-p", "gpu-small", "--gres=gpu:a100:1", "--wrap", "srun x"], {}),
])
def test_check_plan_passes_honest_plans(config: Config, text: str | None, options: list[str],
                                        env: dict[str, str]) -> None:
    if text is not None and "--gres" not in text and not options:  # ask for a100 in gpu-small by the command line
        options = ["--gres=gpu:a100:1"]
    reply = serve.Service(config).handle(json.dumps({
        "op": "plan", "config": str(SAMPLE), "script": text, "script_name": "job.sh", "options": options,
        "env": env}).encode())
    assert reply["ok"] and reply["plan"]["submission"]["changed"], reply
    assert check_plan(reply["plan"], config, text, options, env=env) is None


HETJOB = ("#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\n#SBATCH -t 10 -J first\n#SBATCH hetjob\n"
          "#SBATCH -p gpu -n 2\n# the job\nsrun x\nsrun y\n")


def _as_read(text: str, config: Config) -> list[tuple[dict[str, str | None], dict[str, int]]]:
    """Per component, every option sbatch reads from a script but the GPU options (whose spelling
    may differ: gpu:a100 is gpu:a100:1), and the GPUs of each type they come to."""
    from slurmgpu.pipeline.request import GPU_OPTIONS, build_request
    from slurmgpu.pipeline.script import parse_script

    req = build_request(parse_script(text.encode(), "job.sh"), (), {}, config.gpu_features())
    return [({k: v.value for k, v in c.options.items() if k not in GPU_OPTIONS}, c.gpus_by_type)
            for c in req.components]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([SCRIPT, HETJOB]), st.sampled_from(["delete", "below", "swap", "duplicate", "char"]),
       st.integers(0, 60), st.integers(0, 200), st.sampled_from("x 9:=-#\t"))
def test_whatever_check_plan_accepts_is_what_the_honest_plan_submits(
        config: Config, text: str, mutation: str, at: int, offset: int, char: str) -> None:
    """A single edit of the honest submission (a line deleted, moved below the first command, swapped
    with the next, duplicated, or one character replaced) is refused, or sbatch reads from it the
    honest submission's options, with the same values, and the same GPUs."""
    plan = honest_plan(config, text)
    honest = plan["submission"]["script_text"]
    lines = honest.split("\n")
    i = at % (len(lines) - 1)
    first = next(n for n, line in enumerate(lines) if line.startswith("srun") or line.startswith("sleep"))
    if mutation == "delete":
        del lines[i]
    elif mutation == "below":
        lines.insert(first + 1, lines.pop(i))
    elif mutation == "swap":
        lines[i:i + 2] = lines[i:i + 2][::-1]
    elif mutation == "duplicate":
        lines.insert(i, lines[i])
    else:
        line = lines[i]
        j = offset % max(len(line), 1)
        lines[i] = line[:j] + char + line[j + 1:]
    forged = "\n".join(lines)
    plan["submission"]["script_text"] = forged
    if check_plan(plan, config, text, []) is None:
        try:
            read = _as_read(forged, config)
        except InputError:
            pytest.fail(f"accepted a script sbatch refuses: {forged!r}")
        assert read == _as_read(honest, config), forged
        assert forged.split("\n")[0] == honest.split("\n")[0]


# ---------------------------------------------------------------- through gsbatch, with a fake daemon


@pytest.fixture
def sock() -> Iterator[str]:
    directory = socket_dir()
    yield os.path.join(directory, "slurmgpu.sock")
    shutil.rmtree(directory, ignore_errors=True)


def _env(tmp_path: Path, sock: str) -> dict[str, str]:
    return {"SLURMGPU_CONFIG": str(SAMPLE), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path), "SLURMGPU_SOCKET": sock,
            "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path)}


@pytest.mark.parametrize("name", [n for n in FORGERIES if not n.endswith("command-line")])
def test_gsbatch_submits_as_written_when_the_daemon_forges_the_script(
        config: Config, name: str, tmp_path: Path, sock: str, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    plan = honest_plan(config)
    FORGERIES[name](plan)
    backend = Recorder()
    with hostile(sock, plan) as seen:
        code = gsbatch.main([str(script)], env=_env(tmp_path, sock), backend=backend)
    err = capsys.readouterr().err
    assert code == 0 and len(seen) == 1 and len(backend.calls) == 1
    assert backend.calls[0]["words"] == [str(script)] and backend.calls[0]["content"] == SCRIPT.encode()
    warnings = [line for line in err.splitlines() if line.startswith("gsbatch: warning: ")]
    assert len(warnings) == 1 and "answer not applied" in warnings[0] and "GPU request changed" not in err, err


HOSTILE_TEXT = "moved\x1b[2J\x1b]0;pwned\x07 to gpu\r\nrm -rf ~\x9b31m\x7f"


def test_daemon_text_reaches_the_terminal_as_one_clean_line_each(
        config: Config, tmp_path: Path, sock: str, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    plan = honest_plan(config)
    plan["decision"]["reasons"] = [HOSTILE_TEXT, "second\x07reason"]
    plan["notes"] = [HOSTILE_TEXT]
    backend = Recorder()
    with hostile(sock, plan):
        assert gsbatch.main([str(script)], env=_env(tmp_path, sock), backend=backend) == 0
    err = capsys.readouterr().err
    assert "--partition=gpu" in backend.calls[0]["content"].decode()  # applied: the text is only shown
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("gsbatch: note: ") for line in lines), err
    assert not CONTROL.search(err), ascii(err)
    assert "moved" in lines[0] and "to gpu" in lines[0] and "rm -rf" in lines[0] and "second" in lines[1]


def test_explain_and_model_warnings_are_one_clean_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slurmgpu.apps.site import local_decider
    from slurmgpu.pipeline.policy import Decision
    from slurmgpu.pipeline.request import build_request

    text = gsbatch.explain_text(build_request(None, ["--wrap=x"]), Decision(reasons=(HOSTILE_TEXT,)))
    assert not CONTROL.search(text) and all(line.startswith("gsbatch: explain: ") for line in text.splitlines())
    model = tmp_path / "model\x1b[2J.json"
    model.write_text(HOSTILE_TEXT)
    local_decider(load_config(SAMPLE), Recorder(), {"SLURMGPU_MODEL": str(model)}, None)  # type: ignore[arg-type]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("gsbatch: warning: model ") and not CONTROL.search(line), ascii(line)


# ---------------------------------------------------------------- live: what Slurm got


@pytest.mark.slurm
@pytest.mark.parametrize("name", ["name-and-time-below-the-first-command", "gres-line-deleted",
                                  "tasks-and-cpus-swapped-in-the-script"])
def test_a_forged_plan_never_reaches_slurm(config: Config, name: str, tmp_path: Path, sock: str,
                                         capsys: pytest.CaptureFixture[str], submitted: list[str]) -> None:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    plan = honest_plan(config, options=["--parsable", "--hold"])
    FORGERIES[name](plan)
    with hostile(sock, plan):
        code = gsbatch.main(["--parsable", "--hold", str(script)], env={**os.environ, **_env(tmp_path, sock)},
                            backend=CliBackend())
    out, err = capsys.readouterr()
    assert code == 0, err
    submitted.append(out.strip().split(";")[0])
    info = job_info(submitted[-1])
    info["CPUs/Task"] = re.findall(r"CPUs/Task=(\S+)", subprocess.run(
        ["scontrol", "-o", "show", "job", submitted[-1]], capture_output=True, text=True, check=True).stdout)[0]
    # as written: 10 minutes, named orig, one a100 in gpu-small, 1 task of 2 CPUs
    assert info["TimeLimit"] == "00:10:00" and info["JobName"] == "orig", info
    assert info["Partition"] == "gpu-small" and "gres/gpu:a100=1" in info["TRES"], info
    assert info["NumTasks"] == "1" and info["CPUs/Task"] == "2", info


# ---------------------------------------------------------------- a FIFO as config or model


FAKE_SBATCH = """#!/bin/sh
for a; do last="$a"; done
cat "$last" > "$FAKE_SBATCH_OUT"
echo "Submitted batch job 1"
"""


def _gsbatch_with(tmp_path: Path, fifo: str, path_dirs: list[str], args: list[str]) -> subprocess.CompletedProcess[str]:
    """The gsbatch command with the config or the model a FIFO nobody writes to."""
    os.mkfifo(tmp_path / "fifo")
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"'))
    env = {"PATH": ":".join([*path_dirs, str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
           "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path), "SLURMGPU_SOCKET": str(tmp_path / "none.sock"),
           "SLURMGPU_CONFIG": str(tmp_path / "fifo") if fifo == "config" else str(config),
           "FAKE_SBATCH_OUT": str(tmp_path / "handed"), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    if fifo == "model":
        env["SLURMGPU_MODEL"] = str(tmp_path / "fifo")
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    # a generous bound: gsbatch hung on the FIFO until killed; it answers in well under a second
    return subprocess.run([str(Path(sys.executable).parent / "gsbatch"), *args, str(script)], env=env,
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize("fifo", ["config", "model"])
def test_a_fifo_as_config_or_model_submits_as_written_with_one_warning(tmp_path: Path, fifo: str) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(FAKE_SBATCH)
    (fake / "sbatch").chmod(0o755)
    res = _gsbatch_with(tmp_path, fifo, [str(fake)], [])
    assert res.returncode == 0 and (tmp_path / "handed").read_text() == SCRIPT, res.stderr
    [line] = res.stderr.splitlines()
    assert line.startswith("gsbatch: warning: ") and "FIFO" in line and "as written" in line, line


@pytest.mark.slurm
@pytest.mark.parametrize("fifo", ["config", "model"])
def test_a_fifo_as_config_or_model_leaves_the_job_held_as_written(tmp_path: Path, fifo: str,
                                                                 submitted: list[str]) -> None:
    res = _gsbatch_with(tmp_path, fifo, [], ["--parsable", "--hold"])
    assert res.returncode == 0, res.stderr
    submitted.append(res.stdout.strip().split(";")[0])
    info = job_info(submitted[-1])
    assert info["Partition"] == "gpu-small" and info["TimeLimit"] == "00:10:00" and info["JobName"] == "orig", info


def _within(seconds: float, call: Callable[[], Any], fifo: Path) -> Any:
    """call() in a thread; fails when it has not returned after ``seconds`` (blocked on ``fifo``:
    opened for writing afterwards, so the thread ends)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked on the FIFO {fifo} for {seconds} s")
    return out[0]


def test_config_model_and_caches_that_are_fifos_are_refused_unread(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    problem = _within(10, lambda: load_config(fifo), fifo)
    assert isinstance(problem, ConfigError)
    assert str(problem) == f"{fifo}: cannot read config: a FIFO, not a regular file"
    problem = _within(10, lambda: Bundle.load(str(fifo)), fifo)
    assert isinstance(problem, OSError) and str(problem) == "a FIFO, not a regular file"
    # the user's own caches: the parsed config's, and gsbatch's partition rules (read past, as stale)
    cache = tmp_path / "cache" / "slurmgpu"
    good = load_config(SAMPLE, str(cache))
    [kept] = cache.iterdir()
    kept.unlink()
    os.mkfifo(kept)
    assert _within(10, lambda: load_config(SAMPLE, str(cache)), kept) == good
    os.mkfifo(cache / "partitions.txt")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert _within(10, lambda: _fresh_cache(env, "partitions.txt", 60.0), cache / "partitions.txt")[1] is None


def test_read_regular_reads_only_a_regular_file_within_its_cap(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.write_bytes(b"12345")
    (tmp_path / "link").symlink_to(good)
    os.mkfifo(tmp_path / "fifo")
    assert read_regular(str(good), 5) == b"12345"
    assert read_regular(str(tmp_path / "link"), 5) == b"12345"  # a config or model may be a link
    for path, cap, follow, why in [(good, 4, True, "5 bytes, over the 4-byte limit"),
                                   (tmp_path / "link", 5, False, "a symbolic link, not a regular file"),
                                   (tmp_path / "fifo", 5, True, "a FIFO, not a regular file"),
                                   (tmp_path, 5, True, "a directory, not a regular file"),
                                   (Path("/dev/zero"), 5, True, "a character device, not a regular file")]:
        with pytest.raises(FileRefused) as caught:
            read_regular(str(path), cap, follow=follow)
        assert str(caught.value) == why and caught.value.filename == str(path)
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "missing"), 5)
