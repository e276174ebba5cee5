"""``slurmgpu doctor``: every check against injected fakes (paths, runners, loaders, a real Unix
socket served by a thread), the command's wiring, and one run against the real local cluster."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurmgpu.apps import doctor
from slurmgpu.apps.doctor import FAIL, OK, WARN, compare_with_cluster
from slurmgpu.cli.main import main
from slurmgpu.cli.report import doctor_cmd
from slurmgpu.history import db
from slurmgpu.pipeline.config import Config, load_config
from slurmgpu.slurm.backend import NodeInfo, SlurmError, select_backend

SAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml"
NOW = datetime(2026, 6, 1, 12, 0)
main.add_command(doctor_cmd)  # as cli.py registers it; harmless when it already has


@pytest.fixture
def config() -> Config:
    return load_config(SAMPLE)


def local_cluster() -> list[NodeInfo]:
    """The layout contrib/local-slurm/cluster.sh builds (and the sample config describes)."""
    return [NodeInfo("gpu1", ("gpu", "debug"), {"a100": 4, "v100": 4}, "idle", ("a100", "a100-80gb", "v100")),
            NodeInfo("gpu2", ("gpu-small", "debug"), {"t4": 4}, "idle", ("t4",)),
            NodeInfo("gpu3", ("mig",), {"a100_1g.10gb": 4, "a100_3g.40gb": 2}, "idle",
                     ("mig", "a100_1g.10gb", "a100_3g.40gb"))]


def test_config_missing_invalid_valid(tmp_path: Path) -> None:
    check, cfg = doctor.check_config(None, load_config)
    assert (check.status, cfg) == (FAIL, None) and "SLURMGPU_CONFIG" in check.advice
    bad = tmp_path / "bad.toml"
    bad.write_text("[gpu_types.a100]\nmemory_gib = -1\n")
    check, cfg = doctor.check_config(str(bad), load_config)
    assert check.status == FAIL and "gpu_types.a100.memory_gib: must be > 0" in check.detail and cfg is None
    check, _ = doctor.check_config(str(tmp_path / "absent.toml"), load_config)
    assert check.status == FAIL and "config file not found" in check.detail
    check, cfg = doctor.check_config(str(SAMPLE), load_config)
    assert check.status == OK and "5 GPU types, 3 partitions" in check.detail and cfg is not None


def test_cluster_check(config: Config) -> None:
    assert doctor.check_cluster(None, local_cluster, compare_with_cluster).status == WARN
    assert doctor.check_cluster(config, local_cluster, compare_with_cluster).status == OK

    def down() -> list[NodeInfo]:
        raise SlurmError("sinfo: error: Unable to contact slurm controller")

    check = doctor.check_cluster(config, down, compare_with_cluster)
    assert check.status == FAIL and "Unable to contact" in check.detail and "slurmctld" in check.advice
    small = [NodeInfo("n1", ("gpu",), {"a100": 2, "h100": 1})]
    check = doctor.check_cluster(config, lambda: small, compare_with_cluster)
    assert check.status == FAIL and check.detail.startswith("partition gpu: GPU type v100 is configured")
    assert "(and 4 more)" in check.detail  # also: 2 a100 per node where the config says 4; no mig


def test_backend_check_says_which_and_why(monkeypatch) -> None:
    import sys
    import types

    from slurmgpu.slurm import backend

    monkeypatch.setattr(backend.CliBackend, "version", lambda self: "22.05.8")
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setitem(sys.modules, "pyslurm", types.SimpleNamespace(__version__="24.11.0"))
    check = doctor.check_backend({"SLURMGPU_BACKEND": "auto"}, backend.choose_backend)
    assert check == ("slurm backend", OK, "command-line tools (pyslurm 24.11.0 does not match Slurm 22.05.8)", "")
    asked = doctor.check_backend({"SLURMGPU_BACKEND": "pyslurm"}, backend.choose_backend)
    assert asked.status == WARN and "make pyslurm" in asked.advice
    assert doctor.check_backend({"SLURMGPU_BACKEND": "cli"}, backend.choose_backend).detail == \
        "command-line tools (SLURMGPU_BACKEND=cli)"
    assert doctor.check_backend({"SLURMGPU_BACKEND": "fast"}, backend.choose_backend).status == WARN
    monkeypatch.setitem(sys.modules, "pyslurm", types.SimpleNamespace(__version__="22.5.3"))
    assert doctor.check_backend({}, backend.choose_backend).detail == "pyslurm (pyslurm 22.5.3 matches Slurm 22.05.8)"
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import fails
    assert "pyslurm is not importable" in doctor.check_backend({}, backend.choose_backend).detail


def test_database_check(tmp_path: Path) -> None:
    head = db.head_revision()
    missing = tmp_path / "none.db"
    check = doctor.check_database(f"sqlite:///{missing}", db.current_revision, head, str(missing))
    assert check.status == FAIL and "slurmgpu db upgrade" in check.advice and not missing.exists()

    def unreachable(url: str) -> str:
        raise ConnectionRefusedError("connection refused\nmore detail")

    check = doctor.check_database("postgresql://x", unreachable, head)
    assert check.status == FAIL and check.detail == "unreachable: ConnectionRefusedError: connection refused"
    assert doctor.check_database("u", lambda u: None, head).detail == "reachable but empty (no schema)"
    old = doctor.check_database("u", lambda u: "0000_old", head)
    assert old.status == FAIL and old.detail == f"at revision 0000_old, code needs {head}"
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    assert doctor.check_database(url, db.current_revision, head, str(tmp_path / "h.db")).status == OK


def _boom(path: str) -> Any:
    raise ValueError("model was trained with other features than this code builds (stale model): retrain")


def test_model_check(tmp_path: Path, config: Config) -> None:
    model_on = config._replace(policy=config.policy._replace(decider="model"))
    path = str(tmp_path / "model.json")
    assert doctor.check_model(path, config, _boom, None, NOW).status == WARN  # rules decider: optional
    check = doctor.check_model(path, model_on, _boom, None, NOW)
    assert check.status == FAIL and "slurmgpu train" in check.advice
    Path(path).write_text("{}")
    check = doctor.check_model(path, model_on, _boom, None, NOW)
    assert check.status == FAIL and "stale model" in check.detail
    check = doctor.check_model(path, model_on, lambda p: None, NOW - timedelta(days=30), NOW, max_age_days=14)
    assert check.status == WARN and "trained 30 days ago" in check.detail and "nightly" in check.advice
    assert doctor.check_model(path, model_on, lambda p: None, NOW - timedelta(days=2), NOW).status == OK
    # Without a registry record the file's age counts.
    now = db.utcnow()
    assert doctor.check_model(path, model_on, lambda p: None, None, now).status == OK
    old = time.time() - 20 * 86400
    os.utime(path, (old, old))
    assert doctor.check_model(path, model_on, lambda p: None, None, now).status == WARN


@pytest.fixture
def sock_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="sgd-", dir="/tmp")  # AF_UNIX paths must stay short
    yield directory
    shutil.rmtree(directory)


def serve(path: str, answer: Callable[[bytes], bytes | None]) -> threading.Thread:
    """A one-connection daemon stand-in: reads a line, replies with answer(line) (None: stays silent)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def run() -> None:
        conn, _ = server.accept()
        with conn:
            line = conn.makefile("rb").readline()
            reply = answer(line)
            if reply is None:
                time.sleep(1.0)
            else:
                conn.sendall(reply)
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_daemon_check(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "s.sock")
    absent = doctor.check_daemon(path)
    assert absent.status == WARN and absent.detail == f"not installed (no socket at {path})"
    seen: list[bytes] = []
    t = serve(path, lambda line: seen.append(line) or b'{"ok": true, "model_version": 3}\n')
    assert doctor.check_daemon(path).status == OK
    t.join()
    assert seen == [b'{"op":"health"}\n']
    os.unlink(path)
    t = serve(path, lambda line: b'{"ok": false, "error": "model not loaded"}\n')
    check = doctor.check_daemon(path)
    assert check.status == FAIL and "model not loaded" in check.detail
    t.join()
    os.unlink(path)
    t = serve(path, lambda line: None)
    check = doctor.check_daemon(path, timeout=0.2)
    assert check.status == FAIL and "no answer within 0.2 s" in check.detail
    t.join()
    # The server is gone, its socket file is not: a daemon that died.
    check = doctor.check_daemon(path)
    assert check.status == FAIL and "not running" in check.advice


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_daemon_permission_advice_names_the_group_never_0666(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "p.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        os.chmod(path, 0o660)  # as slurmgpu serve leaves it: owner and group only
        os.chmod(sock_dir, 0o755)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # an ordinary user outside the socket's group
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            check = doctor.check_daemon(path)
            os.write(write, json.dumps(check._asdict()).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as fh:
            check = json.loads(fh.read())
    group = grp.getgrgid(os.stat(path).st_gid).gr_name
    assert check["status"] == FAIL and check["detail"] == f"{path}: permission denied"
    assert f"to group {group}" in check["advice"] and "never 0666" in check["advice"]


SCONTROL = "Configuration data as of 2026-06-01T12:00:00\nJobSubmitPlugins        = {plugins}\n" \
           "SLURM_CONF              = {conf}\nSlurmctldPort           = 6817\n"


def test_lua_hook_check(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"

    def scontrol(plugins: str) -> Callable[[list[str]], str]:
        return lambda argv: SCONTROL.format(plugins=plugins, conf=conf) if argv == ["scontrol", "show", "config"] \
            else ""

    check = doctor.check_lua_hook(scontrol("(null)"))
    assert check.status == WARN and "bypass slurmgpu" in check.detail and "JobSubmitPlugins=lua" in check.advice
    check = doctor.check_lua_hook(scontrol("lua"))
    assert check.status == FAIL and "job_submit.lua" in check.detail
    (tmp_path / "job_submit.lua").write_text("function slurm_job_submit() return slurm.SUCCESS end\n")
    check = doctor.check_lua_hook(scontrol("lua"))
    assert check.status == WARN and "not slurmgpu's hook" in check.detail
    (tmp_path / "job_submit.lua").write_text("-- slurmgpu job_submit hook\n")
    assert doctor.check_lua_hook(scontrol("job_submit/pbs,job_submit/lua")).status == OK

    def broken(argv: list[str]) -> str:
        raise FileNotFoundError(2, "No such file or directory", "scontrol")

    assert doctor.check_lua_hook(broken).status == WARN


def test_spool_check(tmp_path: Path) -> None:
    now = time.time()
    check = doctor.check_spool("GPU", str(tmp_path / "absent"), now)
    assert (check.status, check.name) == (WARN, "GPU spool")
    spool = tmp_path / "spool"
    spool.mkdir()
    assert doctor.check_spool("GPU", str(spool), now).detail == f"{spool}: 0 waiting, oldest 0.0 h"
    (spool / "c_1_n1.json").write_text("{}")
    (spool / ".c_2_n1.json.123.tmp").write_text("")  # a write in progress: not counted
    old = now - 3 * 3600
    os.utime(spool / ".c_2_n1.json.123.tmp", (old - 86400 * 9, old - 86400 * 9))
    os.utime(spool / "c_1_n1.json", (old, old))
    assert doctor.check_spool("GPU", str(spool), now).detail == f"{spool}: 1 waiting, oldest 3.0 h"
    (spool / "sub-x.json.rejected").write_text("{")
    check = doctor.check_spool("submission", str(spool), now)
    assert check.status == WARN and "1 rejected" in check.detail
    stale = now - 50 * 3600
    os.utime(spool / "c_1_n1.json", (stale, stale))
    check = doctor.check_spool("submission", str(spool), now, max_age_hours=48)
    assert check.status == FAIL and "oldest 50 h" in check.detail and "slurmgpu ingest" in check.advice


def test_site_spool_modes(tmp_path: Path) -> None:
    now = time.time()
    subs = tmp_path / "submissions"
    subs.mkdir()
    os.chmod(subs, 0o1733)  # the old mode: records 0600, unreadable by the nightly account
    check = doctor.check_spool("submission", str(subs), now, site=True)
    assert check.status == FAIL and "mode 1733, not 3733 (no setgid bit" in check.detail
    assert "chmod 3733" in check.advice
    os.chmod(subs, 0o3733)
    assert doctor.check_spool("submission", str(subs), now, site=True).status == OK
    assert doctor.check_spool("submission", str(subs), now).status == OK  # a personal spool: mode not checked
    gpus = tmp_path / "gpu"
    gpus.mkdir()
    os.chmod(gpus, 0o2750)
    check = doctor.check_spool("GPU", str(gpus), now, site=True)
    assert check.status == FAIL and "not 2770" in check.detail
    link = tmp_path / "link"
    link.symlink_to(subs)
    check = doctor.check_spool("submission", str(link), now, site=True)
    assert check.status == FAIL and "not a directory" in check.detail


def test_exit_status_render_and_json() -> None:
    checks = [doctor.Check("config", OK, "fine"), doctor.Check("daemon", WARN, "absent", "install it")]
    assert doctor.exit_status(checks) == 0
    assert doctor.render(checks).splitlines() == [
        "OK    config           fine", "WARN  daemon           absent", "                       -> install it"]
    checks.append(doctor.Check("database", FAIL, "empty", "run `slurmgpu db upgrade`"))
    assert doctor.exit_status(checks) == 1
    data = json.loads(doctor.to_json(checks))
    assert data["ok"] is False and data["checks"][2] == {"name": "database", "status": "FAIL", "detail": "empty",
                                                         "advice": "run `slurmgpu db upgrade`"}


def test_doctor_command_without_slurm(tmp_path: Path, sock_dir: str) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    (tmp_path / "gpu").mkdir()
    env = {"PATH": "/nonexistent", "SLURMGPU_MODEL": str(tmp_path / "model.json"),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "sub"), "SLURMGPU_GPU_SPOOL": str(tmp_path / "gpu")}
    res = CliRunner(env=env).invoke(main, ["--config", str(SAMPLE), "--db", url, "doctor", "--json",
                                           "--socket", os.path.join(sock_dir, "none.sock")])
    data = json.loads(res.output)
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses == {"config": OK, "cluster": FAIL, "slurm backend": OK, "database": OK, "model": WARN,
                        "daemon": WARN, "lua hook": WARN, "collector": WARN, "submission spool": WARN, "GPU spool": OK}
    assert res.exit_code == 1 and data["ok"] is False
    plain = CliRunner(env=env).invoke(main, ["--config", str(SAMPLE), "--db", url, "doctor", "--socket",
                                             os.path.join(sock_dir, "none.sock")])
    assert plain.exit_code == 1 and "FAIL  cluster          cannot ask Slurm: sinfo not found on PATH" in plain.output


@pytest.mark.slurm
def test_doctor_on_the_local_cluster(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    res = CliRunner(env={"SLURMGPU_MODEL": str(tmp_path / "model.json")}).invoke(
        main, ["--config", str(SAMPLE), "--db", url, "doctor", "--json", "--socket", str(tmp_path / "none.sock")])
    data = json.loads(res.output)
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["cluster"]["status"] == OK, checks["cluster"]
    expected = "pyslurm" if select_backend().name == "pyslurm" else "command-line tools"
    assert checks["slurm backend"]["status"] == OK and checks["slurm backend"]["detail"].startswith(expected)
    assert checks["database"]["status"] == OK
    # The local cluster runs a pass-through job_submit.lua (JobSubmitPlugins=lua): a hook, not slurmgpu's.
    assert checks["lua hook"]["status"] in (OK, WARN) and "job_submit.lua" in checks["lua hook"]["detail"]
    assert res.exit_code == (1 if any(c["status"] == FAIL for c in checks.values()) else 0)
