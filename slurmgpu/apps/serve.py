"""``slurmgpu serve``: GPU decisions over a Unix socket, for slurmctld's job_submit.lua and gsbatch.

Why a daemon: a job_submit.lua hook runs inside slurmctld and must answer in milliseconds, and
gsbatch spends most of its time starting Python and loading the config and model. The daemon
loads both once, reloads the model when its file changes (checked every few seconds, in the
background, so no request waits or is dropped), and answers each decision in a few milliseconds.

Protocol: UTF-8 JSON, one object per line, one reply line per request line; a connection may
carry several requests. A line longer than ``MAX_REQUEST_BYTES`` is answered with an error and
the connection closed. Requests:

``{"op": "health"}``
    ``{"ok": true, "version": ..., "decider": "model", "config": PATH, "requests": N,
    "uptime_s": S, "model": {"path", "loaded", "sha256", "mtime", "jobs", "window", "error"}}``
``{"op": "decide", "job": JOB}``
    ``{"ok": true, "decision": {...Decision.to_json()..., "request": TEXT, "apply": {FIELD: VALUE}}}``

Anything else, or a job that cannot be read, gets ``{"ok": false, "error": TEXT}``.

JOB is what job_submit.lua sees in ``job_desc``; every key is optional and unknown keys are
ignored. Strings: ``script`` (the batch script text), ``tres_per_node``, ``tres_per_job``,
``tres_per_task``, ``tres_per_socket`` (in either Slurm spelling: ``gres:gpu:a100:2``,
``gres/gpu=1``), ``partition``, ``account``, ``qos``, ``name``, ``features`` (--constraint),
``user_name`` (for the model's per-user history). Whole numbers: ``num_tasks``, ``min_nodes``,
``max_nodes``, ``ntasks_per_node``, ``cpus_per_task``, ``sockets_per_node``, ``time_limit``
(minutes), ``user_id`` (logged when there is no name); Slurm's NO_VAL/INFINITE mean "not set".
The fields become sbatch command-line words over the script's directives, so ``build_request``
applies sbatch's own precedence; the script's GPU directives are left out because the tres
fields already hold the job's whole GPU request. A heterogeneous job, or a script with a
``#SLURMGPU keep`` line, is answered "kept".

``apply`` holds only what changes, ready for the job descriptor: a ``tres_per_*`` field maps to
its new GPU entry without the ``gres:``/``gres/`` prefix (``gpu:v100:2``; the hook keeps the
job's own prefix and its other entries), ``partition`` to a partition name. It is empty when the
request stands, and on a refusal too (reported in ``refused``; Slurm has the last word).

Security: the socket is mode 0660, group ``--group``, in a root-owned 0755 directory, and each
peer is checked with SO_PEERCRED: only root, the daemon's own user, SlurmUser and members of the
group get answers. The daemon answers decisions and health only; it has no history queries.
"""

from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import pwd
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from slurmgpu import __version__
from slurmgpu.apps.daemon_client import DEFAULT_SOCKET, MAX_REQUEST_BYTES, ask, call  # noqa: F401 - re-exported
from slurmgpu.pipeline.bundle import Bundle  # imported here, as root: after --run-as the install may be unreadable
from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError

try:  # a long-running daemon can afford numpy: it evaluates all candidate types in one pass
    import numpy  # noqa: F401
except ImportError:  # pragma: no cover - numpy ships with the training extra
    pass
from slurmgpu.pipeline.policy import Decider, Decision, KeepDecider, make_decider
from slurmgpu.pipeline.request import GPU_OPTIONS, JobRequest, build_request
from slurmgpu.pipeline.rewrite import RewriteError, _new_gpu_value, describe
from slurmgpu.pipeline.script import encode, parse_script

IDLE_TIMEOUT_S = 60.0
FREE_GPUS_EVERY_S = 10.0
NO_VAL16, NO_VAL = 0xFFFE, 0xFFFFFFFE  # Slurm's "unset"; anything at or above is a sentinel

log = logging.getLogger("slurmgpu.apps.serve")

# job_desc field -> the sbatch option that fills it (--gpus-per-node also lands in tres_per_node)
TRES_FIELDS = {"tres_per_node": "gres", "tres_per_job": "gpus", "tres_per_task": "gpus-per-task",
               "tres_per_socket": "gpus-per-socket"}
FIELD_OF_OPTION = {option: field for field, option in TRES_FIELDS.items()}
STRING_FIELDS = {"partition": "partition", "account": "account", "qos": "qos", "name": "job-name",
                 "features": "constraint"}
COUNT_FIELDS = {"num_tasks": ("ntasks", NO_VAL), "ntasks_per_node": ("ntasks-per-node", NO_VAL16),
                "cpus_per_task": ("cpus-per-task", NO_VAL16), "sockets_per_node": ("sockets-per-node", NO_VAL16),
                "time_limit": ("time", NO_VAL)}


# --- the job descriptor as a JobRequest ----------------------------------------------------------


def gpu_entries(tres: str | None) -> list[str]:
    """The GPU entries of a tres string, as ``gpu[:type][:count]`` (``gres/gpu=1`` -> ``gpu:1``)."""
    out = []
    for item in (tres or "").split(","):
        entry = item.removeprefix("gres:").removeprefix("gres/").replace("=", ":")
        if entry == "gpu" or entry.startswith("gpu:"):
            out.append(entry)
    return out


def _string(job: Mapping[str, Any], key: str) -> str | None:
    value = job.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or "\n" in value or "\0" in value:
        raise InputError("must be a one-line string", option=key)
    return value


def _count(job: Mapping[str, Any], key: str, unset: int) -> int | None:
    value = job.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError("must be a whole number", option=key)
    return value if 0 < value < unset else None


def job_words(job: Mapping[str, Any]) -> list[str]:
    """sbatch command-line words that say what the job descriptor's fields say."""
    words = []
    for field, option in TRES_FIELDS.items():
        entries = gpu_entries(_string(job, field))
        if entries:
            values = entries if option == "gres" else [e.partition(":")[2] or "1" for e in entries]
            words.append(f"--{option}={','.join(values)}")
    for field, option in STRING_FIELDS.items():
        if (value := _string(job, field)) is not None:
            words.append(f"--{option}={value}")
    for field, (option, unset) in COUNT_FIELDS.items():
        if (count := _count(job, field, unset)) is not None:
            words.append(f"--{option}={count}")
    low, high = _count(job, "min_nodes", NO_VAL), _count(job, "max_nodes", NO_VAL)
    if low is not None:
        words.append(f"--nodes={low}-{high}" if high and high > low else f"--nodes={low}")
    return words


def job_request(job: Mapping[str, Any], gpu_features: set[str]) -> JobRequest:
    """The JobRequest of a job descriptor; raises InputError for fields that cannot be read."""
    script = None
    if (text := job.get("script")) is not None:
        if not isinstance(text, str):
            raise InputError("must be a string", option="script")
        parsed = parse_script(encode(text), "<job_submit>")
        script = parsed._replace(directives=tuple(d for d in parsed.directives if d.name not in GPU_OPTIONS))
    return build_request(script, job_words(job), {}, gpu_features)


def apply_fields(request: JobRequest, decision: Decision) -> dict[str, str]:
    """The job descriptor fields a decision changes; raises RewriteError when it cannot be said."""
    if decision.refusal or not decision.changes:
        return {}
    change, comp = decision.changes[0], request.main
    out = {}
    if change.gpu_type is not None or change.gpus_total is not None:
        ask, value = _new_gpu_value(comp, change)
        out[FIELD_OF_OPTION[ask.option]] = value if ask.option == "gres" else f"gpu:{value}"
    if change.partition is not None:
        out["partition"] = change.partition
    return out


# --- the service: model, free GPUs, decisions ---------------------------------------------------


class ModelState(NamedTuple):
    """The model in use; a failed reload keeps the previous bundle and records the error."""

    bundle: Bundle | None = None
    signature: tuple[int, int, int] | None = None
    sha256: str | None = None
    mtime: float | None = None
    error: str | None = "not loaded"


class Service:
    """Decides jobs with the config's decider and the newest usable model."""

    def __init__(self, config: Config, model_path: str | None = None,
                 free_gpus: Callable[[], Mapping[str, int]] | None = None, reload_s: float = 2.0) -> None:
        self.config, self.reload_s = config, reload_s
        self.model_path = model_path if config.policy.decider == "model" else None
        self.fetch_free = free_gpus
        self.free: Mapping[str, int] = {}  # idle GPUs per type; {} ranks by runtime alone
        self.model = ModelState()
        self.fixed: Decider | None = None if self.model_path else make_decider(config)
        self.features = config.gpu_features()
        self.started = time.monotonic()
        self.count = 0  # requests handled; only the server's one thread counts
        self.stopped = threading.Event()
        if self.model_path and not self.check_model():
            log.warning("no usable model yet (%s): requests are kept as written until one appears", self.model.error)

    def check_model(self) -> bool:
        """Load the model file when it changed; True when a new bundle is in use."""
        assert self.model_path is not None
        try:
            st = os.stat(self.model_path)
        except OSError as exc:
            self.model = self.model._replace(error=f"{self.model_path}: {exc.strerror}")
            return False
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self.model.signature:
            return False
        try:
            with open(self.model_path, "rb") as fh:
                data = fh.read()
            bundle = Bundle(json.loads(data))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.model = self.model._replace(signature=signature, error=f"{self.model_path}: {exc}")
            log.error("model %s unusable (%s); %s", self.model_path, exc,
                      "keeping the loaded one" if self.model.bundle else "requests are kept as written")
            return False
        self.model = ModelState(bundle, signature, hashlib.sha256(data).hexdigest()[:16], st.st_mtime, None)
        log.info("model %s loaded (sha256 %s, %s jobs)", self.model_path, self.model.sha256, bundle.data.get("jobs"))
        return True

    def refresh_free(self) -> None:
        """Idle GPUs from the cluster, off the request path: sinfo waits while slurmctld sits in the hook."""
        if self.fetch_free is None:
            return
        try:
            self.free = dict(self.fetch_free())
        except Exception as exc:  # noqa: BLE001 - no cluster view: keep the last one
            log.warning("idle GPU counts not refreshed: %s", exc)

    def watch(self) -> None:
        """Background loop: idle GPUs every ``FREE_GPUS_EVERY_S``, the model file every ``reload_s``."""
        next_free = 0.0
        while True:
            if time.monotonic() >= next_free:
                self.refresh_free()
                next_free = time.monotonic() + FREE_GPUS_EVERY_S
            if self.stopped.wait(self.reload_s):
                return
            self.check_model()

    def start(self) -> None:
        """Start watching the model file (only the model decider has one)."""
        if self.model_path:
            threading.Thread(target=self.watch, name="slurmgpu-watch", daemon=True).start()

    def decider(self, user: str | None) -> Decider:
        if self.fixed is not None:
            return self.fixed
        bundle = self.model.bundle
        if bundle is None:
            return KeepDecider(f"model unusable ({self.model.error}); request kept")
        return make_decider(self.config, bundle, lambda: self.free, user)

    def decide(self, job: Mapping[str, Any]) -> dict[str, Any]:
        """The reply to a decide request (raises InputError for an unreadable job)."""
        request = job_request(job, self.features)
        script = request.script
        if request.is_hetjob:
            decision = KeepDecider("heterogeneous job: its components reach the hook one by one; "
                                   "request kept").decide(request)
        elif script is not None and script.keep_marker:
            decision = KeepDecider("the script says '#SLURMGPU keep'; request kept").decide(request)
        else:
            user = job.get("user_name") if isinstance(job.get("user_name"), str) else None
            decision = self.decider(user).decide(request)
        try:
            apply = apply_fields(request, decision)
        except RewriteError as exc:
            decision = decision._replace(changes=(), reasons=(*decision.reasons, f"not applied: {exc}"))
            apply = {}
        return {**decision.to_json(), "request": describe(request.main), "apply": apply}

    def health(self) -> dict[str, Any]:
        m = self.model
        bundle = m.bundle
        return {
            "ok": True, "version": __version__, "decider": self.config.policy.decider, "config": self.config.path,
            "requests": self.count, "uptime_s": round(time.monotonic() - self.started, 1),
            "model": None if self.model_path is None else {
                "path": self.model_path, "loaded": bundle is not None, "sha256": m.sha256,
                "mtime": datetime.fromtimestamp(m.mtime, UTC).isoformat() if m.mtime else None,
                "jobs": bundle.data.get("jobs") if bundle else None,
                "window": bundle.data.get("window") if bundle else None, "error": m.error},
        }

    def handle(self, line: bytes) -> dict[str, Any]:
        """One request line to one reply; never raises, logs each decision."""
        t0 = time.perf_counter()
        self.count += 1
        job: Any = {}
        try:
            message = json.loads(line.decode("utf-8", "surrogateescape"))
            op = message.get("op") if isinstance(message, dict) else None
            if op == "health":
                return self.health()
            if op != "decide":
                raise InputError(f"unknown op {op!r} (expected 'decide' or 'health')")
            if not isinstance(message.get("job"), dict):
                raise InputError("'job' must be an object")
            job = message["job"]
            decision = self.decide(job)
        except (InputError, ValueError, UnicodeError, RecursionError) as exc:
            self._log(job, t0, error=str(exc))
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a fault of ours must not take the daemon down
            log.exception("internal error")
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
        result = (f"refused: {decision['refused']}" if decision["refused"] else
                  " ".join(f"{k}={v}" for k, v in decision["apply"].items()) or "kept")
        self._log(job, t0, request=decision["request"], result=result, decider=decision["decider"])
        return {"ok": True, "decision": decision}

    @staticmethod
    def _log(job: Mapping[str, Any], t0: float, **fields: str) -> None:
        """One line per request: who, what was asked, what came of it, how long it took."""
        user = job.get("user_name") or job.get("user_id") or "?"
        text = " ".join(f"{key}={json.dumps(value)}" for key, value in fields.items())
        log.info("user=%s %s latency_ms=%.2f", json.dumps(user), text, (time.perf_counter() - t0) * 1000)


# --- the socket ----------------------------------------------------------------------------------


class Access(NamedTuple):
    """Who may ask: these uids, and members of this group (checked with SO_PEERCRED)."""

    uids: frozenset[int]
    gid: int | None = None

    def allows(self, uid: int, gid: int) -> bool:
        if uid in self.uids or (self.gid is not None and gid == self.gid):
            return True
        if self.gid is None:
            return False
        try:
            return self.gid in os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
        except KeyError:  # a uid without a passwd entry belongs to no extra group
            return False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


class _Client:
    """One connection's unread input and unsent output."""

    __slots__ = ("sock", "inbox", "outbox", "seen", "closing")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.inbox, self.outbox = sock, bytearray(), bytearray()
        self.seen, self.closing = time.monotonic(), False


class Server:
    """One thread multiplexing every connection with selectors.

    Decisions are CPU-bound Python under the GIL, so a thread per connection would only add its
    start-up and switching costs (measured: 0.26 ms of CPU and ~0.7 ms of latency a request,
    against 0.08 ms and 0.14 ms here). The socket file is made private first, then given its
    group and mode.
    """

    def __init__(self, path: str, service: Service, access: Access, mode: int = 0o660) -> None:
        self.path, self.service, self.access = path, service, access
        self.inode: int | None = None  # of the socket file this server made; only that one is removed
        self.stopping = threading.Event()
        self.clients: dict[socket.socket, _Client] = {}
        self.selector = selectors.DefaultSelector()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            prepare_socket_path(path)
            old = os.umask(0o177)
            try:
                self.sock.bind(path)
            finally:
                os.umask(old)
            self.inode = os.stat(path).st_ino
            os.chown(path, -1, -1 if access.gid is None else access.gid)
            os.chmod(path, mode)
            self.sock.listen(128)  # a burst of gsbatch clients must not find the backlog full
        except BaseException:
            self.server_close()
            raise
        self.sock.setblocking(False)
        self.selector.register(self.sock, selectors.EVENT_READ)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        next_sweep = time.monotonic() + IDLE_TIMEOUT_S
        while not self.stopping.is_set():
            for key, events in self.selector.select(poll_interval):
                try:
                    if key.fileobj is self.sock:
                        self._accept()
                    elif events & selectors.EVENT_READ:
                        self._read(key.data)
                    else:
                        self._flush(key.data)
                except Exception:  # noqa: BLE001 - one connection's fault must not stop the daemon
                    log.exception("connection dropped after an internal error")
                    if key.data is not None:
                        self._close(key.data)
            if time.monotonic() > next_sweep:
                idle = time.monotonic() - IDLE_TIMEOUT_S
                for client in [c for c in self.clients.values() if c.seen < idle]:
                    self._close(client)
                next_sweep = time.monotonic() + IDLE_TIMEOUT_S / 4

    def shutdown(self) -> None:
        """Make serve_forever return (within its poll interval); safe from a signal handler."""
        self.stopping.set()

    def server_close(self) -> None:
        """Close every connection and remove the socket file (once serve_forever has returned)."""
        for client in list(self.clients.values()):
            self._close(client)
        self.selector.close()
        self.sock.close()
        try:
            if self.inode is not None and os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except OSError:  # gone, or (after --run-as) not ours to remove: the next start replaces it
            pass

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except OSError:
            return
        sock.setblocking(False)
        client = _Client(sock)
        self.clients[sock] = client
        self.selector.register(sock, selectors.EVENT_READ, client)
        _, uid, gid = peer_credentials(sock)
        if not self.access.allows(uid, gid):
            log.warning("refused a connection from uid %d (not root, SlurmUser or in the socket's group)", uid)
            self._send(client, {"ok": False, "error": "permission denied"}, last=True)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        client.seen = time.monotonic()
        client.inbox += data if data else b"\n"  # at the end, a last line without its newline counts
        while not client.closing and (end := client.inbox.find(b"\n", 0, MAX_REQUEST_BYTES)) >= 0:
            line = bytes(client.inbox[:end + 1])
            del client.inbox[:end + 1]
            if line.strip():
                self._send(client, self.service.handle(line))
        if client.closing:
            return
        if len(client.inbox) >= MAX_REQUEST_BYTES:
            self._send(client, {"ok": False, "error": f"request longer than {MAX_REQUEST_BYTES} bytes"}, last=True)
        elif not data:
            client.closing = True
            self._flush(client)

    def _send(self, client: _Client, reply: Mapping[str, Any], last: bool = False) -> None:
        client.outbox += json.dumps(reply, separators=(",", ":")).encode() + b"\n"
        client.closing = client.closing or last
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        if client.sock not in self.clients:
            return
        try:
            sent = client.sock.send(client.outbox) if client.outbox else 0
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(client)
            return
        del client.outbox[:sent]
        if client.outbox:
            self.selector.modify(client.sock, selectors.EVENT_WRITE, client)  # resume reading once sent
        elif client.closing:
            self._close(client)
        else:
            self.selector.modify(client.sock, selectors.EVENT_READ, client)

    def _close(self, client: _Client) -> None:
        client.closing = True
        if self.clients.pop(client.sock, None) is not None:
            self.selector.unregister(client.sock)
            client.sock.close()


def prepare_socket_path(path: str) -> None:
    """A root-owned 0755 directory (made if missing), and no live daemon or other file at ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o755)
        os.chmod(directory, 0o755)
    st = os.stat(directory)
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise InputError(f"{directory} must be owned by root and writable by no one else, or anyone could "
                         "replace the socket", option="--socket")
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise InputError(f"{path} exists and is not a socket", option="--socket")
    if call(path, {"op": "health"}, 0.5) is not None:
        raise InputError(f"another slurmgpu serve already answers on {path}", option="--socket")
    os.unlink(path)


def access_for(group: str | None, slurm_user: str | None, run_as: str | None) -> Access:
    """Root, the daemon's own user(s), SlurmUser and the group; unknown names are an InputError."""
    uids = {0, os.geteuid()}
    for option, name in (("--slurm-user", slurm_user), ("--run-as", run_as)):
        if name:
            try:
                uids.add(pwd.getpwnam(name).pw_uid)
            except KeyError:
                raise InputError(f"no such user {name!r}", option=option) from None
    gid = None
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise InputError(f"no such group {group!r}", option="--group") from None
    return Access(frozenset(uids), gid)


def drop_privileges(user: str) -> None:
    """Run as ``user`` from here on (after the socket is bound and chowned)."""
    pw = pwd.getpwnam(user)
    os.initgroups(pw.pw_name, pw.pw_gid)
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def run(server: Server, run_as: str | None = None) -> None:
    """Serve until SIGTERM or SIGINT; the socket file is removed on the way out."""
    if run_as:
        drop_privileges(run_as)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.shutdown())
    server.service.start()
    log.info("serving on %s (decider %s)", server.path, server.service.config.policy.decider)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.service.stopped.set()
        server.server_close()


