"""The daemon's Unix socket server: who may connect (SO_PEERCRED), line framing, privileges.

Request handling lives in slurmgpu.apps.serve; this module only moves lines between clients and it,
with each client's kernel-reported identity (a request never says who it is for; see serve.identify).
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import pwd
import select
import selectors
import signal
import socket
import stat
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from slurmgpu.apps import metrics
from slurmgpu.apps.daemon_client import MAX_REQUEST_BYTES, call
from slurmgpu.apps.serve import Peer, Service
from slurmgpu.pipeline.errors import InputError

IDLE_TIMEOUT_S = 60.0  # a connection that asks nothing is closed after this long (blank lines are not asking)
READ_TIMEOUT_S = 5.0  # a request line must arrive whole within this long of its first byte
INLINE_BYTES = 8192  # lines up to this size are answered in the I/O thread (a typical script)
WORKERS = 4  # larger lines are answered by these threads, each in a child process of its own
WORK_BUDGET_S = 2.0  # a child answering one line is killed past this (any client has given up by then)
MAX_CLIENTS = 512
TRUSTED_RESERVE = 64  # of MAX_CLIENTS, for trusted peers only (slurmctld's hook, root): others never get them
MAX_PER_USER = 64  # connections one untrusted uid may hold open (a gsbatch holds one, for milliseconds)
DRAIN_S = READ_TIMEOUT_S  # a stopping worker (serve_workers) answers the connections it holds for this long
log = logging.getLogger("slurmgpu.apps.serve")

class Access(NamedTuple):
    """Who may ask: these uids, and members of this group (checked with SO_PEERCRED); ``trusted``
    uids (root and SlurmUser: slurmctld's hook) may also say which user a job is for."""

    uids: frozenset[int]
    gid: int | None = None
    trusted: frozenset[int] = frozenset({0})

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


class ConnectionCounts(Protocol):
    """Admitted connections per uid: this process's (``Counts``), or every worker's (serve_workers).
    Checking the limits and counting one in happen under ``lock``, so no two processes both take
    the last slot."""

    lock: AbstractContextManager[Any]

    def __getitem__(self, uid: int) -> int: ...

    def total(self) -> int: ...

    def add(self, uid: int, n: int) -> None: ...


class Counts(Counter[int]):
    """Admitted connections per uid in this process (one I/O thread: no lock needed)."""

    lock: AbstractContextManager[Any] = contextlib.nullcontext()

    def add(self, uid: int, n: int) -> None:
        self[uid] += n
        if not self[uid]:
            del self[uid]


class _Client:
    """One connection's unread input and unsent output; ``busy`` while a worker answers its
    current line (its next line waits, so replies keep the order of the requests)."""

    __slots__ = ("sock", "inbox", "outbox", "seen", "closing", "peer", "busy", "eof", "events", "line_since",
                 "admitted")

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock, self.inbox, self.outbox = sock, bytearray(), bytearray()
        # seen: when it connected, last asked something (a blank line is not asking) or was answered
        self.seen, self.closing, self.peer, self.busy, self.eof = time.monotonic(), False, peer, False, False
        self.admitted = False  # counted in Server.open (a refused one is only answered and closed)
        self.events = 0  # what the selector listens for on this socket (0: not registered)
        self.line_since: float | None = None  # when the unfinished line's first byte came



class Server:
    """One I/O thread multiplexing every connection with selectors, and a few worker threads.

    Decisions are CPU-bound Python under the GIL, so a thread per connection would only add its
    start-up and switching costs (measured: 0.26 ms of CPU and ~0.7 ms of latency a request,
    against 0.08 ms and 0.14 ms here): a line of up to ``INLINE_BYTES`` (a typical script) is
    answered in the I/O thread. A longer one goes to a worker thread, which has a child process
    answer it (see _in_child), so a client sending a large script cannot hold up anyone's health
    check or decision; no line may exceed
    ``MAX_REQUEST_BYTES`` and a line must arrive whole within ``READ_TIMEOUT_S`` (one slow
    client holds only its own connection). Connections are limited per untrusted uid
    (``MAX_PER_USER``) and ``TRUSTED_RESERVE`` of them are kept for trusted peers, so no user can
    take the slots slurmctld's hook needs; one that asks nothing for ``IDLE_TIMEOUT_S`` is closed.
    The socket file is made private first, then given its group and mode.
    """

    def __init__(self, path: str, service: Service, access: Access, mode: int = 0o660,
                 listener: socket.socket | None = None, counts: ConnectionCounts | None = None) -> None:
        """``listener``: a socket already bound and listening (a worker of serve_workers, which
        shares it and leaves its file alone); ``counts``: the connections every worker holds."""
        self.path, self.service, self.access = path, service, access
        self.inode: int | None = None  # of the socket file this server made; only that one is removed
        self.stopping = threading.Event()
        self.drain_until: float | None = None  # stopping: answer the connections held until then
        self.clients: dict[socket.socket, _Client] = {}
        self.open: ConnectionCounts = Counts() if counts is None else counts  # admitted connections per uid
        self.selector = selectors.DefaultSelector()
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="slurmgpu-serve")
        self.forking = threading.Lock()  # one fork at a time (see _in_child)
        self.done: deque[tuple[_Client, dict[str, Any]]] = deque()  # workers' replies, for the I/O thread
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        if listener is None:
            try:
                self.sock, self.inode = bind(path, access, mode)
            except BaseException:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.server_close()
                raise
        else:
            self.sock = listener
        self.sock.setblocking(False)
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        next_sweep = time.monotonic() + 0.5
        while not self.stopping.is_set() or self._draining():
            for key, events in self.selector.select(min(poll_interval, 0.5)):
                try:
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is self.wake_r:
                        self._replies()
                    elif events & selectors.EVENT_READ:
                        self._read(key.data)
                    else:
                        self._flush(key.data)
                except Exception:  # noqa: BLE001 - one connection's fault must not stop the daemon
                    log.exception("connection dropped after an internal error")
                    if key.data is not None:
                        self._close(key.data)
            if time.monotonic() > next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + 0.5

    def _sweep(self) -> None:
        """Close connections idle too long, and answer a line that is not done in time."""
        now = time.monotonic()
        for client in list(self.clients.values()):
            if client.busy or client.closing:
                continue
            if client.line_since is not None and now - client.line_since > READ_TIMEOUT_S:
                self._send(client, {"ok": False, "error": f"request not complete within {READ_TIMEOUT_S:g} s"},
                           last=True)
            elif client.seen < now - IDLE_TIMEOUT_S:  # with unsent replies too: it is not reading them
                self._close(client)

    def shutdown(self) -> None:
        """Make serve_forever return (within its poll interval); safe from a signal handler."""
        self.stopping.set()

    def drain(self, seconds: float = DRAIN_S) -> None:
        """Stop accepting, answer the connections already held (for ``seconds`` at most), then make
        serve_forever return: a worker being replaced drops no request. Safe from a signal handler."""
        self.drain_until = time.monotonic() + seconds
        self.stopping.set()

    def _draining(self) -> bool:
        """In serve_forever, once stopping: whether to go on answering the connections held."""
        if self.drain_until is None or not self.clients or time.monotonic() > self.drain_until:
            return False
        if self.sock.fileno() >= 0 and self.sock in self.selector.get_map():
            self.selector.unregister(self.sock)  # new connections wait in the backlog for another worker
        return True

    def server_close(self) -> None:
        """Close every connection and remove the socket file (once serve_forever has returned)."""
        for client in list(self.clients.values()):
            self._close(client)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.selector.close()
        self.sock.close()
        self.wake_r.close()
        self.wake_w.close()
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
        pid, uid, gid = peer_credentials(sock)
        client = _Client(sock, Peer(pid, uid, gid, uid in self.access.trusted))
        self.clients[sock] = client
        self._want(client, selectors.EVENT_READ)
        with self.open.lock:  # checked and counted at once: other workers count on the same slots
            refusal = self._refusal(client.peer)
            if refusal is None:
                client.admitted = True
                self.open.add(uid, 1)
        if refusal is not None:
            log.warning("refused a connection from uid %d: %s", uid, refusal)
            self._send(client, {"ok": False, "error": refusal}, last=True)

    def _refusal(self, peer: Peer) -> str | None:
        """Why a new connection from this peer is refused (None: it is served)."""
        if not self.access.allows(peer.uid, peer.gid):
            return "permission denied"  # not root, SlurmUser, the daemon's own user or in the socket's group
        total = self.open.total()
        if peer.trusted:
            return "busy: too many connections" if total >= MAX_CLIENTS else None
        if self.open[peer.uid] >= MAX_PER_USER:
            return f"busy: too many connections from uid {peer.uid} (at most {MAX_PER_USER})"
        if total - sum(self.open[uid] for uid in self.access.trusted) >= MAX_CLIENTS - TRUSTED_RESERVE:
            return "busy: too many connections"
        return None

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if client.closing:  # answered for the last time: what else it sends is dropped
            return
        if not data:
            client.eof = True
            data = b"\n"  # at the end, a last line without its newline counts
        client.inbox += data
        self._next_lines(client)

    def _next_lines(self, client: _Client) -> None:
        """Answer the client's complete lines in order, one at a time (a long one by a worker)."""
        while not client.busy and not client.closing:
            end = client.inbox.find(b"\n", 0, MAX_REQUEST_BYTES + 1)
            if end < 0:
                break
            line = bytes(client.inbox[:end + 1])
            del client.inbox[:end + 1]
            client.line_since = None
            if not line.strip():
                continue
            client.seen = time.monotonic()
            if len(line) <= INLINE_BYTES and not self.service.slow(line):
                self._send(client, self.service.handle(line, client.peer))
            else:
                client.busy = True
                self.pool.submit(self._work, client, line)
        if client.closing or client.sock not in self.clients:
            return
        if not client.busy:
            if len(client.inbox) > MAX_REQUEST_BYTES:
                client.inbox.clear()
                self._send(client, {"ok": False, "error": f"request longer than {MAX_REQUEST_BYTES} bytes"},
                           last=True)
                return
            if client.eof:
                client.closing = True
            elif client.inbox and client.line_since is None:
                client.line_since = time.monotonic()
        self._flush(client)

    def _work(self, client: _Client, line: bytes) -> None:
        """In a worker thread: answer one line in a child process, and hand the reply to the I/O thread."""
        answered = False

        def answer(reply: dict[str, Any]) -> None:
            nonlocal answered
            if answered:  # one reply per line, whatever fails after it
                return
            answered = True
            self.done.append((client, reply))
            try:
                self.wake_w.send(b"x")
            except OSError:  # the wake-up pipe is full: the I/O thread is about to look anyway
                pass

        try:
            self._in_child(line, client.peer, answer)
        except Exception as exc:  # noqa: BLE001 - a last resort: the client still gets its one answer
            log.exception("internal error")
            answer({"ok": False, "error": f"internal error: {type(exc).__name__}"})

    def _in_child(self, line: bytes, peer: Peer, answer: Callable[[dict[str, Any]], None]) -> None:
        """Answer one line in a forked child, within ``WORK_BUDGET_S``. A child, not this thread:
        the GIL is not released while a regular expression backtracks (a 120 KB script held it for
        5 s), so CPU spent here on one request would stall every answer and health check; a child
        has its own, and is killed when its time is up. It sends one JSON line, the reply, then its
        metrics observations (counted here), then one per decision record it made (built there: a
        record reads the script too), which the writer thread here writes; the reply is passed on when
        the child is done, its records queued first."""
        records = self.service.records
        with self.forking:  # no other child may inherit this pipe's write end: its EOF would wait
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child (its coverage is not collected)
                code = 1
                try:
                    os.close(read_end)
                    built: list[tuple[Any, ...]] = []
                    if records is not None:
                        records.sink = built.append
                    observed: list[metrics.Observed] = []
                    metrics.defer(observed.append)  # counted by the parent: a child leaves no value files
                    with os.fdopen(write_end, "wb") as out:
                        out.write(_json_line(self.service.handle(line, peer)))
                        for seen in observed:
                            out.write(_json_line({"observed": list(seen)}))
                        out.flush()
                        for queued in built:  # only there when this daemon records
                            assert records is not None
                            try:
                                out.write(_json_line({"record": records.build(queued)}))
                            except Exception as exc:  # noqa: BLE001 - counted as failed by the writer
                                out.write(_json_line({"error": f"{type(exc).__name__}: {exc}"}))
                    code = 0
                finally:
                    os._exit(code)
            os.close(write_end)
        self.service.tally()
        deadline, pending = time.monotonic() + WORK_BUDGET_S, bytearray()
        items: list[dict[str, Any]] = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([read_end], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    log.warning("a %d-byte request from uid %d not answered within %g s: its process was killed",
                                len(line), peer.uid, WORK_BUDGET_S)
                    answer({"ok": False, "error": f"request not answered within {WORK_BUDGET_S:g} s"})
                    return
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                pending += chunk
                *lines, rest = pending.split(b"\n")
                pending = bytearray(rest)
                items += [json.loads(text) for text in lines]
            # Records are queued before the reply goes: once a client has its answer, its record is
            # the writer's (a daemon stopping then still flushes it).
            for item in items[1:]:
                if "observed" in item:
                    metrics.record(metrics.Observed._make(item["observed"]))
                elif records is not None:
                    records.put(("made", item["record"]) if "record" in item else ("failed", item.get("error")))
            answer(items[0] if items else
                   {"ok": False, "error": "internal error: the request's process ended without an answer"})
        finally:
            os.close(read_end)
            os.waitpid(pid, 0)

    def _replies(self) -> None:
        """In the I/O thread: send the workers' replies, then go on with each client's next lines."""
        try:
            while self.wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self.done:
            client, reply = self.done.popleft()
            client.busy, client.seen = False, time.monotonic()
            if client.sock in self.clients:
                client.outbox += _json_line(reply)
                self._next_lines(client)

    def _send(self, client: _Client, reply: Mapping[str, Any], last: bool = False) -> None:
        client.outbox += _json_line(reply)
        client.closing = client.closing or last
        self._flush(client)

    def _want(self, client: _Client, events: int) -> None:
        """Listen for these events on the client's socket (0: for none, while a worker answers it)."""
        if events == client.events:
            return
        if client.events == 0:
            self.selector.register(client.sock, events, client)
        elif events == 0:
            self.selector.unregister(client.sock)
        else:
            self.selector.modify(client.sock, events, client)
        client.events = events

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
            self._want(client, selectors.EVENT_WRITE)  # resume reading once sent
        elif client.closing and not client.busy:
            self._close(client)
        else:  # nothing to read while a worker answers (it bounds what one client can queue), or after EOF
            self._want(client, 0 if client.busy or client.eof else selectors.EVENT_READ)

    def _close(self, client: _Client) -> None:
        client.closing = True
        if self.clients.pop(client.sock, None) is not None:
            self._want(client, 0)
            client.sock.close()
            if client.admitted:
                with self.open.lock:
                    self.open.add(client.peer.uid, -1)


def _json_line(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def bind(path: str, access: Access, mode: int) -> tuple[socket.socket, int]:
    """A listening socket at ``path`` and its file's inode: made private first, then given its
    group and mode."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        prepare_socket_path(path)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        inode = os.stat(path).st_ino
        try:
            os.chown(path, -1, -1 if access.gid is None else access.gid)
            os.chmod(path, mode)
            sock.listen(128)  # a burst of gsbatch clients must not find the backlog full
        except BaseException:
            os.unlink(path)
            raise
    except BaseException:
        sock.close()
        raise
    return sock, inode


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
    uids, trusted = {0, os.geteuid()}, {0}
    for option, name in (("--slurm-user", slurm_user), ("--run-as", run_as)):
        if name:
            try:
                uids.add(pwd.getpwnam(name).pw_uid)
            except KeyError:
                raise InputError(f"no such user {name!r}", option=option) from None
            if option == "--slurm-user":  # slurmctld's hook: it says which user a job is for
                trusted.add(pwd.getpwnam(name).pw_uid)
    gid = None
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise InputError(f"no such group {group!r}", option="--group") from None
    return Access(frozenset(uids), gid, frozenset(trusted))



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
        if server.service.records is not None and not server.service.records.close():
            log.warning("decision records still queued at exit were not written")
