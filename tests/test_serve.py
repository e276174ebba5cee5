"""The decision daemon: protocol, fields as sbatch words, bad input, model reload, who may ask."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmgpu.apps import serve, serve_socket
from slurmgpu.cli.serve import lua_group, lua_string, render_serve_cmd
from slurmgpu.pipeline.bundle import Bundle
from slurmgpu.pipeline.config import Config, load_config
from slurmgpu.pipeline.policy import ModelDecider
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_script

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BUSY_A100 = {"a100": 0, "v100": 4, "t4": 4}


@contextmanager
def daemon(path: str, service: serve.Service, access: serve_socket.Access | None = None,
           mode: int = 0o660) -> Iterator[serve_socket.Server]:
    """A daemon in a thread of this process, stopped (and its socket removed) afterwards."""
    server = serve_socket.Server(path, service, access or serve_socket.access_for(None, None, None), mode)
    service.start()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        service.stopped.set()
        server.shutdown()
        thread.join(5)
        server.server_close()


def socket_dir() -> str:
    """A 0755 directory every test user can traverse (pytest's tmp_path is 0700)."""
    path = tempfile.mkdtemp(prefix="slurmgpu-serve-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def sock() -> Iterator[str]:
    directory = socket_dir()
    yield os.path.join(directory, "slurmgpu.sock")
    shutil.rmtree(directory, ignore_errors=True)


def with_model(config: Config) -> Config:
    return config._replace(policy=config.policy._replace(decider="model"))


def quick_bundle(config: Config) -> Bundle:
    """A real bundle in a second or so: the synthetic history of the model tests, few trees."""
    from test_models import history

    from slurmgpu.learning import train

    return train.fit(history(600), config, iterations=60)[0]


@pytest.fixture(scope="module")
def rules() -> Config:
    return load_config(SAMPLE)


@pytest.fixture(scope="module")
def model_config(rules: Config) -> Config:
    return with_model(rules)


@pytest.fixture(scope="module")
def bundle(model_config: Config) -> Bundle:
    return quick_bundle(model_config)


def exchange(path: str, *lines: bytes, timeout: float = 5.0) -> list[dict | None]:
    """Send raw lines on one connection; one parsed reply per line (None once the server hung up)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        replies = []
        stream = s.makefile("rb")
        for line in lines:
            try:
                s.sendall(line)
                answer = stream.readline()
            except OSError:
                answer = b""
            replies.append(json.loads(answer) if answer else None)
        return replies


# --- protocol ------------------------------------------------------------------------------------


def test_health_and_a_rule_decision(rules: Config, sock: str) -> None:
    with daemon(sock, serve.Service(rules)):
        health = serve.call(sock, {"op": "health"})
        assert health and health["ok"] and health["decider"] == "rules" and health["model"] is None
        job = {"script": "#!/bin/bash\n#SBATCH -p gpu-small\npython x.py\n", "tres_per_node": "gres:gpu:v100:1",
               "partition": "gpu-small", "user_name": "ann", "num_tasks": serve.NO_VAL}
        decision = serve.ask(sock, job)
        assert decision is not None
        assert decision["apply"] == {"partition": "gpu"} and decision["changed"]
        assert decision["request"] == "--gres=gpu:v100:1 in partition gpu-small"
        assert set(decision) >= {"decider", "refused", "changes", "reasons", "per_type"}  # Decision.to_json
        assert serve.call(sock, {"op": "health"})["requests"] == 3


@pytest.mark.parametrize(("job", "apply"), [
    ({"tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small"}, {"partition": "gpu"}),
    ({"tres_per_task": "gres/gpu=1", "num_tasks": 2, "features": "v100"}, {"tres_per_task": "gpu:v100:1"}),
    ({"tres_per_job": "gres:gpu:2", "features": "t4", "partition": "gpu-small"}, {"tres_per_job": "gpu:t4:2"}),
    ({"tres_per_socket": "gres/gpu:1", "sockets_per_node": 1, "features": "a100"},
     {"tres_per_socket": "gpu:a100:1"}),
    ({"tres_per_node": "gres:gpu:a100:2", "partition": "gpu"}, {}),
    ({"partition": "gpu"}, {}),
], ids=["moved", "per-task-24.11", "per-job", "per-socket", "fits", "no-gpus"])
def test_each_tres_field_comes_back_in_its_own_field(rules: Config, sock: str, job: dict, apply: dict) -> None:
    with daemon(sock, serve.Service(rules)):
        decision = serve.ask(sock, {"script": "#!/bin/bash\ntrue\n", **job})
    assert decision is not None and decision["apply"] == apply


def test_job_fields_override_the_script_as_sbatch_options_do() -> None:
    script = ("#!/bin/bash\n#SBATCH --gres=gpu:a100:1 -p debug --time=10 -N 3\n#SBATCH --gpus-per-node=1\n"
              "python train.py\n")
    job = {"script": script, "tres_per_node": "gres:gpu:v100:2", "partition": "gpu", "time_limit": 30,
           "min_nodes": 1, "max_nodes": serve.NO_VAL, "num_tasks": serve.NO_VAL, "ntasks_per_node": serve.NO_VAL16,
           "cpus_per_task": 4, "account": "ml", "name": "train.sh"}
    request = serve.job_request(job, set())
    comp = request.main
    assert (comp.gpu_type, comp.gpus_total, comp.partition, comp.time_limit_s) == ("v100", 2, "gpu", 1800)
    assert (comp.nodes, comp.ntasks, comp.cpus_per_task, comp.account, comp.job_name) == (1, None, 4, "ml", "train.sh")
    assert request.script is not None and "python train.py" in request.script.text
    assert serve.job_words({"min_nodes": 2, "max_nodes": 4}) == ["--nodes=2-4"]
    assert serve.gpu_entries("gres/gpu:a100=2,gres/shard:1,gres:gpu") == ["gpu:a100:2", "gpu"]


def test_the_model_decider_answers_as_it_would_in_gsbatch(model_config: Config, bundle: Bundle, tmp_path: Path,
                                                          sock: str) -> None:
    from test_models import script_for

    path = tmp_path / "model.json"
    bundle.save(str(path))
    text = script_for("resnet", 16, 1000, "a100")
    with daemon(sock, serve.Service(model_config, str(path), lambda: BUSY_A100, reload_s=0.1)):
        time.sleep(0.3)  # the watcher's first idle-GPU refresh
        decision = serve.ask(sock, {"script": text, "tres_per_node": "gres:gpu:a100:4", "user_name": "ann"})
        health = serve.call(sock, {"op": "health"})
    direct = ModelDecider(model_config, bundle, lambda: BUSY_A100, "ann").decide(
        build_request(parse_script(text.encode(), "job.sh"), ["--gres=gpu:a100:4"], {}, model_config.gpu_features()))
    assert decision is not None and direct.changed
    change = direct.changes[0]
    assert decision["changes"] == [change._asdict()]
    assert decision["apply"] == {"tres_per_node": f"gpu:{change.gpu_type or 'a100'}:{change.gpus_total or 4}"}
    assert health["model"]["loaded"] and health["model"]["path"] == str(path) and health["model"]["jobs"] > 0


def test_the_daemon_ranks_types_by_the_queue_it_read(model_config: Config, bundle: Bundle, tmp_path: Path) -> None:
    """With a queue view, a busy type's expected wait is its ledger's; without one, idle GPUs."""
    from test_models import script_for

    from slurmgpu.pipeline.queue import GpuLedger

    path = tmp_path / "model.json"
    bundle.save(str(path))
    ledger = GpuLedger({"a100": [4], "v100": [4], "t4": [4]})
    ledger.reserve("a100", 4, 0.0, 7200.0)  # every A100 busy for two hours
    service = serve.Service(model_config, str(path), lambda: {"a100": 4, "v100": 4, "t4": 4}, reload_s=0.1,
                            queue=lambda: ledger)
    service.check_model()
    service.refresh_free()
    job = {"script": script_for("resnet", 16, 1000, "a100"), "tres_per_node": "gres:gpu:a100:1", "user_name": "ann"}
    waits = {c["gpu_type"]: c["expected_wait_s"] for c in service.decide(job)["per_type"]}
    assert 7190 <= waits["a100"] <= 7200 and waits["v100"] == 0.0
    blind = serve.Service(model_config, str(path), lambda: {"a100": 4, "v100": 4, "t4": 4}, reload_s=0.1)
    blind.check_model()
    blind.refresh_free()
    assert {c["expected_wait_s"] for c in blind.decide(job)["per_type"]} == {0.0}


def test_a_new_model_file_is_picked_up_without_dropping_requests(model_config: Config, bundle: Bundle,
                                                                 tmp_path: Path, sock: str) -> None:
    from test_models import script_for

    path = tmp_path / "model.json"
    bundle.save(str(path))
    job = {"script": script_for("bert", 16, 1000, "a100"), "tres_per_node": "gres:gpu:a100:2"}
    answers: list[dict | None] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            answers.append(serve.ask(sock, job, timeout_s=2.0))

    with daemon(sock, serve.Service(model_config, str(path), lambda: BUSY_A100, reload_s=0.1)):
        first = serve.call(sock, {"op": "health"})["model"]["sha256"]
        clients = [threading.Thread(target=client) for _ in range(3)]
        for t in clients:
            t.start()
        time.sleep(0.3)
        Bundle({**bundle.data, "jobs": bundle.data["jobs"] + 1}).save(str(path))  # atomic replace
        deadline = time.monotonic() + 5
        while serve.call(sock, {"op": "health"})["model"]["sha256"] == first and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        path.write_text("{broken")  # a bad file keeps the model in use
        time.sleep(0.4)
        stop.set()
        for t in clients:
            t.join()
        health = serve.call(sock, {"op": "health"})["model"]
    assert len(answers) > 20 and all(a is not None and a["decider"] == "model" for a in answers)
    assert health["sha256"] != first and health["jobs"] == bundle.data["jobs"] + 1
    assert health["loaded"] and "model.json" in health["error"]


def test_without_a_usable_model_requests_are_kept(model_config: Config, tmp_path: Path, sock: str) -> None:
    with daemon(sock, serve.Service(model_config, str(tmp_path / "none.json"))):
        decision = serve.ask(sock, {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:a100:1"})
        health = serve.call(sock, {"op": "health"})
    assert decision and decision["apply"] == {} and "model unusable" in decision["reasons"][-1]
    assert not health["model"]["loaded"] and "No such file" in health["model"]["error"]


# --- bad input -----------------------------------------------------------------------------------


BAD = [
    (b"not json\n", "Expecting value"),
    (b"[1, 2]\n", "unknown op"),
    (b'{"op": "history", "user": "bob"}\n', "unknown op 'history'"),
    (b'{"op": "decide"}\n', "'job' must be an object"),
    (b'{"op": "decide", "job": {"script": "echo no shebang\\n"}}\n', "#!"),
    (b'{"op": "decide", "job": {"tres_per_node": "gres:gpu:-1"}}\n', "negative GPU count"),
    (b'{"op": "decide", "job": {"num_tasks": "four"}}\n', "num_tasks: must be a whole number"),
    (b'{"op": "decide", "job": {"num_tasks": 1e400}}\n', "num_tasks: must be a whole number"),
    (b'{"op": "decide", "job": {"partition": "a\\nb"}}\n', "partition: must be a one-line string"),
    (b'{"op": "decide", "job": {"tres_per_node": "gres:gpu:2", "tres_per_task": "gres:gpu:1"}}\n',
     "--gpus-per-task used without"),
    (b"[" * 100000 + b"\n", "recursion"),
    (b'{"op": "decide", "job": {"script": "#!/bin/bash\\n\xff\xfe\\ntrue\\n"}}\n', None),
]


def test_bad_input_gets_an_error_and_the_daemon_carries_on(rules: Config, sock: str) -> None:
    with daemon(sock, serve.Service(rules)):
        replies = exchange(sock, *(line for line, _ in BAD), b'{"op": "health"}\n')
        assert replies[-1] and replies[-1]["ok"]
        for (line, expect), reply in zip(BAD, replies, strict=False):
            assert reply is not None, line[:60]
            if expect is None:
                assert reply["ok"], reply
            else:
                assert not reply["ok"] and expect in reply["error"], (line[:60], reply)
        too_long = exchange(sock, b'{"op": "decide", "job": {"script": "' + b"x" * serve.MAX_REQUEST_BYTES + b'"}}\n',
                            b'{"op": "health"}\n')
        assert too_long[0] and "longer than" in too_long[0]["error"] and too_long[1] is None  # hung up
        assert serve.call(sock, {"op": "health"})["ok"]


# --- socket, permissions, start and stop ---------------------------------------------------------


def test_socket_file_is_private_to_its_group(rules: Config, sock: str) -> None:
    with daemon(sock, serve.Service(rules), serve_socket.access_for("root", None, None)):
        st = os.stat(sock)
        assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == 0 and st.st_uid == os.geteuid()
        directory = os.stat(os.path.dirname(sock))
        assert directory.st_mode & 0o777 == 0o755


def test_refuses_a_shared_directory_or_a_second_daemon_and_replaces_a_stale_socket(rules: Config, sock: str) -> None:
    os.chmod(os.path.dirname(sock), 0o777)
    with pytest.raises(serve.InputError, match="writable by no one else"):
        serve_socket.Server(sock, serve.Service(rules), serve_socket.access_for(None, None, None))
    os.chmod(os.path.dirname(sock), 0o755)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock)
    stale.close()  # the file stays, nobody listens
    with daemon(sock, serve.Service(rules)):
        with pytest.raises(serve.InputError, match="already answers"):
            serve_socket.Server(sock, serve.Service(rules), serve_socket.access_for(None, None, None))
        assert serve.call(sock, {"op": "health"})
    assert not os.path.exists(sock)


USERS = {"sgserve-in": True, "sgserve-out": False}
CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connect": exc.errno}))
    sys.exit()
try:
    s.sendall(b'{"op": "health"}\\n')
except BrokenPipeError:  # a refused peer may be answered and hung up on before it sends
    pass
print(s.makefile().readline().strip() or "null")
"""


@pytest.fixture(scope="module")
def test_users() -> str:
    """Group sgserve with member sgserve-in; sgserve-out belongs to no such group."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create test users")
    if subprocess.run(["getent", "group", "sgserve"], capture_output=True).returncode:
        subprocess.run(["groupadd", "sgserve"], check=True)
    for user, member in USERS.items():
        if subprocess.run(["id", user], capture_output=True).returncode:
            subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", *(["-G", "sgserve"] if member else []), user],
                           check=True)
    return "sgserve"


def as_user(user: str, path: str) -> dict | None:
    pw = pwd.getpwnam(user)
    res = subprocess.run(["/usr/bin/python3", "-I", "-c", CLIENT, path], capture_output=True, text=True, timeout=20,
                         user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(user, pw.pw_gid), check=True)
    return json.loads(res.stdout)


def test_only_the_group_root_and_slurmuser_get_answers(rules: Config, sock: str, test_users: str) -> None:
    import errno

    group = grp.getgrnam(test_users).gr_gid
    with daemon(sock, serve.Service(rules), serve_socket.access_for(test_users, None, None)):
        assert os.stat(sock).st_gid == group
        assert as_user("sgserve-in", sock)["ok"]
        assert as_user("sgserve-out", sock) == {"connect": errno.EACCES}  # the file mode stops it
    with daemon(sock, serve.Service(rules), serve_socket.access_for(test_users, "nobody", None), mode=0o666):
        assert as_user("sgserve-in", sock)["ok"]
        assert as_user("sgserve-out", sock) == {"ok": False, "error": "permission denied"}  # SO_PEERCRED stops it
        assert as_user("nobody", sock)["ok"]  # as SlurmUser


def test_serve_command_drops_root_logs_decisions_and_stops_on_sigterm(sock: str) -> None:
    program = ("from slurmgpu.cli.main import main; from slurmgpu.cli.serve import serve_cmd; "
               "main.add_command(serve_cmd); main()")
    proc = subprocess.Popen([sys.executable, "-c", program, "--config", str(SAMPLE), "serve", "--socket", sock,
                             "--group", "", "--slurm-user", "", "--run-as", "nobody"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while serve.call(sock, {"op": "health"}) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert f"Uid:\t{pwd.getpwnam('nobody').pw_uid}\t" in status
        decision = serve.ask(sock, {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:v100:1",
                                    "partition": "gpu-small", "user_name": "ann"}, timeout_s=5)
        assert decision and decision["apply"] == {"partition": "gpu"}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    line = next(x for x in err.splitlines() if 'user="ann"' in x)
    assert 'request="--gres=gpu:v100:1 in partition gpu-small" result="partition=gpu"' in line and "latency_ms=" in line


# --- rendering -----------------------------------------------------------------------------------


def test_lua_render_validates_and_quotes(tmp_path: Path) -> None:
    out = tmp_path / "job_submit.lua"
    runner = CliRunner()
    for bad in (["--partitions", 'gpu,"x'], ["--users", "a b"], ["--socket", "relative.sock"],
                ["--socket", "/run/../etc/x"], ["--timeout-ms", "0"]):
        res = runner.invoke(lua_group, ["render", "--out", str(out), *bad])
        assert res.exit_code != 0 and not out.exists(), bad
    res = runner.invoke(lua_group, ["render", "--out", str(out), "--partitions", "gpu, debug", "--users", "ann,1001",
                                    "--timeout-ms", "150", "--dry-run", "--backoff-s", "0"])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert 'partitions = {["gpu"] = true, ["debug"] = true}' in text
    assert 'users = {["ann"] = true, ["1001"] = true}' in text
    assert "timeout_ms = 150," in text and "dry_run = true," in text and "backoff_s = 0," in text
    assert 'marker = "SLURMGPU_DECIDED"' in text
    assert lua_string('a"b\\c\né') == '"a\\034b\\092c\\010\\195\\169"'
    if shutil.which("luac5.1"):
        subprocess.run(["luac5.1", "-p", str(out)], check=True)


def test_lua_render_to_a_symlink_or_fifo_writes_through_it(tmp_path: Path) -> None:
    """`--out /dev/stdout` is a symlink to a terminal or pipe: written through, never replaced."""
    target = tmp_path / "hook.lua"
    target.write_text("old")
    link = tmp_path / "stdout"
    link.symlink_to(target)
    res = CliRunner().invoke(lua_group, ["render", "--out", str(link)])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and "function slurm_job_submit" in target.read_text()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    res = CliRunner().invoke(lua_group, ["render", "--out", str(fifo)])
    reader.join(10)
    assert res.exit_code == 0 and stat.S_ISFIFO(os.lstat(fifo).st_mode) and b"slurm_job_submit" in got[0]


def test_contrib_samples_are_current_renders(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(lua_group, ["render", "--out", str(tmp_path / "job_submit.lua")],
                         env={"SLURMGPU_CONFIG": str(SAMPLE)}).exit_code == 0
    assert (tmp_path / "job_submit.lua").read_text() == (ROOT / "contrib" / "lua" / "job_submit.lua").read_text()
    res = runner.invoke(render_serve_cmd, ["--out", str(tmp_path), "--bin", "/usr/local/bin/slurmgpu"])
    assert res.exit_code == 0, res.output
    unit = (tmp_path / "slurmgpu-serve.service").read_text()
    assert unit == (ROOT / "contrib" / "systemd" / "slurmgpu-serve.service").read_text()
    assert "RuntimeDirectory=slurmgpu\n" in unit and "--run-as slurmgpu" in unit
    res = runner.invoke(render_serve_cmd, ["--out", str(tmp_path), "--socket", "/var/lib/sg/s.sock", "--bin", "/x"])
    assert "ReadWritePaths=/var/lib/sg\n" in (tmp_path / "slurmgpu-serve.service").read_text()


def test_ask_gives_none_when_nobody_answers(sock: str) -> None:
    assert serve.ask(sock, {}) is None
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock)
    listener.listen()
    try:
        t0 = time.monotonic()
        assert serve.ask(sock, {}, timeout_s=0.2) is None
        assert time.monotonic() - t0 < 1.0
    finally:
        listener.close()


def test_gsbatch_takes_the_daemon_fast_path_and_falls_back_without_it(sock: str, model_config: Config,
                                                                      bundle: Bundle, tmp_path: Path) -> None:
    """With the socket there, gsbatch's decision comes from the daemon; without an answer, from
    the model in its own process — and both decide the same."""
    from test_gsbatch import Recorder
    from test_models import script_for

    from slurmgpu.apps import site

    model = tmp_path / "model.json"
    bundle.save(str(model))
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"', 1))
    script = tmp_path / "job.sh"
    script.write_text(script_for("resnet", 16, 1000, "a100"))
    env = {"SLURMGPU_CONFIG": str(config), "SLURMGPU_MODEL": str(model), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path),
           "SLURMGPU_SOCKET": sock, "USER": "ann", "XDG_CACHE_HOME": str(tmp_path)}
    loaded = load_config(config)
    service = serve.Service(loaded, str(model), free_gpus=lambda: BUSY_A100)
    with daemon(sock, service):
        assert isinstance(site.site_decider(loaded, Recorder(), env), site.DaemonDecider)
        request = build_request(parse_script(script.read_bytes(), str(script)), [], {}, loaded.gpu_features())
        via_daemon = site.site_decider(loaded, Recorder(), env).decide(request)
        assert service.count == 1
    local = ModelDecider(loaded, bundle, lambda: BUSY_A100, "ann").decide(request)
    assert via_daemon.changes == local.changes and via_daemon.changed
    assert [c.gpu_type for c in via_daemon.per_type] == [c.gpu_type for c in local.per_type]
    # The daemon is gone but its socket path lingers: gsbatch decides in-process instead.
    open(sock, "w").close()
    fallback = site.site_decider(loaded, Recorder(), env).decide(request)
    assert fallback.decider == "model" and fallback.per_type


def _plans(tmp_path: Path, sock: str, script_text: str, extra: list[str]) -> tuple[list[dict], list[dict]]:
    """gsbatch on the same job twice, through the daemon's plan and in its own process:
    what sbatch was given and what was recorded, each time."""
    from test_gsbatch import Recorder

    from slurmgpu.apps import gsbatch

    script = tmp_path / "job.sh"
    script.write_text(script_text)
    out = []
    for spool, socket_path in (("via-daemon", sock), ("in-process", str(tmp_path / "no.sock"))):
        (tmp_path / spool).mkdir()
        env = {"SLURMGPU_CONFIG": str(SAMPLE), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / spool),
               "SLURMGPU_SOCKET": socket_path, "XDG_CACHE_HOME": str(tmp_path / "cache"), "SBATCH_TIMELIMIT": "5"}
        backend = Recorder()
        code = gsbatch.main([*extra, str(script)], env=env, backend=backend)
        records = [json.loads(p.read_text()) for p in (tmp_path / spool).iterdir()]
        for r in records:
            del r["record_id"], r["submitted_at"]
        calls = [{**c, "env": {k: v for k, v in c["env"].items() if k not in env},  # the private copy's
                  "words": [os.path.basename(w) if "/gsbatch-" in w else w for w in c["words"]]}  # dir is random
                 for c in backend.calls]
        out.append({"code": code, "calls": calls, "records": records})
    return out[0], out[1]


@pytest.mark.parametrize("script_text, extra", [
    ("#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\nsrun train.py\n", []),  # rewritten
    ("#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:2\nsrun train.py\n", ["--parsable"]),  # kept
    ("#!/bin/bash\n#SBATCH --gres=gpu:a100:1\nsrun train.py\n", ["-p", "gpu-small"]),  # rewritten on the CLI
])
def test_gsbatch_fast_path_plan_from_the_daemon_equals_the_in_process_plan(rules: Config, sock: str,
                                                                          tmp_path: Path, script_text: str,
                                                                          extra: list[str]) -> None:
    service = serve.Service(load_config(SAMPLE))
    with daemon(sock, service):
        via_daemon, in_process = _plans(tmp_path, sock, script_text, extra)
    assert service.count == 1  # the daemon made the first plan; the second was made in-process
    assert via_daemon == in_process
    assert via_daemon["code"] == 0 and len(via_daemon["records"]) == 1


def test_the_daemon_plan_reports_bad_input_as_gsbatch_does_and_never_another_config(
        rules: Config, sock: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    service = serve.Service(load_config(SAMPLE))
    with daemon(sock, service):
        via_daemon, in_process = _plans(tmp_path, sock, "#!/bin/bash\n#SBATCH --gres=gpu:a100:two\n", [])
        assert service.count == 1
        other = tmp_path / "other.toml"
        other.write_text(SAMPLE.read_text())
        [reply] = exchange(sock, json.dumps({"op": "plan", "config": str(other), "script": "#!/bin/sh\n",
                                             "options": [], "env": {}}).encode() + b"\n")
    assert via_daemon == in_process and via_daemon["code"] == 1 and via_daemon["calls"] == []
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gsbatch: error:")]
    assert len(errors) == 2 and errors[0] == errors[1] and "gres" in errors[0]
    assert reply is not None and reply["ok"] is False and "this daemon serves" in reply["error"]


# --- who asks, where a job may go, and one client never stalls the others ------------------------

DECIDE_AS_ROOT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
s.connect(sys.argv[1])
job = {"script": "#!/bin/bash\\ntrue\\n", "tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small",
       "user_name": "root", "user_id": 0}
s.sendall(json.dumps({"op": "decide", "job": job}).encode() + b"\\n")
print(s.makefile().readline().strip() or "null")
"""


def test_the_user_comes_from_the_kernel_not_the_request(rules: Config, sock: str, test_users: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A group member claiming to be root is logged (and decided) as itself; root, as slurmctld's
    hook does, speaks for the job's user_id."""
    import logging

    caplog.set_level(logging.INFO, logger="slurmgpu.apps.serve")
    member = pwd.getpwnam("sgserve-in")
    with daemon(sock, serve.Service(rules), serve_socket.access_for(test_users, None, None)):
        res = subprocess.run(["/usr/bin/python3", "-I", "-c", DECIDE_AS_ROOT, sock], capture_output=True, text=True,
                             timeout=20, user=member.pw_uid, group=member.pw_gid,
                             extra_groups=os.getgrouplist("sgserve-in", member.pw_gid), check=True)
        assert json.loads(res.stdout)["ok"]
        assert serve.ask(sock, {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:v100:1",
                                "user_name": "mallory", "user_id": member.pw_uid})
    lines = [r.getMessage() for r in caplog.records if "latency_ms" in r.getMessage()]
    assert len(lines) == 2, lines
    assert f'user="sgserve-in" uid={member.pw_uid} via=peer' in lines[0] and '"root"' not in lines[0]
    assert f'user="sgserve-in" uid={member.pw_uid} via=slurmctld' in lines[1] and "mallory" not in lines[1]


def test_identify() -> None:
    peer = serve.Peer(1, 4242, 4242, trusted=False)
    job = {"job": {"user_name": "root", "user_id": 0}}
    assert serve.identify(job, peer) == serve.Who(None, 4242, "peer")  # no passwd entry: the uid alone
    assert serve.identify(job, peer._replace(trusted=True)) == serve.Who("root", 0, "slurmctld")
    assert serve.identify({"job": {"user_name": "root"}}, peer._replace(uid=0, trusted=True)).name == "root"
    assert serve.identify({"user": "root"}, peer._replace(uid=0)) == serve.Who("root", 0, "peer")


def test_a_job_moves_only_to_a_partition_that_admits_it(rules: Config) -> None:
    from test_partitions import variant

    moved = {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small",
             "user_id": 0, "account": "ml", "qos": "normal", "time_limit": 120}
    cases = [
        ({}, {}, {"partition": "gpu"}),
        ({"AllowAccounts": "physics"}, {}, {}),
        ({"AllowAccounts": "physics"}, {"account": "physics"}, {"partition": "gpu"}),
        ({"DenyQos": "normal"}, {}, {}),
        ({"MaxTime": "01:00:00"}, {}, {}),
        ({"MaxTime": "01:00:00"}, {"time_limit": 60}, {"partition": "gpu"}),
        ({"State": "DOWN"}, {}, {}),
        ({}, {"req_nodes": "gpu2"}, {}),  # gpu2 is not in partition gpu
        ({}, {"req_nodes": "gpu1"}, {"partition": "gpu"}),
    ]
    for fields, extra, apply in cases:
        service = serve.Service(rules, partitions=lambda f=fields: variant("gpu", **f))  # type: ignore[misc]
        service.refresh_free()
        decision = service.decide({**moved, **extra})
        assert decision["apply"] == apply, (fields, extra, decision["reasons"])
    def broken() -> dict:
        raise OSError("scontrol: not found")

    service = serve.Service(rules, partitions=broken)
    service.refresh_free()
    decision = service.decide(moved)
    assert decision["apply"] == {} and "rules are unknown (scontrol: not found)" in decision["reasons"][-1]
    assert service.health()["partitions"] == {"read": False, "names": [], "error": "scontrol: not found"}


def test_users_and_groups_are_looked_up_once_per_refresh_of_the_cluster_view(rules: Config,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A passwd or group lookup (NSS: files, LDAP) per decision cost more than the decision: a uid's
    name and a user's groups are looked up once per refresh, with the partition rules that name
    the groups, and a user's new group counts from the next refresh."""
    from test_partitions import variant

    groups, looked_up = {"ann": frozenset({"users"})}, []

    def user_groups(user: str | None, uid: int | None) -> frozenset[str] | None:
        looked_up.append((user, uid))
        return groups.get(user or "")

    monkeypatch.setattr(serve, "user_groups", user_groups)
    monkeypatch.setattr(serve, "_uid_name", lambda uid: looked_up.append(uid) or {4242: "ann"}.get(uid))
    service = serve.Service(rules, partitions=lambda: variant("gpu", AllowGroups="physics"))
    service.refresh_free()
    line = json.dumps({"op": "decide", "job": {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:v100:1",
                                               "partition": "gpu-small", "user_id": 4242}}).encode()
    hook = serve.Peer(1, 0, 0, trusted=True)
    for _ in range(3):
        assert service.handle(line, hook)["decision"]["apply"] == {}
    assert looked_up == [4242, ("ann", 4242)]
    groups["ann"] = frozenset({"users", "physics"})
    assert service.handle(line, hook)["decision"]["apply"] == {}  # until the next refresh
    service.refresh_free()
    assert service.handle(line, hook)["decision"]["apply"] == {"partition": "gpu"}
    assert looked_up == [4242, ("ann", 4242)] * 2


def test_a_huge_or_stalled_client_does_not_stall_the_daemon(rules: Config, sock: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests over the limit get a one-line error; a client that stops mid-line holds only its
    own connection (and is answered when its time is up); health answers meanwhile."""
    monkeypatch.setattr(serve_socket, "READ_TIMEOUT_S", 1.0)
    huge = b'{"op": "decide", "job": {"script": "' + b"#" * (1800 << 10) + b'"}}\n'
    with daemon(sock, serve.Service(rules)):
        stalled = socket.socket(socket.AF_UNIX)
        stalled.connect(sock)
        stalled.sendall(b'{"op": "decide", "job": {"script": "#!/bin/bash')  # and nothing more
        replies: list[dict | None] = []

        def send_huge() -> None:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(sock)
                try:
                    s.sendall(huge)
                except OSError:  # answered and hung up on before the whole request was sent
                    pass
                line = s.makefile("rb").readline()
                replies.append(json.loads(line) if line else None)

        senders = [threading.Thread(target=send_huge) for _ in range(8)]
        t0 = time.monotonic()
        for t in senders:
            t.start()
        waits = []
        while any(t.is_alive() for t in senders) or not waits:
            t1 = time.monotonic()
            assert serve.call(sock, {"op": "health"}, timeout_s=2.0), "health did not answer within 2 s"
            waits.append(time.monotonic() - t1)
        for t in senders:
            t.join(10)
        assert len(replies) == 8 and all(r and "request longer than 262144 bytes" in r["error"] for r in replies)
        stalled.settimeout(5)
        answer = json.loads(stalled.makefile("rb").readline())
        assert "not complete within 1 s" in answer["error"]
        stalled.close()
        print(f"\n8 x 1.8 MB requests in {time.monotonic() - t0:.2f} s; {len(waits)} health checks meanwhile, "
              f"slowest {max(waits) * 1000:.1f} ms")


def test_a_large_request_is_answered_by_a_worker_and_in_order(rules: Config, sock: str) -> None:
    script = "#!/bin/bash\n" + "# padding\n" * 3000 + "srun x\n"  # ~30 KiB: beyond the inline size
    big = json.dumps({"op": "decide", "job": {"script": script, "tres_per_node": "gres:gpu:v100:1",
                                              "partition": "gpu-small"}}).encode() + b"\n"
    with daemon(sock, serve.Service(rules)):
        replies = exchange(sock, big, b'{"op": "health"}\n', big)
    assert [r and r["ok"] for r in replies] == [True, True, True]
    assert replies[0]["decision"]["apply"] == {"partition": "gpu"} and "uptime_s" in replies[1]


@pytest.mark.slurm
def test_gsbatch_in_process_moves_partitions_only_with_the_live_clusters_rules(bundle: Bundle, tmp_path: Path) -> None:
    """With ``move_partitions``, gsbatch's own decider asks Slurm (scontrol) which partitions admit
    the job; without it, it is given no rules and moves nothing across partitions."""
    from test_gsbatch import Recorder
    from test_models import script_for

    from slurmgpu.apps import site

    model = tmp_path / "model.json"
    bundle.save(str(model))
    env = {"SLURMGPU_MODEL": str(model), "USER": "root", "XDG_CACHE_HOME": str(tmp_path)}
    text = script_for("resnet", 16, 1000, "v100").replace("#SBATCH -t", "#SBATCH --nodelist=gpu1\n#SBATCH -t")
    moving = with_model(load_config(SAMPLE))
    moving = moving._replace(policy=moving.policy._replace(move_partitions=True))
    request = build_request(parse_script(text.encode(), "job.sh"), [], {}, moving.gpu_features())
    decider = site.local_decider(moving, Recorder(), env, "root")
    assert isinstance(decider, ModelDecider) and decider.admits is not None
    assert decider.admits("gpu", request.main) is None and decider.admits("debug", request.main) is None
    assert "gpu1" in (decider.admits("gpu-small", request.main) or "")  # gpu-small is gpu2 alone
    assert decider.admits("nowhere", request.main) == "Slurm has no partition nowhere"
    assert site.local_decider(with_model(load_config(SAMPLE)), Recorder(), env, "root").admits is None  # type: ignore[attr-defined]
