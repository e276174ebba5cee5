"""The daemon's client side, kept apart from the server so gsbatch imports only this."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from slurmgpu.typing_lite import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

DEFAULT_SOCKET = "/run/slurmgpu/slurmgpu.sock"
MAX_REQUEST_BYTES = 256 << 10  # one request line; the hook cuts the script to fit, gsbatch plans in-process
MAX_REPLY_BYTES = 4 << 20  # a plan's reply carries the rewritten script


def call(socket_path: str, message: Mapping[str, Any], timeout_s: float = 1.0) -> dict[str, Any] | None:
    """Send one request on a fresh connection; the reply, or None on any failure, on a reply over
    ``MAX_REPLY_BYTES``, or when the whole exchange is not done within ``timeout_s``: connect, send
    and every recv are held to one absolute deadline, so a daemon that trickles its answer a byte at
    a time costs no more than one that never answers."""
    # The C module behind `socket`: the wrapper's enum set-up costs gsbatch a few milliseconds on
    # every submission, more than the round trip, and plain connect/send/recv need none of it.
    import _socket

    deadline = time.monotonic() + timeout_s

    def left() -> float:
        """Seconds to the deadline; TimeoutError (an OSError) once it has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(left())
            sock.connect(socket_path)
            sock.settimeout(left())  # sendall's timeout bounds the whole send, not each chunk
            sock.sendall(json.dumps(message, separators=(",", ":")).encode("utf-8", "surrogateescape") + b"\n")
            data, chunk = bytearray(), b""
            while b"\n" not in chunk and len(data) <= MAX_REPLY_BYTES:
                sock.settimeout(left())
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        finally:
            sock.close()
        line = data.partition(b"\n")[0]
        if len(line) > MAX_REPLY_BYTES:
            return None
        reply = json.loads(line)
    except (OSError, ValueError):
        return None
    return reply if isinstance(reply, dict) else None


# How long gsbatch may spend on the daemon in all, per submission (its plan, then its decision when
# the plan was not taken), before planning in-process: the daemon answers in a few ms (docs/benchmarks.md,
# the daemon under load); a hung or trickling one must cost a submission no more than this.
PLAN_TIMEOUT_S = 0.25


def ask(socket_path: str, job: Mapping[str, Any], timeout_s: float = 0.2) -> dict[str, Any] | None:
    """The daemon's decision for a job (see slurmgpu.apps.serve), or None when it cannot say."""
    reply = call(socket_path, {"op": "decide", "job": dict(job)}, timeout_s)
    if reply and reply.get("ok") and isinstance(reply.get("decision"), dict):
        return reply["decision"]
    return None
