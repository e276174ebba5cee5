"""job_submit.lua: its logic under the lua5.1 interpreter, then inside the real slurmctld.

The interpreter tests run the rendered hook with a stub ``slurm`` table against the daemon (or a
stopped, hung or garbage-answering stand-in); they need Debian's lua5.1 and lua-socket. The
cluster tests install the hook with ``cluster.sh up``, submit real jobs and put the previous
hook back at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from click.testing import CliRunner
from test_serve import BUSY_A100, SAMPLE, daemon, quick_bundle, socket_dir, with_model
from test_slurm_gsbatch import job_info

from slurmgpu.apps import serve, serve_socket
from slurmgpu.cli.serve import lua_group, lua_string
from slurmgpu.pipeline.config import Config, Partition, load_config

ROOT = Path(__file__).resolve().parent.parent
TRES = ("tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket", "partition", "time_limit")
TIMEOUT_S = 0.2
GARBAGE = [
    b"garbage\n",
    b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:a100:4; rm -rf /"}}}\n',
    b'{"ok": true, "decision": {"apply": {"partition": ["gpu"]}}}\n',
    b'{"ok": true, "decision": {"apply": {"comment": "x"}}}\n',
    b'{"ok": true, "decision": 7}\n',
    b'{"ok": true, "decision": {"apply": {}}} trailing\n',
    b'{"ok": tru',  # then hangs up
    b"[" * 5000 + b"\n",
    b"x" * 100000,  # no newline, longer than any answer
]


def render_hook(path: Path, *options: str, config: Path | None = SAMPLE) -> Path:
    env = {"SLURMGPU_CONFIG": str(config) if config else None}  # None: unset (and no /etc/slurmgpu here)
    res = CliRunner().invoke(lua_group, ["render", "--out", str(path), *options], env=env)
    assert res.exit_code == 0, res.output
    return path


@contextmanager
def stand_in(path: str, kind: str, answers: list[bytes] = GARBAGE) -> Iterator[None]:
    """Something at the socket that is not a working daemon: 'stale' (a dead socket file),
    'hung' (accepts, never answers) or 'garbage' (answers each request with the next of ``answers``)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o666)
    if kind == "stale":
        listener.close()
        yield
        os.unlink(path)
        return
    listener.listen(64)
    listener.settimeout(0.05)
    held: list[socket.socket] = []
    stop = threading.Event()

    def loop() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if kind == "hung":
                held.append(conn)
                continue
            try:
                conn.settimeout(1)
                conn.recv(1 << 20)
                conn.sendall(answers[n % len(answers)])
            except OSError:
                pass
            n += 1
            conn.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        listener.close()
        for conn in held:
            conn.close()
        os.unlink(path)


@pytest.fixture
def sock() -> Iterator[str]:
    directory = socket_dir()
    yield os.path.join(directory, "slurmgpu.sock")
    shutil.rmtree(directory, ignore_errors=True)


# --- the hook under lua5.1 ------------------------------------------------------------------------

DRIVER = r"""
slurm = { SUCCESS = 0 }
function slurm.log_info(fmt, ...) io.stderr:write("info: ", string.format(fmt, ...), "\n") end
function slurm.log_error(fmt, ...) io.stderr:write("error: ", string.format(fmt, ...), "\n") end
function slurm.log_user(fmt, ...) io.stderr:write("user: ", string.format(fmt, ...), "\n") end
assert(dofile(arg[1]) == slurm.SUCCESS)
local have_socket, socket = pcall(require, "socket")
local clock = have_socket and socket.gettime or os.clock
local parts = { gpu = { flag_default = 1 }, ["gpu-small"] = { flag_default = 0 } }
for _, job in ipairs(dofile(arg[2])) do
    local t0 = clock()
    local rc = slurm_job_submit(job, parts, 0)
    io.write(string.format("%d\t%.4f", rc, clock() - t0))
    for _, key in ipairs({ "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket", "partition",
                           "time_limit" }) do
        io.write("\t", tostring(job[key]))
    end
    io.write("\n")
end
"""


class Outcome(NamedTuple):
    rc: int
    seconds: float
    fields: dict[str, str | None]


def lua_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_string(k)}] = {lua_value(v)}" for k, v in value.items()) + "}"
    return lua_string(value) if isinstance(value, str) else repr(value)


def job(**fields: Any) -> dict[str, Any]:
    return {"script": "#!/bin/bash\npython train.py\n", "user_name": "ann", "user_id": 1001, "name": "train.sh",
            "environment": {}, **fields}


@pytest.fixture(scope="module")
def lua(tmp_path_factory: pytest.TempPathFactory) -> Path:
    probe = subprocess.run(["lua5.1", "-e", 'require("socket.unix")'], capture_output=True) \
        if shutil.which("lua5.1") else None
    if probe is None or probe.returncode:
        why = "lua5.1 and lua-socket not installed (apt-get install lua5.1 lua-socket)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI=true: these tests must run")
        pytest.skip(why)
    driver = tmp_path_factory.mktemp("lua") / "driver.lua"
    driver.write_text(DRIVER)
    return driver


def run_hook(driver: Path, hook: Path, jobs: list[dict[str, Any]],
             env: dict[str, str] | None = None) -> tuple[list[Outcome], str]:
    spec = driver.parent / "jobs.lua"
    spec.write_text("return {" + ", ".join(lua_value(j) for j in jobs) + "}\n")
    res = subprocess.run(["lua5.1", str(driver), str(hook), str(spec)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr
    out = []
    for line in res.stdout.splitlines():
        rc, seconds, *values = line.split("\t")
        out.append(Outcome(int(rc), float(seconds), {k: None if v == "nil" else v for k, v in zip(TRES, values,
                                                                                              strict=True)}))
    return out, res.stderr


def requests(path: str) -> int:
    health = serve.call(path, {"op": "health"})
    assert health
    return health["requests"] - 1


MOVED = job(tres_per_node="gres:gpu:v100:1", partition="gpu-small")  # rules: v100 is in partition gpu


def test_hook_applies_decisions_in_either_slurm_spelling(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock)
    jobs = [
        job(tres_per_node="gres:gpu:v100:1,gres:shard:1", partition="gpu-small"),
        job(tres_per_task="cpu=2,gres/gpu=1", features="v100", num_tasks=2),  # Slurm 24.11 spelling
        job(tres_per_job="gres:gpu:2", features="t4", partition="gpu-small", num_tasks=4294967294),
        job(tres_per_node="gres:gpu:a100:2"),  # fits: kept
        job(partition="gpu-small"),  # no GPUs: not asked
        {**MOVED, "script": None},  # not a batch job: not asked
        {**MOVED, "environment": {"SLURMGPU_DECIDED": "1"}},  # the user opted out: not asked
        {**MOVED, "environment": {"SLURMGPU_DECIDED": str(int(time.time()))}},  # gsbatch decided it: not asked
        # inherited from a job gsbatch decided an hour ago (a plain sbatch inside it): asked
        {**MOVED, "environment": {"SLURMGPU_DECIDED": str(int(time.time()) - 3600)}},
    ]
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, jobs)
        assert requests(sock) == 5
    assert all(o.rc == 0 for o in out)
    assert out.pop().fields["partition"] == "gpu" and jobs.pop()  # the stale one was moved
    assert out[0].fields["partition"] == "gpu" and out[0].fields["tres_per_node"] == "gres:gpu:v100:1,gres:shard:1"
    assert out[1].fields["tres_per_task"] == "cpu=2,gres/gpu:v100=1"
    assert out[2].fields["tres_per_job"] == "gres:gpu:t4:2"
    assert out[3].fields == {**dict.fromkeys(TRES), "tres_per_node": "gres:gpu:a100:2"}
    for o, j in zip(out[4:], jobs[4:], strict=True):
        assert o.fields == {k: j.get(k) for k in TRES}
    assert "info: slurmgpu: job train.sh of ann changed: partition gpu-small -> gpu (GPU type v100" in log
    assert "kept as submitted" in log and "error" not in log


@pytest.mark.parametrize(("options", "extra", "changed"), [
    (["--partitions", "gpu"], {}, False),
    (["--partitions", "gpu-small,debug"], {}, True),
    (["--accounts", "ml"], {"account": "ml"}, True),
    (["--accounts", "ml"], {"account": "physics"}, False),
    (["--accounts", "ml"], {"default_account": "ml"}, True),
    (["--users", "1001"], {}, True),
    (["--users", "bob"], {}, False),
    (["--dry-run"], {}, False),
    (["--disabled"], {}, False),
])
def test_scope_dry_run_and_off_switch(lua: Path, sock: str, tmp_path: Path, options: list[str], extra: dict,
                                      changed: bool) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, *options)
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, [{**MOVED, **extra}])
    assert out[0].fields["partition"] == ("gpu" if changed else "gpu-small")
    if "--dry-run" in options:
        assert "dry run: job train.sh of ann would change: partition gpu-small -> gpu" in log


def test_default_partition_counts_for_scope(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--partitions", "gpu")
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, _ = run_hook(lua, hook, [job(tres_per_node="gres:gpu:1", features="v100")])
    assert out[0].fields["tres_per_node"] == "gres:gpu:v100:1"


@pytest.mark.parametrize("kind", ["stopped", "stale", "hung", "garbage"])
def test_a_broken_daemon_leaves_jobs_as_submitted_within_the_timeout(lua: Path, sock: str, tmp_path: Path,
                                                                     kind: str) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--backoff-s", "0")
    jobs = [MOVED] * len(GARBAGE)
    if kind == "stopped":
        out, log = run_hook(lua, hook, jobs)
    else:
        with stand_in(sock, kind):
            out, log = run_hook(lua, hook, jobs)
    for o in out:
        assert o.rc == 0 and o.fields == {k: MOVED.get(k) for k in TRES}
        assert o.seconds < TIMEOUT_S + 0.1
    if kind == "hung":
        assert min(o.seconds for o in out) >= TIMEOUT_S * 0.9
    assert log.count("error: slurmgpu: ") == len(jobs), log


HOSTILE = [  # well-formed answers the config or Slurm would not allow
    b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:h100:100000"}}}\n',
    b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:v100:100000"}}}\n',
    b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:t4:1"}}}\n',  # t4 is not in partition gpu
    b'{"ok": true, "decision": {"apply": {"partition": "debug"}}}\n',  # not in the config
    b'{"ok": true, "decision": {"apply": {"partition": "gpu", "tres_per_node": "gpu:t4:1"}}}\n',
    b'{"ok": true, "decision": {"apply": {"partition": "gpu", "tres_per_node": "gpu:a100:5"}}}\n',
]


def test_answers_out_of_bounds_are_not_applied(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--backoff-s", "0")
    jobs = [job(tres_per_node="gres:gpu:v100:1", partition="gpu")] * 3 + [MOVED] * 3
    with stand_in(sock, "garbage", HOSTILE):
        out, log = run_hook(lua, hook, jobs)
    for o, j in zip(out, jobs, strict=True):
        assert o.rc == 0 and o.fields == {k: j.get(k) for k in TRES}, (o, log)
    assert log.count("error: slurmgpu: ") == len(jobs), log
    for why in ("GPU type h100 is not in the slurmgpu config", "100000 GPUs", "not offered in partition gpu",
                "partition debug is not in the slurmgpu config", "5 GPUs in tres_per_node exceed the 4"):
        assert why in log, (why, log)


def test_a_partition_the_user_may_not_use_or_too_short_is_not_applied(lua: Path, sock: str, tmp_path: Path) -> None:
    """slurmctld lists only the partitions the user may use, with their MaxTime (minutes)."""
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--backoff-s", "0")
    driver = tmp_path / "driver.lua"
    driver.write_text(lua.read_text().replace(
        'local parts = { gpu = { flag_default = 1 }, ["gpu-small"] = { flag_default = 0 } }',
        'local parts = { ["gpu-small"] = { flag_default = 1, max_time = 60 } }'))
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(driver, hook, [MOVED])
    assert out[0].fields["partition"] == "gpu-small" and "not one this job's user may use" in log
    driver.write_text(lua.read_text().replace("gpu = { flag_default = 1 }",
                                              "gpu = { flag_default = 1, max_time = 60 }"))
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(driver, hook, [{**MOVED, "time_limit": 120}, {**MOVED, "time_limit": 60}])
    assert out[0].fields["partition"] == "gpu-small" and "exceeds MaxTime 60 min of partition gpu" in log
    assert out[1].fields["partition"] == "gpu"


def test_a_longer_time_limit_is_applied_within_maxtime_and_never_a_shorter_one(lua: Path, sock: str,
                                                                                tmp_path: Path) -> None:
    """A move to a slower card may take a longer time limit (job_desc.time_limit, minutes): applied where
    the partition the job ends in admits it, never one that is no longer than the job's, nor where the
    job wrote none."""
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--backoff-s", "0")
    driver = tmp_path / "driver.lua"
    driver.write_text(lua.read_text().replace(
        'local parts = { gpu = { flag_default = 1 }, ["gpu-small"] = { flag_default = 0 } }',
        'local parts = { gpu = { flag_default = 1, max_time = 60 }, '
        '["gpu-small"] = { flag_default = 0, max_time = 600 } }'))
    answers = [b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:t4:1", "time_limit": "45"}}}\n',
               b'{"ok": true, "decision": {"apply": {"partition": "gpu", "tres_per_node": "gpu:v100:1", '
               b'"time_limit": "90"}}}\n',  # over gpu's MaxTime of 60 min
               b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:t4:1", "time_limit": "30"}}}\n',
               b'{"ok": true, "decision": {"apply": {"tres_per_node": "gpu:t4:1", "time_limit": "45"}}}\n']
    small = job(tres_per_node="gres:gpu:t4:2", partition="gpu-small")
    jobs = [{**small, "time_limit": 30}, {**small, "time_limit": 30}, {**small, "time_limit": 30}, small]
    with stand_in(sock, "garbage", answers):
        out, log = run_hook(driver, hook, jobs)
    assert [o.rc for o in out] == [0] * 4
    assert (out[0].fields["time_limit"], out[0].fields["tres_per_node"]) == ("45", "gres:gpu:t4:1"), log
    assert "time_limit 30 -> 45" in log
    for o in out[1:3]:
        assert (o.fields["time_limit"], o.fields["tres_per_node"], o.fields["partition"]) == \
            ("30", "gres:gpu:t4:2", "gpu-small"), log
    assert (out[3].fields["time_limit"], out[3].fields["tres_per_node"]) == (None, "gres:gpu:t4:2"), log
    assert "time limit 90 min exceeds MaxTime 60 min of partition gpu" in log
    assert "time limit 30 min is not longer than the job's 30" in log and "is not longer than the job's nil" in log


def test_a_hook_rendered_without_a_config_applies_nothing(lua: Path, sock: str, tmp_path: Path) -> None:
    if os.path.exists("/etc/slurmgpu/slurmgpu.toml"):
        pytest.skip("a system config is installed: a render always finds one")
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, config=None)
    assert "local SITE = nil" in hook.read_text()
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, [MOVED])
    assert out[0].fields["partition"] == "gpu-small" and "rendered without a slurmgpu config" in log


def test_a_huge_script_is_cut_to_fit_the_request_limit(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock)
    script = "#!/bin/bash\n#SBATCH -p gpu-small\n" + "echo \"\t\"\n" * 60000 + "python train.py\n"  # escapes grow it
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, [{**MOVED, "script": script}])
    assert out[0].fields["partition"] == "gpu" and "error" not in log, log


def test_after_a_failure_jobs_pass_unasked_for_the_backoff(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--backoff-s", "30")
    with stand_in(sock, "hung"):
        out, log = run_hook(lua, hook, [MOVED] * 5)
    assert out[0].seconds >= TIMEOUT_S * 0.9 and all(o.seconds < 0.05 for o in out[1:])
    assert log.count("error:") == 1 and "jobs pass unasked for 30 s" in log


def test_an_error_answer_is_not_a_failure_of_the_daemon(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, "--backoff-s", "30")
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, [{**MOVED, "script": "echo no shebang\n"}, MOVED])
    assert out[0].fields["partition"] == "gpu-small" and out[1].fields["partition"] == "gpu"
    assert "left as submitted: slurmgpu says" in log and "error:" not in log


def test_without_lua_socket_every_job_passes(lua: Path, sock: str, tmp_path: Path) -> None:
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock)
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, [MOVED], env={"LUA_CPATH": "/nonexistent/?.so", "LUA_PATH": "/none/?.lua"})
        assert requests(sock) == 0
    assert out[0].rc == 0 and out[0].fields["partition"] == "gpu-small"
    assert "lua-socket (socket.unix) not available" in log


# --- advise mode and waivers, rendered from the admin config ----------------------------------------


def mode_config(tmp_path: Path, extra: str, policy: str = "") -> Path:
    p = tmp_path / "modes.toml"
    text = re.sub(r"(?m)^mode = .*\n", "", SAMPLE.read_text())
    p.write_text(text.replace("[policy]\n", f"[policy]\n{policy}\n", 1) + "\n" + extra)
    return p


def test_advise_mode_logs_and_tells_the_user_and_changes_nothing(lua: Path, sock: str, tmp_path: Path) -> None:
    config = mode_config(tmp_path, "", 'mode = "advise"')
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, config=config)
    with daemon(sock, serve.Service(load_config(config))):
        out, log = run_hook(lua, hook, [MOVED])
    assert out[0].fields == {k: MOVED.get(k) for k in TRES}
    assert "info: slurmgpu: advised (default): job train.sh of ann would change: partition gpu-small -> gpu (GPU " \
           "type v100 is not in partition gpu-small; moved to gpu, which has it); submitted as written" in log
    assert "user: slurmgpu advice: partition gpu-small -> gpu (GPU type v100" in log and "error" not in log


def test_the_hook_keeps_its_rendered_mode_whatever_the_daemon_or_the_job_says(lua: Path, sock: str,
                                                                             tmp_path: Path) -> None:
    """Rendered with advise for gpu-small while the daemon serves a rewrite config: nothing is applied;
    a mode or user name in the job (its environment, user_name) changes nothing; users match by uid."""
    config = mode_config(tmp_path, '[policy.modes]\npartitions = {gpu-small = "advise"}\nusers = {root = "rewrite"}\n')
    hook = render_hook(tmp_path / "hook.lua", "--socket", sock, config=config)
    jobs = [MOVED, {**MOVED, "user_name": "root", "environment": {"SLURMGPU_MODE": "rewrite"}, "mode": "rewrite"},
            {**MOVED, "user_id": 0}]
    with daemon(sock, serve.Service(load_config(SAMPLE))):
        out, log = run_hook(lua, hook, jobs)
    assert [o.fields["partition"] for o in out] == ["gpu-small", "gpu-small", "gpu"]
    assert log.count("advised (partition gpu-small)") == 2


def test_a_rendered_waiver_keeps_the_request_until_it_expires(lua: Path, sock: str, tmp_path: Path) -> None:
    from slurmgpu.pipeline.features import script_features

    family = script_features(MOVED["script"])["family"]

    def waiver(expires: str) -> str:
        return (f'[[waivers]]\nuser = "root"\nfamily = "{family}"\nreason = "a \\"quoted\\" benchmark"\n'
                f'owner = "hpc-admin"\nexpires = {expires}\n')

    for expires, kept in (("2999-12-31", True), ("2000-01-01", False)):
        hook = render_hook(tmp_path / "hook.lua", "--socket", sock, config=mode_config(tmp_path, waiver(expires)))
        with daemon(sock, serve.Service(load_config(SAMPLE))):  # the daemon knows no waiver: the hook does
            out, log = run_hook(lua, hook, [{**MOVED, "user_id": 0}, MOVED])
        assert [o.fields["partition"] for o in out] == ["gpu-small" if kept else "gpu", "gpu"]
        assert ('kept as submitted: waiver: a "quoted" benchmark (granted by hpc-admin, until 2999-12-31) '
                "(would change: partition gpu-small -> gpu)" in log) == kept


# --- the hook inside slurmctld ---------------------------------------------------------------------

CLUSTER = ["bash", str(ROOT / "contrib" / "local-slurm" / "cluster.sh"), "up"]
SLURMCTLD_LOG = Path("/var/log/slurmgpu-cluster/slurmctld.log")
BATCH = 20


def install(hook: Path) -> None:
    res = subprocess.run(CLUSTER, env={**os.environ, "SLURMGPU_JOB_SUBMIT_LUA": str(hook)}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


class Site(NamedTuple):
    socket: str
    config: Config
    model: str
    script: Path
    jobs: list[str]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The hook installed for partition debug only (other tests' jobs never reach it), a model
    decider config and bundle, and the hook that was there before, put back at the end."""
    from test_models import script_for

    work = tmp_path_factory.mktemp("slurm-lua")
    saved = work / "job_submit.lua.saved"
    shutil.copyfile("/etc/slurm/job_submit.lua", saved)
    sample = load_config(SAMPLE)
    config = with_model(sample._replace(partitions={
        **sample.partitions, "debug": Partition("debug", ("a100", "v100"), 4, 1, False)}))
    model = work / "model.json"
    quick_bundle(config).save(str(model))
    config_file = work / "slurmgpu.toml"  # the hook checks answers against the config it was rendered with
    config_file.write_text(SAMPLE.read_text() + '\n[partitions.debug]\ngpu_types = ["a100", "v100"]\n'
                           'gpus_per_node = 4\nnodes = 1\n')
    directory = tempfile.mkdtemp(prefix="slurmgpu-lua-", dir="/run")
    os.chmod(directory, 0o755)
    script = work / "resnet.sh"
    script.write_text(script_for("resnet", 16, 1000, "a100"))
    jobs: list[str] = []
    install(render_hook(work / "hook.lua", "--socket", f"{directory}/slurmgpu.sock", "--partitions", "debug",
                        "--backoff-s", "0", config=config_file))
    try:
        yield Site(f"{directory}/slurmgpu.sock", config, str(model), script, jobs)
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], check=False)
        install(saved)
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def site_daemon(site: Site) -> Iterator[None]:
    service = serve.Service(site.config, site.model, lambda: BUSY_A100, reload_s=0.2)
    service.refresh_free()
    with daemon(site.socket, service, serve_socket.access_for("slurm", "slurm", None)):
        yield


def sbatch(site: Site, *options: str, env: dict[str, str] | None = None) -> tuple[dict[str, str], float]:
    t0 = time.monotonic()
    res = subprocess.run(["sbatch", "--parsable", "--hold", *options, str(site.script)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **(env or {})})
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    site.jobs.append(res.stdout.strip().split(";")[0])
    info = job_info(site.jobs[-1])
    return {k: info.get(k, "").replace("gres:", "").replace("gres/", "") for k in ("TresPerNode", "Partition")}, took


def log_since(offset: int) -> str:
    with SLURMCTLD_LOG.open("rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


@pytest.mark.slurm
def test_a_plain_sbatch_job_gets_the_decided_gpus(site: Site) -> None:
    offset = SLURMCTLD_LOG.stat().st_size
    with site_daemon(site):
        expected = serve.ask(site.socket, {"script": site.script.read_text(), "tres_per_node": "gres:gpu:a100:4",
                                           "partition": "debug", "time_limit": 720, "user_name": "root",
                                           "user_id": 0, "name": "resnet.sh"})
        assert expected and expected["apply"].get("tres_per_node", "gpu:a100:4") != "gpu:a100:4", expected
        got, _ = sbatch(site, "-p", "debug", "--gres=gpu:a100:4")
        assert got == {"TresPerNode": expected["apply"]["tres_per_node"], "Partition": "debug"}
        elsewhere, _ = sbatch(site, "-p", "gpu", "--gres=gpu:a100:4")  # not a covered partition
        assert elsewhere["TresPerNode"] == "gpu:a100:4"
        assert requests(site.socket) == 2  # the ask above and the debug job
    log = log_since(offset)
    assert f"job resnet.sh of root changed: tres_per_node gres:gpu:a100:4 -> gres:{got['TresPerNode']}" in log


@pytest.mark.slurm
def test_the_hook_tags_admin_comment_and_leaves_the_users_comment(site: Site, tmp_path: Path) -> None:
    """The tag once went into Comment, and only when the user had none: a user's own --comment meant no
    tag, and a tag the user wrote there was read as the hook's. Now it is AdminComment, which no user can
    set, beside the user's Comment; sacct keeps both."""
    service = serve.Service(site.config, site.model, lambda: BUSY_A100, reload_s=0.2, record_spool=str(tmp_path))
    service.refresh_free()  # a recording daemon: its model decisions carry a tag
    with daemon(site.socket, service, serve_socket.access_for("slurm", "slurm", None)):
        sbatch(site, "-p", "debug", "--gres=gpu:a100:4", "--comment=my own words")
        assert service.records is not None and service.records.flush()
    info = subprocess.run(["scontrol", "-o", "show", "job", site.jobs[-1]], capture_output=True, text=True,
                          check=True).stdout
    assert " Comment=my own words " in info, info
    tag = re.search(r" AdminComment=(\S+) ", info)
    assert tag and tag.group(1).startswith("slurmgpu:d=") and ";m=model" in tag.group(1), info
    subprocess.run(["scancel", site.jobs[-1]], check=True)  # a held job's accounting row is filled when it ends
    deadline = time.monotonic() + 30
    row = ""
    while time.monotonic() < deadline and not row.startswith(tag.group(1)):
        row = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "AdminComment,Comment", "-j", site.jobs[-1]],
                             capture_output=True, text=True, check=True).stdout.strip()
        time.sleep(0.5)
    assert row == f"{tag.group(1)}|my own words", row


@pytest.mark.slurm
@pytest.mark.parametrize("export", [[], ["--export=NONE"]], ids=["export-all", "export-none"])
def test_a_job_gsbatch_decided_is_not_decided_twice(site: Site, export: list[str]) -> None:
    with site_daemon(site):
        got, _ = sbatch(site, "-p", "debug", "--gres=gpu:a100:4", *export, env={"SLURMGPU_DECIDED": "1"})
        assert got["TresPerNode"] == "gpu:a100:4"
        assert requests(site.socket) == 0


def submit_batch(site: Site) -> tuple[list[float], float]:
    """BATCH submissions to the covered partition, while another thread times squeue."""
    probes: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, timeout=60, check=True)
            probes.append(time.monotonic() - t0)

    thread = threading.Thread(target=probe)
    thread.start()
    times = []
    try:
        for _ in range(BATCH):
            got, took = sbatch(site, "-p", "debug", "--gres=gpu:a100:4")
            assert got == {"TresPerNode": "gpu:a100:4", "Partition": "debug"}
            times.append(took)
    finally:
        done.set()
        thread.join()
    return times, max(probes)


@pytest.mark.slurm
@pytest.mark.parametrize("kind", ["stopped", "hung", "garbage"])
def test_jobs_are_accepted_unchanged_and_slurmctld_stays_responsive(site: Site, kind: str) -> None:
    if kind == "stopped":
        times, squeue_max = submit_batch(site)
    else:
        with stand_in(site.socket, kind):
            times, squeue_max = submit_batch(site)
    slowest = TIMEOUT_S + 1.0  # the hook's bound plus sbatch itself on a busy 2-core machine
    assert max(times) < slowest and squeue_max < slowest, (kind, times, squeue_max)
    if kind == "hung":
        assert statistics.median(times) >= TIMEOUT_S  # each job waited out the timeout, no longer
    else:
        assert sum(times) < BATCH * TIMEOUT_S  # a dead or garbled daemon is noticed at once
    print(f"\n{kind}: {BATCH} sbatch in {sum(times):.2f} s (median {statistics.median(times) * 1000:.0f} ms, "
          f"max {max(times) * 1000:.0f} ms); slowest squeue meanwhile {squeue_max * 1000:.0f} ms")
