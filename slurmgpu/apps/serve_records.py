"""The daemon's decision records, written by a process of their own, off the request path.

The hook's decisions become submission records (source "lua") in the submission spool, for the
ingest: the same drop box and format as gsbatch's records. The daemon runs as the nightly account
(``render serve``: ``--run-as slurmgpu``) or root, whose records the ingest trusts to name the job's
user; it learnt that user from slurmctld (``job_desc.user_id``), never from the request.

The request path only queues. Building a record (the request read again, script features, the
hash, the JSON) and writing it (a file on disk before it is renamed into the spool) cost more CPU
than the decision of a repeated request, and in a thread of the answering process that work held
the GIL the answers wait for: bench_serve, model decider at 1,000 requests/s on 2 cores, p99 15.9
ms with records and 4.7 ms without. So a child process of the answering process builds and
writes them, at a lower CPU priority (``NICE``): under a burst the answers go first and the
records follow (the writer catches up when the burst ends). A full queue (MAX_QUEUED records
waiting: the disk or the writer has stalled) drops records, counted in ``health`` and logged,
never a request. The job id is not known yet when slurmctld asks: a model decision carries a
decision id, and its tag in the job's AdminComment links the job to the record. A request
answered in a child process (serve_socket) has its records built there (``sink``) and queued here
already built.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.popen_fork
import multiprocessing.queues
import multiprocessing.sharedctypes
import multiprocessing.synchronize  # the writer's parts, imported now: after --run-as the install may be unreadable
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from slurmgpu.pipeline.decision_tag import decision_tag, new_decision_id
from slurmgpu.pipeline.features import hexdigest, script_features
from slurmgpu.pipeline.modes import ADVISE
from slurmgpu.pipeline.spool import SOURCES, new_record, record_file, record_mode, script_text, write_files

if TYPE_CHECKING:
    from slurmgpu.pipeline.request import JobRequest

log = logging.getLogger("slurmgpu.apps.serve")
# Whom a record is for: serve.Who's name, uid and how it was learnt (a tuple: serve imports this module).
Who = tuple[str | None, int | None, str]
# A queued item: ("build", decision, job, who), the writer reading the job's request again (a child
# process of serve_socket, which builds its records itself, adds the request it read), or
# ("made", record) from a child process, or ("failed", why) for a record a child could not build.
Item = tuple[Any, ...]
WRITTEN, FAILED, FLUSHES = range(3)  # the writer's counters, in memory shared with the daemon
_FORK = multiprocessing.get_context("fork")  # the writer inherits the config; nothing is imported again
hexdigest("sha256", b"")  # loads the hash module now, as root: after --run-as the install may be unreadable


class DecisionRecords:
    """Queues decision records for a writer process (started at the first record) and counts them."""

    MAX_QUEUED = 10_000
    BATCH = 64  # records written per flush of the spool's filesystem, at most
    # How long the writer waits for more records before it flushes a batch: at a few hundred answers
    # a second a batch held one or two records, each batch a flush of the filesystem. Measured on the
    # socket server in-process, two clients at about 300 answers/s: 1.56 ms of CPU a request as they
    # came, 1.40 waiting 0.05 s, 1.12 waiting 0.2 s (0.58 with no records). A record reaches the
    # disk this much later at most; the request never waits for it.
    LINGER_S = 0.2
    NICE = 10  # the writer's niceness over the daemon's: answers first
    PARENT_CHECK_S = 1.0  # a writer whose daemon died (SIGKILL) notices within this and ends
    READ_ENTRIES, READ_BYTES = 256, 16 << 20  # jobs the writer keeps read (``read``)

    def __init__(self, directory: str, cluster: str | None,
                 request_of: Callable[[Mapping[str, Any]], JobRequest]) -> None:
        """``request_of``: the job's request as the daemon read it (the writer reads it again
        rather than receive it: the job's fields cost less to send)."""
        self.directory, self.cluster, self.request_of = directory, cluster, request_of
        self.sink: Callable[[Item], None] | None = None  # instead of the queue (a child process)
        self.queued = self.dropped = 0  # queued: to the running writer
        self._before = (0, 0)  # written and failed by writers that ended (and queued to them, unwritten)
        self._pending: Any = None  # the writer's multiprocessing queue, made with it
        # WRITTEN, FAILED, FLUSHES and the last error: shared with the writer (each writer its own)
        self._counts, self._error = self._shared()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._lock = threading.Lock()
        self._read: dict[str, dict[str, Any]] = {}  # the writer's: job (its JSON) -> its record fields
        self._read_bytes = 0

    @property
    def written(self) -> int:
        return self._before[0] + self._count(WRITTEN)

    @property
    def failed(self) -> int:
        return self._before[1] + self._count(FAILED)

    def _count(self, which: int) -> int:
        """The running writer's counter."""
        return int(self._counts[which])

    @staticmethod
    def _shared() -> tuple[Any, Any]:
        return _FORK.RawArray("q", 3), _FORK.RawArray("c", 512)

    @property
    def flushes(self) -> int:
        """Batches written (each one flush of the spool's filesystem)."""
        return self._count(FLUSHES)

    @property
    def last_error(self) -> str | None:
        return self._error.value.decode(errors="replace") or None

    def add(self, decision: dict[str, Any], job: Mapping[str, Any], request: JobRequest,
            who: Who) -> dict[str, Any]:
        """Queue the decision's record; returns the reply with the decision id and, where the hook
        should put it in the job's AdminComment, the tag (model decisions it applies)."""
        if who[0] is None and who[1] is None:
            return decision  # nobody to attribute it to: not recorded
        out = {**decision, "id": new_decision_id()}
        if out.get("decider") == "model" and out.get("mode") != ADVISE and not out.get("waiver") \
                and not out.get("refused"):
            main = request.main
            out["tag"] = decision_tag(out, out["id"], main.gpu_type, main.gpus_total)
        item = ("build", out, dict(job), tuple(who))
        if self.sink is not None:
            self.sink((*item, request))  # built in this process: the request it read
        else:
            self.put(item)
        return out

    def put(self, item: Item) -> None:
        """Queue one item for the writer."""
        try:
            self._start().put_nowait(item)
            self.queued += 1
        except (queue.Full, OSError) as exc:  # OSError: no writer could be started (fork, pipe)
            if isinstance(exc, OSError):
                self._error.value = f"writer not started: {exc.strerror or exc}".encode(errors="replace")[:511]
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("decision records dropped: %d (the spool %s is not keeping up)", self.dropped,
                            self.directory)

    def _start(self) -> Any:
        """The writer's queue, the writer started first if it is not running (a dead one's records
        still queued count as failed)."""
        with self._lock:
            if self._process is not None and self._process.is_alive():
                return self._pending
            if self._process is not None:
                log.warning("the decision record writer ended (%s): started again", self._process.exitcode)
            self._before = (self.written, self.failed + max(self._left(), 0))  # a dead writer's queue is lost
            self._counts, self._error = self._shared()
            self.queued = 0
            self._pending = _FORK.Queue(self.MAX_QUEUED)
            self._process = _FORK.Process(target=self._run, name="slurmgpu-records", daemon=True)
            self._process.start()
            return self._pending

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued record is written (or given up); True when none is left."""
        deadline = time.monotonic() + timeout_s
        while self._left() and time.monotonic() < deadline:
            if self._process is not None and not self._process.is_alive():
                break
            time.sleep(0.01)
        return not self._left()

    def _left(self) -> int:
        """Records queued to the running writer and not yet written or given up."""
        return self.queued - self._count(WRITTEN) - self._count(FAILED)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Flush, then end the writer; True when every queued record was written (or given up)."""
        done = self.flush(timeout_s)
        if self._process is not None and self._process.is_alive():
            try:
                self._pending.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._process.join(1.0)
            if self._process.is_alive():
                self._process.terminate()
        return done

    def _run(self) -> None:
        """The writer process: write what is queued in batches of up to BATCH records, with one flush
        of the spool's filesystem and one fsync of the directory for the batch (``write_files``),
        not an fsync per record: 950-1,450 records a second built and written on this project's
        shared machine, where an fsync each gave about 210, fewer than the daemon answers under load."""
        for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's, sent to the whole group: the daemon
            signal.signal(sig, signal.SIG_IGN)  # ends it (close), or its end does; SIGTERM ends it now
        try:
            os.nice(self.NICE)
        except OSError:
            pass
        parent, backlog = os.getppid(), False
        while True:
            try:
                batch = [self._pending.get(timeout=self.PARENT_CHECK_S)]
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            if batch[-1] is not None and not backlog:
                time.sleep(self.LINGER_S)  # the next records join this batch
            while batch[-1] is not None and len(batch) < self.BATCH:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            backlog = len(batch) == self.BATCH
            self.write([item for item in batch if item is not None])
            if batch[-1] is None:
                return

    def record(self, decision: Mapping[str, Any], job: Mapping[str, Any], who: Who,
               request: JobRequest | None = None) -> dict[str, Any]:
        """The spool record of one decision (``request``: the job's, where it is at hand)."""
        name, uid = who[0], who[1]
        return new_record(
            cluster=self.cluster, job_id=None, sbatch_exit=None, source=SOURCES[1],
            user=name if name is not None else str(uid), uid=uid, model_version=decision.get("model_version"),
            decision={k: v for k, v in decision.items() if k != "tag"}, changed=bool(decision.get("apply")),
            **(self.job_fields(job, request) if request is not None else self.read(job)))

    def read(self, job: Mapping[str, Any]) -> dict[str, Any]:
        """``job_fields`` of a job the writer reads itself, kept for the jobs sent again: a burst of
        one script (a loop of sbatch) sends the same job many times, and reading its request again
        was most of a record's cost (0.37 of 0.6 ms). Bounded as the daemon's reuse is (READ_ENTRIES
        jobs, READ_BYTES of them with their scripts kept again)."""
        try:
            key = json.dumps(job, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):  # not as a request line carries it: read, not kept
            return self.job_fields(job, self.request_of(job))
        fields = self._read.get(key)
        if fields is None:
            fields = self.job_fields(job, self.request_of(job))
            size = len(key) + len(fields["script_text"] or "")  # the job, and its script kept again
            if self._read_bytes + size > self.READ_BYTES or len(self._read) >= self.READ_ENTRIES:
                self._read.clear()
                self._read_bytes = 0
            self._read[key] = fields
            self._read_bytes += size
        return fields

    @staticmethod
    def job_fields(job: Mapping[str, Any], request: JobRequest) -> dict[str, Any]:
        """The fields of a record that come from the job alone (not from its decision)."""
        script = request.script
        data = script.data if script is not None else None
        features = None
        if script is not None:
            try:
                features = script_features(script.text)
            except ValueError:
                features = None
        fields = {k: v for k, v in job.items() if k != "script" and isinstance(v, str | int | float | bool)}
        return {"script_sha256": hexdigest("sha256", data) if data is not None else None,
                "script_text": script_text(data), "original_request": request.to_json(),
                "features": {"script": features,
                             "script_name": job.get("name") if isinstance(job.get("name"), str) else None,
                             "job": fields}}

    def build(self, item: Item) -> dict[str, Any]:
        """The record an item stands for (raises when it could not be made)."""
        if item[0] == "build":
            return self.record(*item[1:])
        if item[0] == "made":
            return dict(item[1])
        raise ValueError(item[1])

    def write(self, items: Sequence[Item]) -> None:
        """Build and write records, atomically and durably; one that could not be is counted and logged."""
        files: list[tuple[str, bytes]] = []
        for item in items:
            try:
                files.append(record_file(self.directory, self.build(item)))
            except Exception as exc:  # noqa: BLE001 - a record is never worth a request; say so, carry on
                self._failed(exc)
        if not files:
            return
        try:
            results: Sequence[OSError | None] = write_files(self.directory, files, record_mode(self.directory))
        except OSError as exc:
            results = [exc] * len(files)
        self._counts[FLUSHES] += 1
        for result in results:
            if result is None:
                self._counts[WRITTEN] += 1
            else:
                self._failed(result)

    def _failed(self, exc: Exception) -> None:
        self._counts[FAILED] += 1
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        if why != self.last_error or self._counts[FAILED] % 1000 == 0:
            log.warning("decision record not written to %s: %s (%d so far)", self.directory, why,
                        self._counts[FAILED])
        self._error.value = why.encode(errors="replace")[:511]
