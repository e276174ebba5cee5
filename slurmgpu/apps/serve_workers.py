"""``slurmgpu serve --workers N``: pre-forked worker processes sharing one socket, for more than one core.

A decision is CPU-bound Python under the GIL, so one process answers on one core at most. The
supervisor here binds the socket and loads the config and model once, then forks N workers
that inherit both (copy-on-write: the model is not loaded N times) and each run the ordinary
server of serve_socket, accepting on the shared listening socket; the kernel hands each new
connection to one of them. The supervisor answers nothing itself; it

* replaces a worker that dies (its connections are counted out first),
* checks the model file every ``--reload-s`` and, when it changed or on SIGHUP, loads it and
  replaces every worker: the new ones are started and ready before the old ones are told to
  stop, and an old one stops accepting but answers the connections it holds (serve_socket's
  ``Server.drain``), while new connections wait in the socket's backlog: no request is dropped,
* on SIGTERM or SIGINT, drains every worker and removes the socket file.

Connection limits (serve_socket: ``MAX_CLIENTS``, ``TRUSTED_RESERVE``, ``MAX_PER_USER``) hold for the
daemon as a whole, not per worker: admitted connections are counted in shared memory
(``SharedCounts``), one row per worker, checked and counted under one lock that the kernel
releases when its holder dies (``HolderLock``): a worker killed while counting never stalls the rest.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import multiprocessing
import os
import select
import signal
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from typing import Any

from slurmgpu.apps import metrics, serve_socket
from slurmgpu.apps.serve import Service

SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}
READY_S = 60.0  # a new worker reads the cluster view before it answers (sinfo, scontrol): this long at most
RESPAWN_PAUSE_S = 1.0  # a worker that died this young is replaced only after this pause (no fork loop)
log = logging.getLogger("slurmgpu.apps.serve")


class HolderLock:
    """A lock between processes that dies with its holder: a POSIX record lock on an unlinked file
    (the kernel drops it when the holding process ends, SIGKILL included; a semaphore would stay
    taken and stall every worker), and a thread lock for the threads of one process."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()  # inherited by the workers; record locks are per process
        self.threads = threading.Lock()

    def __enter__(self) -> None:
        self.threads.acquire()
        try:
            fcntl.lockf(self.file, fcntl.LOCK_EX)
        except BaseException:
            self.threads.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.lockf(self.file, fcntl.LOCK_UN)
        finally:
            self.threads.release()


class SharedCounts:
    """Admitted connections per uid and worker, in shared memory made before the fork: a uid's
    slot in ``uids`` (uid + 1; 0 is free), its count per worker row in ``counts``. A worker's row
    is cleared when it dies, so a killed worker's connections do not stay counted."""

    def __init__(self, rows: int, slots: int) -> None:
        self.rows, self.slots = rows, slots
        self.lock = HolderLock()
        self.uids = multiprocessing.RawArray("q", slots)
        self.counts = multiprocessing.RawArray("q", rows * slots)
        # Each row's sum, so a connection's checks read a few numbers, not every slot of every row
        # (summing those cost each connection ~50 us), and where this process last found each uid.
        self.totals = multiprocessing.RawArray("q", rows)
        self.found: dict[int, int] = {}

    def slot(self, uid: int) -> int | None:
        """Under ``lock``: the uid's slot (-1: a free one), None when it has none."""
        known = self.found.get(uid)
        if known is not None and self.uids[known] == uid + 1:  # slots are reused: checked before use
            return known
        try:
            known = self.found[uid] = self.uids[:].index(uid + 1)
        except ValueError:
            return None
        return known

    def of(self, slot: int) -> int:
        """Connections held in one uid slot, by every worker."""
        return sum(self.counts[row * self.slots + slot] for row in range(self.rows))

    def total(self) -> int:
        return sum(self.totals)

    def clear(self, row: int) -> None:
        """Count out a worker's connections (it is gone), freeing the uid slots left empty."""
        with self.lock:
            self.totals[row] = 0
            for slot in range(self.slots):
                self.counts[row * self.slots + slot] = 0
                if self.uids[slot] and not self.of(slot):
                    self.uids[slot] = 0

    def view(self, row: int) -> WorkerCounts:
        return WorkerCounts(self, row)


class WorkerCounts:
    """One worker's side of SharedCounts (serve_socket.ConnectionCounts): it reads every worker's
    counts and writes its own row."""

    def __init__(self, shared: SharedCounts, row: int) -> None:
        self.shared, self.row = shared, row
        self.lock: AbstractContextManager[Any] = shared.lock

    def __getitem__(self, uid: int) -> int:
        slot = self.shared.slot(uid)
        return 0 if slot is None else self.shared.of(slot)

    def __bool__(self) -> bool:
        return self.total() > 0

    def total(self) -> int:
        return self.shared.total()

    def add(self, uid: int, n: int) -> None:
        """Under ``lock``: n more (or fewer) connections of ``uid`` in this worker."""
        shared = self.shared
        slot = shared.slot(uid)
        if slot is None:
            slot = shared.slot(-1)  # a free one: admitted connections never outnumber the slots
            if slot is None:
                raise RuntimeError("connection table full")
            shared.uids[slot] = uid + 1
        shared.counts[self.row * shared.slots + slot] += n
        shared.totals[self.row] += n
        if not shared.of(slot):
            shared.uids[slot] = 0


class Supervisor:
    """Binds the socket, forks ``workers`` servers on it and keeps that many running (see module doc)."""

    def __init__(self, path: str, service: Service, access: serve_socket.Access, mode: int = 0o660,
                 workers: int = 2) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.path, self.service, self.access, self.workers = path, service, access, workers
        self.listener, self.inode = serve_socket.bind(path, access, mode)
        # rows: a full set of workers, their replacements during a reload, and spares for the dead
        self.counts = SharedCounts(2 * workers + 2, serve_socket.MAX_CLIENTS + 1)
        self.children: dict[int, tuple[int, float]] = {}  # pid -> (counts row, started, monotonic)
        self.retiring: set[int] = set()  # told to stop: not replaced when they end
        # Blocked before the caller starts any thread (the metrics server), which inherits the mask: a
        # SIGTERM that reached a thread not blocking it killed the supervisor and orphaned its workers.
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)

    def run(self, run_as: str | None = None) -> None:
        """Serve until SIGTERM or SIGINT; the socket file is removed on the way out."""
        if run_as:
            serve_socket.drop_privileges(run_as)
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # taken with sigtimedwait: no handler races a fork
        log.info("serving on %s (decider %s, %d workers)", self.path, self.service.config.policy.decider,
                 self.workers)
        try:
            self.spawn(self.workers)
            while True:
                info = signal.sigtimedwait(SIGNALS, self.service.reload_s)
                if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
                    break
                self.reap()
                if info is not None and info.si_signo == signal.SIGHUP:
                    log.info("SIGHUP: reloading the model and replacing the workers")
                    if self.service.model_path:
                        self.service.model = self.service.model._replace(signature=None)
                        self.service.check_model()
                    self.replace_all()
                elif self.service.model_path and self.service.check_model():
                    self.replace_all()
        finally:
            self.stop()

    def spawn(self, count: int) -> list[int]:
        """Fork ``count`` workers and wait until each answers (or READY_S passes); their pids."""
        gc.collect()
        gc.freeze()  # what the supervisor holds (the model) stays shared: the collector does not touch it
        ready_r, ready_w = os.pipe()
        pids = []
        try:
            for _ in range(count):
                row = min(set(range(self.counts.rows)) - {r for r, _ in self.children.values()})
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the worker (its coverage is not collected)
                    os.close(ready_r)
                    self.work(row, ready_w)
                self.children[pid] = (row, time.monotonic())
                pids.append(pid)
        finally:
            os.close(ready_w)
        try:
            deadline, ready = time.monotonic() + READY_S, 0
            while ready < len(pids) and select.select([ready_r], [], [], max(deadline - time.monotonic(), 0))[0]:
                got = os.read(ready_r, 64)
                if not got:  # every worker has written or ended
                    break
                ready += len(got)
            if ready < len(pids):
                log.warning("%d of %d new workers not ready", len(pids) - ready, len(pids))
        finally:
            os.close(ready_r)
        return pids

    def work(self, row: int, ready_w: int) -> None:
        """In a new worker: serve on the shared socket until told to stop, then drain; never returns."""
        code = 1
        try:
            server = serve_socket.Server(self.path, self.service, self.access, listener=self.listener,
                                         counts=self.counts.view(row))
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: server.drain())
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor's to act on
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            self.service.watch_model = False  # the supervisor watches it, and replaces this worker
            self.service.start()
            os.write(ready_w, b"x")
            os.close(ready_w)
            try:
                server.serve_forever(poll_interval=0.5)
            finally:
                self.service.stopped.set()
                server.server_close()
                records = self.service.records
                if records is not None and not records.close():
                    log.warning("decision records still queued at exit were not written")
            code = 0
        except BaseException:  # noqa: BLE001 - said in the log; the supervisor replaces this worker
            log.exception("worker %d failed", os.getpid())
        finally:
            os._exit(code)

    def reap(self) -> None:
        """Collect ended workers; replace those that were not told to stop."""
        lost = 0
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid not in self.children:
                continue
            row, started = self.children.pop(pid)
            self.counts.clear(row)
            metrics.mark_dead(pid)
            if pid in self.retiring:
                self.retiring.discard(pid)
                continue
            log.warning("worker %d ended (%s): starting another", pid, _how(status))
            if time.monotonic() - started < RESPAWN_PAUSE_S:
                time.sleep(RESPAWN_PAUSE_S)
            lost += 1
        if lost:
            self.spawn(lost)

    def replace_all(self) -> None:
        """New workers (with the model now loaded) first, then the old ones drain and stop."""
        old = [pid for pid in self.children if pid not in self.retiring]
        self.spawn(self.workers)
        self.retire(old)

    def retire(self, pids: list[int]) -> None:
        for pid in pids:
            self.retiring.add(pid)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Drain every worker (killed past the drain time), then close and remove the socket."""
        self.retire(list(self.children))
        deadline = time.monotonic() + serve_socket.DRAIN_S + 5
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid in self.children:
            log.warning("worker %d still running after %g s: killed", pid, serve_socket.DRAIN_S + 5)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        self.children.clear()
        self.listener.close()
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except OSError:  # gone, or (after --run-as) not ours to remove: the next start replaces it
            pass


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def default_workers() -> int:
    """One worker per core this process may run on."""
    return len(os.sched_getaffinity(0)) or 1

