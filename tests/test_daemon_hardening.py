"""The daemon and its clients under hostile or broken peers (issue 27): a hung or trickling daemon
costs gsbatch one deadline in all, and its replies are capped."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_gsbatch import Recorder
from test_serve import SAMPLE, socket_dir

from slurmgpu.apps import daemon_client, gsbatch


@pytest.fixture
def sock() -> Iterator[str]:
    directory = socket_dir()
    yield os.path.join(directory, "slurmgpu.sock")
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


@contextmanager
def fake_daemon(path: str, reply: bytes = b"", trickle: bool = False, stop_after_s: float = 8.0) -> Iterator[list]:
    """A daemon that accepts, sends ``reply`` and then nothing (hung) or a byte every 0.2 ms
    (trickling), never a newline; yields the list of connections it accepted. It stops by itself
    after ``stop_after_s`` whatever the client does."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(0.05)
    stop = threading.Event()
    accepted: list[socket.socket] = []

    def feed(conn: socket.socket) -> None:
        try:
            conn.sendall(reply)
            while trickle and not stop.is_set():
                conn.send(b"a")
                time.sleep(0.0002)
        except OSError:  # the client hung up
            pass

    def serve() -> None:
        end = time.monotonic() + stop_after_s
        while not stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
            threading.Thread(target=feed, args=(conn,), daemon=True).start()
        stop.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in accepted:
            conn.close()


def test_a_trickling_daemon_costs_no_more_than_the_timeout(sock: str) -> None:
    """Each recv used to get a fresh (at least 1 ms) timeout, so a byte every 0.2 ms kept the
    client reading until the reply cap: seconds for a 0.25 s budget."""
    with fake_daemon(sock, b'{"ok": true, "pad": "', trickle=True):
        t0 = time.monotonic()
        assert daemon_client.call(sock, {"op": "health"}, timeout_s=0.25) is None
        assert time.monotonic() - t0 < 1.0


def test_a_reply_over_the_cap_is_refused(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply one byte over MAX_REPLY_BYTES is not believed, even when whole and valid JSON."""
    monkeypatch.setattr(daemon_client, "MAX_REPLY_BYTES", 1000)
    def reply(size: int) -> bytes:
        head = b'{"ok": true, "pad": "'
        return head + b"x" * (size - len(head) - 2) + b'"}'

    with fake_daemon(sock, reply(1001) + b"\n"):
        assert daemon_client.call(sock, {"op": "health"}) is None
    os.unlink(sock)
    with fake_daemon(sock, reply(1000) + b"\n"):  # at the cap: believed
        assert daemon_client.call(sock, {"op": "health"}) == {"ok": True, "pad": "x" * (1000 - 23)}


@pytest.mark.parametrize("trickle", [False, True], ids=["hung", "trickling"])
def test_gsbatch_spends_one_deadline_on_the_daemon_in_all(sock: str, tmp_path: Path, trickle: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that never answers was asked twice in a row (its plan, then its decision), each with
    the whole budget; now the decision gets what is left of the plan's deadline: nothing."""
    monkeypatch.setattr(daemon_client, "PLAN_TIMEOUT_S", 1.0)
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"', 1))
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\nsrun train.py\n")
    env = {"SLURMGPU_CONFIG": str(config), "SLURMGPU_MODEL": str(tmp_path / "none.json"),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path), "SLURMGPU_SOCKET": sock, "XDG_CACHE_HOME": str(tmp_path)}
    backend = Recorder()
    with fake_daemon(sock, b'{"ok": true, "pad": "' if trickle else b"", trickle=trickle) as accepted:
        t0 = time.monotonic()
        assert gsbatch.main([str(script)], env=env, backend=backend) == 0
        took = time.monotonic() - t0
    assert len(accepted) == 1  # the plan; no time was left to ask for the decision
    assert took < 1.8, f"{took:.2f} s for a 1 s budget"
    assert len(backend.calls) == 1 and "--gres=gpu:a100:1" in backend.calls[0]["content"].decode()
