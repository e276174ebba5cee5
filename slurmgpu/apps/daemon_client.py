"""The daemon's client side, kept apart from the server so gsbatch imports only this."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

DEFAULT_SOCKET = "/run/slurmgpu/slurmgpu.sock"
MAX_REQUEST_BYTES = 256 << 10  # one request line; the hook cuts the script to fit, gsbatch plans in-process
MAX_REPLY_BYTES = 4 << 20  # a plan's reply carries the rewritten script


def call(socket_path: str, message: Mapping[str, Any], timeout_s: float = 1.0) -> dict[str, Any] | None:
    """Send one request on a fresh connection; the reply, or None on any failure or timeout."""
    # The C module behind `socket`: the wrapper's enum set-up costs gsbatch a few milliseconds on
    # every submission, more than the round trip, and plain connect/send/recv need none of it.
    import _socket

    deadline = time.monotonic() + timeout_s
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(socket_path)
            sock.sendall(json.dumps(message, separators=(",", ":")).encode("utf-8", "surrogateescape") + b"\n")
            data = b""
            while not data.endswith(b"\n") and len(data) <= MAX_REPLY_BYTES:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        finally:
            sock.close()
        reply = json.loads(data)
    except (OSError, ValueError):
        return None
    return reply if isinstance(reply, dict) else None


# How long gsbatch waits for the daemon before planning in-process: the daemon answers in a few ms
# (README, Benchmarks); a hung one must cost a submission well under half a second.
PLAN_TIMEOUT_S = 0.25


def ask(socket_path: str, job: Mapping[str, Any], timeout_s: float = 0.2) -> dict[str, Any] | None:
    """The daemon's decision for a job (see slurmgpu.apps.serve), or None when it cannot say."""
    reply = call(socket_path, {"op": "decide", "job": dict(job)}, timeout_s)
    if reply and reply.get("ok") and isinstance(reply.get("decision"), dict):
        return reply["decision"]
    return None
