"""Fill the history store: sacct output, collector records and gsbatch submission records.

Loads are idempotent (upserts keyed on cluster + job id, records keyed on their id), run in
transactions of one chunk each, and report every unreadable row by line number while the good
rows still land. Live sacct ingest is incremental from a stored watermark with an overlap, so
jobs that were still running last time are updated.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pwd
import re
import stat
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from sqlalchemy import ColumnElement, Insert, Table, or_, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError

from slurmgpu.history.db import GpuUsage, IngestState, Job, JobScript, ModelVersion, Submission, utcnow
from slurmgpu.pipeline.decision_tag import DECISION_ID, parse_tag
from slurmgpu.pipeline.features import hexdigest
from slurmgpu.pipeline.files import kind_of
from slurmgpu.pipeline.spool import (
    FREE_FIELDS,
    MAX_FIELD_BYTES,
    MAX_RECORD_BYTES,
    MAX_SCRIPT_BYTES,
    READ_VERSIONS,
    SOURCES,
    field_size,
)
from slurmgpu.slurm import sacct
from slurmgpu.slurm.backend import SlurmBackend, select_backend

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql.dml import Insert as PgInsert
    from sqlalchemy.dialects.sqlite.dml import Insert as SqliteInsert

JOBS: Table = Job.__table__  # type: ignore[assignment]
# What sacct fills; ``retry_of`` is slurmgpu retry's link, which an ingest never changes.
JOB_COLUMNS = tuple(c.name for c in JOBS.columns if c.name not in ("id", "updated_at", "retry_of"))
OVERLAP = timedelta(minutes=30)


class Report:
    """What one ingest did; printed for the admin and the nightly log."""

    def __init__(self) -> None:
        self.inserted = self.updated = self.unchanged = 0
        self.errors: list[sacct.RowError] = []
        self.files_loaded = 0
        self.files_rejected: list[str] = []  # "path: kind: reason", each renamed *.rejected (_set_aside)
        self.rejected_kinds: Counter[str] = Counter()
        self.files_waiting = 0  # their job is not in the accounting yet: left for the next run
        self.files_duplicate = 0  # already stored: removed
        self.files_deferred = 0  # over their owner's share of this run: left for the next
        self.expired = 0  # stored records naming no job, past NO_JOB_KEEP: deleted
        self.files_unreadable: list[str] = []  # this account may not read them: left, a set-up problem
        self.files_kept: list[str] = []  # loaded, but this account may not remove them
        self.decisions_linked = 0  # the Lua hook's decisions given their job (by the tag in its comment)

    def summary(self) -> str:
        text = (f"{self.inserted} jobs inserted, {self.updated} updated, {self.unchanged} unchanged, "
                f"{len(self.errors)} rows rejected")
        if self.files_loaded or self.files_rejected or self.files_waiting or self.files_duplicate \
                or self.files_unreadable or self.files_deferred:
            text += f"; {self.files_loaded} spool records loaded, {len(self.files_rejected)} rejected"
            if self.rejected_kinds:
                text += " (" + ", ".join(f"{n} {k}" for k, n in sorted(self.rejected_kinds.items())) + ")"
            if self.files_duplicate:
                text += f", {self.files_duplicate} duplicates removed"
            if self.files_deferred:
                text += f", {self.files_deferred} over their user's share of this run (left for the next)"
            if self.files_waiting:
                text += f", {self.files_waiting} waiting for their job in sacct"
            if self.files_unreadable:
                text += f", {len(self.files_unreadable)} unreadable by this account"
        if self.decisions_linked:
            text += f"; {self.decisions_linked} hook decisions linked to their job"
        if self.expired:
            text += f"; {self.expired} records naming no job expired"
        return text


def upsert(conn: Connection, table: Table, rows: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    """Insert rows, updating those whose keys exist, in the dialect's own syntax."""
    if not rows:
        return
    name = conn.dialect.name
    cols = [c for c in rows[0] if c not in keys]
    stmt: Insert
    if name in ("sqlite", "postgresql"):
        conflict: SqliteInsert | PgInsert
        if name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            conflict = sqlite_insert(table)
        else:
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            conflict = pg_insert(table)
        stmt = conflict.on_conflict_do_update(index_elements=list(keys),
                                              set_={c: conflict.excluded[c] for c in cols})
    elif name in ("mysql", "mariadb"):
        from sqlalchemy.dialects.mysql import insert as mysql_insert

        duplicate = mysql_insert(table)
        stmt = duplicate.on_duplicate_key_update({c: duplicate.inserted[c] for c in cols})
    else:
        raise RuntimeError(f"unsupported database dialect {name}")
    conn.execute(stmt, rows)


def _chunks(items: Iterable[sacct.JobRecord | sacct.RowError], size: int,
            report: Report) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, sacct.RowError):
            report.errors.append(item)
            continue
        chunk.append(with_decision_id(item.values))
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def with_decision_id(values: dict[str, Any]) -> dict[str, Any]:
    """A job row with the decision id of the hook's tag in its AdminComment (``slurmgpu:d=...``), else
    None. Only slurmctld (the hook) and admins can set AdminComment; a tag in the user's own Comment is
    the user's text, never believed."""
    if "admin_comment" not in values:  # not a sacct row (an import), or already read
        return {**values, "decision_id": values.get("decision_id")}
    fields = parse_tag(values["admin_comment"])
    return {**{k: v for k, v in values.items() if k != "admin_comment"}, "decision_id": fields["d"] if fields else None}


def decision_of_job(conn: Connection, cluster: str, job_id: str) -> dict[str, Any] | None:
    """The submission record of a job's decision, of the job's own user: gsbatch's record names its job
    (the file's owner was checked against the job's user when it was stored); the hook's decision is
    the one its tag in the job's AdminComment names."""
    sub = cast(Table, Submission.__table__)
    own = (sub.c.source == "gsbatch") & (sub.c.job_id == JOBS.c.job_id)
    row = conn.execute(select(sub.c.record_id, sub.c.decision_id, sub.c.job_id, sub.c.decision, sub.c.user)
                       .join(JOBS, ((JOBS.c.decision_id == sub.c.decision_id) | own) & (JOBS.c.user == sub.c.user))
                       .where(JOBS.c.cluster == cluster, JOBS.c.job_id == job_id,
                              sub.c.cluster.in_([cluster, "default"]))).first()  # "default": gsbatch had no cluster
    return dict(row._mapping) if row else None


def load_jobs(engine: Engine, items: Iterable[sacct.JobRecord | sacct.RowError], report: Report | None = None,
              chunk_size: int = 5000, on_chunk: Callable[[int], None] | None = None) -> Report:
    """Upsert job records chunk by chunk, one transaction each; rows identical to the stored
    ones are not written, so a repeated load changes nothing."""
    report = report or Report()
    for chunk in _chunks(items, chunk_size, report):
        latest = {(r["cluster"], r["job_id"]): r for r in chunk}  # a later row for a job wins
        with engine.begin() as conn:
            stored = _stored(conn, list(latest))
            fresh = []
            now = utcnow()
            for key, row in latest.items():
                old = stored.get(key)
                if old is None:
                    report.inserted += 1
                elif any(old[c] != row[c] for c in JOB_COLUMNS):
                    report.updated += 1
                else:
                    report.unchanged += 1
                    continue
                fresh.append({**row, "updated_at": now})
            upsert(conn, JOBS, fresh, ("cluster", "job_id"))
        if on_chunk:
            on_chunk(len(chunk))
    return report


def _stored(conn: Connection, keys: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    by_cluster: dict[str, list[str]] = {}
    for cluster, job_id in keys:
        by_cluster.setdefault(cluster, []).append(job_id)
    cols = [JOBS.c[c] for c in JOB_COLUMNS]
    for cluster, ids in by_cluster.items():
        for start in range(0, len(ids), 900):  # stay under every backend's bind-parameter limit
            rows = conn.execute(select(*cols).where(JOBS.c.cluster == cluster,
                                                    JOBS.c.job_id.in_(ids[start:start + 900])))
            for r in rows.mappings():
                out[(r["cluster"], r["job_id"])] = dict(r)
    return out


# --- live sacct ---------------------------------------------------------------------------


def watermark(engine: Engine, cluster: str) -> datetime | None:
    with engine.connect() as conn:
        return conn.execute(select(IngestState.watermark).where(IngestState.cluster == cluster)).scalar()


def _set_watermark(conn: Connection, cluster: str, until: datetime) -> None:
    row = {"cluster": cluster, "watermark": until, "updated_at": utcnow()}
    upsert(conn, IngestState.__table__, [row], ("cluster",))  # type: ignore[arg-type]


def ingest_sacct(engine: Engine, cluster: str, since: datetime | None = None, until: datetime | None = None,
                 default_days: int = 30, on_chunk: Callable[[int], None] | None = None,
                 backend: SlurmBackend | None = None) -> Report:
    """Load the accounting from the watermark (minus an overlap) to now, through BACKEND (default: the
    one ``select_backend`` picks: sacct, or pyslurm where it matches the running Slurm)."""
    until = until or utcnow()
    if since is None:
        mark = watermark(engine, cluster)
        since = mark - OVERLAP if mark else until - timedelta(days=default_days)
    backend = backend or select_backend()
    report = _load_accounting(engine, backend, backend.accounting(since, until), cluster, on_chunk)
    with engine.begin() as conn:
        _set_watermark(conn, cluster, until)
    return report


def ingest_jobs_by_id(engine: Engine, cluster: str, job_ids: Iterable[str], report: Report | None = None,
                      backend: SlurmBackend | None = None) -> Report:
    """These jobs by id, whatever their times, counted into ``report``. A job cancelled while held
    never became eligible, and the time window (``ingest_sacct``) never shows such a job, while asking
    by id does: without this its submission record would wait for it until given up."""
    ids = sorted({i for i in job_ids if _JOB_ID.fullmatch(i)})
    report = report or Report()
    backend = backend or select_backend()
    for start in range(0, len(ids), 200):
        _load_accounting(engine, backend, backend.accounting(job_ids=ids[start:start + 200]), cluster, report=report)
    return report


def _load_accounting(engine: Engine, backend: SlurmBackend, lines: Iterable[str], cluster: str,
                     on_chunk: Callable[[int], None] | None = None, report: Report | None = None) -> Report:
    """Load the backend's sacct lines (into ``report``, when given); SlurmError (a RuntimeError) when it fails."""
    summed = sacct.gpu_usage_is_summed(backend.version())
    return load_jobs(engine, sacct.parse_lines(lines, sacct.LIVE_FIELDS, sacct.LIVE_DELIMITER, cluster, summed),
                     report, on_chunk=on_chunk)


# --- spools: files any user may have written --------------------------------------------------
#
# The submission spool is world-writable (sticky, setgid): every file in it is hostile until shown
# otherwise. A file is opened only if it is a small regular file with one link (never a FIFO, a
# device or a symlink, never blocking), its content is checked field by field, and it is linked to
# a job only if the file's owner is the job's user in the accounting (or is root, or the account
# running this ingest, who may write the database directly anyway). Each file ends one of four
# ways: loaded (then removed), a duplicate of a stored record (removed), waiting for its job to
# appear in sacct (left), or set aside as FILE.rejected with a reason. One bad file never keeps
# the others out: rows are stored in batches, and a batch the database refuses is retried one
# record per transaction.

JOB_WAIT = timedelta(hours=24)  # a record whose job sacct never showed is set aside after this
# What one user's files may add in one run (the ingest empties the spool, so the spool's disk quota
# bounds one night only); the rest wait for the next run. Root's and this account's are not counted.
USER_FILES_PER_RUN = 2000
USER_BYTES_PER_RUN = 32 << 20
NO_JOB_KEEP = timedelta(days=30)  # a stored record naming no job (sbatch refused it; a hook decision never linked)
FUTURE_SLACK = timedelta(days=1)  # a record dated later than this ahead would dodge NO_JOB_KEEP
BATCH_FILES = 256
BATCH_BYTES = 16 << 20
FetchJobs = Callable[[list[tuple[str, str]]], object]  # (cluster, job id) pairs -> loaded into the history
_JOB_ID = re.compile(r"\d{1,10}(?:[_+]\d{1,10})?")  # as sbatch prints it
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_RECORD_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"[0-9a-f]{12}")  # Bundle.digest
_DECIDER = re.compile(r"[a-z][a-z0-9.-]{0,23}")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}")  # a login name, or a uid without one
_MAX_DEPTH = 32


class SetAside(ValueError):
    """A spool file that will not be loaded: it is renamed ``*.rejected`` and reported with ``kind``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Unreadable(Exception):
    """The ingest's account may not read the file: a set-up problem, so the file stays for a later run."""


class SpoolFile(NamedTuple):
    path: str
    uid: int
    mtime: float
    data: bytes


def shown(path: str) -> str:
    """A path safe to print in a log or a terminal (a user chose the name)."""
    return path if path.isprintable() else ascii(path)


def open_spool_file(path: str, max_bytes: int = MAX_RECORD_BYTES) -> SpoolFile | None:
    """Read a spool file if it is a regular file with one link and at most ``max_bytes``; never blocks,
    never follows a link. None when it vanished meanwhile; SetAside for anything else it is."""
    try:
        kind = kind_of(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None
    if kind != "regular file":
        raise SetAside("not a regular file", f"a {kind}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None
    except PermissionError:
        raise _Unreadable() from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SetAside("not a regular file", "a symbolic link") from None
        raise SetAside("unreadable", f"cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between lstat and open
            raise SetAside("not a regular file", f"a {kind_of(st.st_mode)}")
        if st.st_nlink != 1:
            raise SetAside("hard link", f"{st.st_nlink} hard links (a record has exactly one)")
        if st.st_size > max_bytes:
            raise SetAside("oversize", f"{st.st_size} bytes, over the {max_bytes}-byte limit")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise SetAside("oversize", f"over the {max_bytes}-byte limit")
    except OSError as exc:
        raise SetAside("unreadable", f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    return SpoolFile(path, st.st_uid, st.st_mtime, b"".join(chunks))


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _check_json(value: Any, where: str, depth: int = 0) -> None:
    """Nested JSON a database stores as it is: bounded depth, strings without NUL or lone surrogates,
    integers within 64 bits."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH}")
    if isinstance(value, str):
        if "\0" in value:
            raise ValueError(f"{where}: NUL character in a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: invalid UTF-8 (lone surrogate) in a string") from None
    elif isinstance(value, bool) or value is None or isinstance(value, float):
        return
    elif isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{where}: integer out of 64-bit range")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, where, depth + 1)
            _check_json(item, f"{where}.{key}"[:80], depth + 1)


def _field(data: dict[str, Any], key: str, types: tuple[type, ...], nullable: bool = False,
           pattern: re.Pattern[str] | None = None) -> Any:
    if key not in data:
        raise ValueError(f"{key}: missing")
    value = data[key]
    if value is None and nullable:
        return None
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if ok and pattern is not None and not pattern.fullmatch(value):
        ok = False
    if not ok:
        names = " or ".join({"str": "string", "dict": "object", "int": "integer", "bool": "true/false"}[t.__name__]
                            for t in types) + (" or null" if nullable else "")
        what = f"{names} matching {pattern.pattern}" if pattern else names
        raise ValueError(f"{key}: expected {what}, got {json.dumps(value)[:60]}")
    return value


def parse_submission(f: SpoolFile) -> dict[str, Any]:
    """A submission record's row, every field checked; the user is the file's owner."""
    try:
        data = json.loads(f.data, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"not JSON: {str(exc)[:120]}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    version = data.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise ValueError(f"version: expected {' or '.join(map(str, READ_VERSIONS))}, "
                         f"got {json.dumps(version)[:20]}")
    _check_json(data, "record")
    for key in FREE_FIELDS:
        if key in data and (size := field_size(data[key])) > MAX_FIELD_BYTES:
            raise ValueError(f"{key}: {size} bytes of JSON, over the {MAX_FIELD_BYTES}-byte limit")
    submitted = _field(data, "submitted_at", (str,))
    try:
        when = datetime.fromisoformat(submitted)
    except ValueError:
        raise ValueError(f"submitted_at: expected an ISO-8601 time, got {json.dumps(submitted)[:60]}") from None
    if when.tzinfo is None:
        raise ValueError("submitted_at: expected a time with its UTC offset")
    try:  # an offset can carry 0001-01-01 or 9999-12-31 past datetime's range
        when = when.astimezone(UTC).replace(tzinfo=None)
    except OverflowError:
        raise ValueError(f"submitted_at: {json.dumps(submitted)[:60]} out of range") from None
    if not 1970 <= when.year <= 2999:
        raise ValueError(f"submitted_at: year {when.year} out of range")
    if when > utcnow() + FUTURE_SLACK:
        raise ValueError(f"submitted_at: {submitted[:40]} is in the future")
    exit_code = _field(data, "sbatch_exit", (int,), nullable=True)
    if exit_code is not None and not -(2**31) < exit_code < 2**31:
        raise ValueError("sbatch_exit: out of range")
    row = {
        "record_id": _field(data, "record_id", (str,), pattern=_RECORD_ID),
        "cluster": _field(data, "cluster", (str,), nullable=True, pattern=_NAME) or "default",
        "job_id": _field(data, "job_id", (str,), nullable=True, pattern=_JOB_ID),
        "user": _owner(f.uid),
        "submitted_at": when,
        "script_sha256": _field(data, "script_sha256", (str,), nullable=True, pattern=_SHA256),
        "sbatch_exit": exit_code,
        "features": _field(data, "features", (dict,)),
        "original_request": _field(data, "original_request", (dict,), nullable=True),
        "decision": _field(data, "decision", (dict,), nullable=True),
        "changed": _field(data, "changed", (bool,)),
        "decision_id": _decision_id(data.get("decision")),
        "source": SOURCES[0], "decider": _decider(data.get("decision")), "model_version": None, "script_text": None,
    }
    if version >= 2:
        row.update(_lineage(data, row["script_sha256"]))
    return row


def _lineage(data: dict[str, Any], sha: str | None) -> dict[str, Any]:
    """A version-2 record's lineage fields. The script text must hash to the record's script_sha256
    (so one sha256 never names two texts), and only the daemon's records name a user (their file's
    owner is the daemon, which the admission step checks)."""
    source = _field(data, "source", (str,))
    if source not in SOURCES:
        raise ValueError(f"source: expected {' or '.join(SOURCES)}, got {json.dumps(source)[:40]}")
    text = _field(data, "script_text", (str,), nullable=True)
    if text is not None:
        raw = text.encode("utf-8")
        if len(raw) > MAX_SCRIPT_BYTES:
            raise ValueError(f"script_text: {len(raw)} bytes, over the {MAX_SCRIPT_BYTES}-byte limit")
        if sha is None:
            raise ValueError("script_text: given without script_sha256")
        if hexdigest("sha256", raw) != sha:
            raise ValueError(f"script_text: its sha256 is {hexdigest('sha256', raw)[:12]}..., "
                             f"not the record's script_sha256 {sha[:12]}...")
    out: dict[str, Any] = {"source": source, "script_text": text,
                           "model_version": _field(data, "model_version", (str,), nullable=True, pattern=_DIGEST)}
    if source == "lua":
        out["user"] = _field(data, "user", (str,), pattern=_USER)
    return out


def _decider(decision: Any) -> str | None:
    """The decider the record's decision names ("model", "rules", "keep"), if well-formed."""
    value = decision.get("decider") if isinstance(decision, dict) else None
    return value if isinstance(value, str) and _DECIDER.fullmatch(value) else None


def _decision_id(decision: Any) -> str | None:
    """gsbatch's decision id (``decision.id``, 12 hex digits), which its comment tag carries too."""
    value = decision.get("id") if isinstance(decision, dict) else None
    return value if isinstance(value, str) and DECISION_ID.fullmatch(value) else None


def read_submission(path: str) -> dict[str, Any]:
    """Validate one spool file; the user comes from the file's owner."""
    f = open_spool_file(path)
    if f is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", path)
    return parse_submission(f)


# what happens to one file, besides being set aside (a verdict's action is then the SetAside kind)
STORE, WAIT, DUPLICATE = "+store", "+wait", "+duplicate"


class _Verdict(NamedTuple):
    action: str  # STORE, WAIT, DUPLICATE, or a SetAside kind
    reason: str = ""


class _SpoolKind(NamedTuple):
    """What differs between the two spools."""

    wanted: Callable[[str], bool]
    parse: Callable[[SpoolFile], dict[str, Any]]
    admit: Callable[[Connection, list[tuple[SpoolFile, dict[str, Any]]], Collection[int], datetime],
                    list[_Verdict]]
    store: Callable[[Connection, list[dict[str, Any]]], None]


def _job_users(conn: Connection, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], set[str | None]]:
    """The users of the jobs each (cluster, id) names: the job itself, or the array or hetjob it is the
    id of, or the job whose raw id it is (a prolog's collector may only know that)."""
    out: dict[tuple[str, str], set[str | None]] = {}
    by_cluster: dict[str, set[str]] = {}
    for cluster, job_id in keys:
        by_cluster.setdefault(cluster, set()).add(job_id)
    for cluster, ids in by_cluster.items():
        ordered = sorted(ids)
        for start in range(0, len(ordered), 200):  # 4 x 200 binds: under every backend's limit
            part = ordered[start:start + 200]
            numbers = {int(i): i for i in part if i.isdigit() and len(i) <= 18}
            cond: ColumnElement[bool] = JOBS.c.job_id.in_(part)
            if numbers:
                cond = or_(cond, JOBS.c.job_id_raw.in_(list(numbers)), JOBS.c.array_job_id.in_(list(numbers)),
                           JOBS.c.het_job_id.in_(list(numbers)))
            rows = conn.execute(select(JOBS.c.job_id, JOBS.c.job_id_raw, JOBS.c.array_job_id, JOBS.c.het_job_id,
                                       JOBS.c.user).where(JOBS.c.cluster == cluster, cond))
            for r in rows:
                names = {r.job_id} | {numbers[n] for n in (r.job_id_raw, r.array_job_id, r.het_job_id) if n in numbers}
                for name in names & set(part):
                    out.setdefault((cluster, name), set()).add(r.user)
    return out


def _linked(f: SpoolFile, cluster: str, job_id: str | None, users: dict[tuple[str, str], set[str | None]],
            trusted: Collection[int], now: datetime, what: str) -> _Verdict:
    """Whether a record may be attached to its job: the file's owner must be the job's user."""
    if f.uid in trusted or job_id is None:
        return _Verdict(STORE)
    owners = users.get((cluster, job_id))
    if not owners:
        # in seconds, not datetimes: the owner sets the mtime, and one past year 9999 overflows a datetime
        if now.replace(tzinfo=UTC).timestamp() - f.mtime > JOB_WAIT.total_seconds():
            return _Verdict("job unknown", f"job {cluster}/{job_id} not in the accounting after "
                                           f"{JOB_WAIT.total_seconds() / 3600:.0f} h")
        return _Verdict(WAIT)
    me = _owner(f.uid)
    if owners != {me}:
        theirs = ", ".join(sorted(str(u) for u in owners))
        return _Verdict("forged", f"{what} for job {cluster}/{job_id} of user {theirs}, "
                                  f"but the file belongs to {me}")
    return _Verdict(STORE)


_SUBMISSION_COLUMNS = ("record_id", "cluster", "job_id", "user", "submitted_at", "script_sha256", "sbatch_exit",
                       "features", "original_request", "decision", "changed", "decision_id", "source", "decider",
                       "model_version")


def _stored_submissions(conn: Connection, ids: list[str]) -> dict[str, dict[str, Any]]:
    table = cast(Table, Submission.__table__)
    out: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 500):
        rows = conn.execute(select(*(table.c[c] for c in _SUBMISSION_COLUMNS))
                            .where(table.c.record_id.in_(ids[start:start + 500])))
        out.update({r["record_id"]: dict(r) for r in rows.mappings()})
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a stored row ``a`` is the record ``b`` again; a hook decision's job (and its cluster) is
    filled in after it was stored (link_decisions), so a record without one matches either way."""
    linked = b["source"] == "lua" and b["job_id"] is None
    return all(a[c] == b[c] for c in _SUBMISSION_COLUMNS if not (linked and c in ("job_id", "cluster")))


def _admit_submissions(conn: Connection, items: list[tuple[SpoolFile, dict[str, Any]]], trusted: Collection[int],
                       now: datetime) -> list[_Verdict]:
    users = _job_users(conn, {(r["cluster"], r["job_id"]) for _, r in items if r["job_id"] is not None})
    stored = _stored_submissions(conn, sorted({r["record_id"] for _, r in items}))
    verdicts = []
    for f, row in items:
        if row["source"] == "lua" and f.uid not in trusted:
            # Only the daemon (root, or the account this ingest runs as: `render serve` runs it as the
            # nightly account) records the hook's decisions, and only it may say whose job it was.
            verdicts.append(_Verdict("forged", f"a decision record of the Lua hook's daemon, naming user "
                                               f"{row['user']}, but the file belongs to {_owner(f.uid)}, "
                                               "not to the daemon's account"))
            continue
        verdict = _linked(f, row["cluster"], row["job_id"], users, trusted, now, "a submission record")
        old = stored.get(row["record_id"])
        if verdict.action == STORE and old is not None:
            verdict = (_Verdict(DUPLICATE) if _same(old, row) else
                       _Verdict("duplicate record_id", f"record_id {row['record_id']} already stored with other "
                                                         "content"))
        if verdict.action == STORE:
            stored[row["record_id"]] = row  # a second file with this id in the batch is a duplicate of this one
        verdicts.append(verdict)
    return verdicts


def _store_submissions(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """The scripts first, each text once (a sha256 already stored is not written again), then the
    submissions, each linked to the registered model version its digest names, if any."""
    scripts: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["script_text"] is not None and r["script_sha256"] not in scripts:
            scripts[r["script_sha256"]] = {"sha256": r["script_sha256"], "text": r["script_text"],
                                           "first_seen": r["submitted_at"]}
    store_scripts(conn, list(scripts.values()))
    versions = _registered(conn, {r["model_version"] for r in rows if r["model_version"]})
    conn.execute(cast(Table, Submission.__table__).insert(),
                 [{**{c: r[c] for c in _SUBMISSION_COLUMNS}, "model_version_id": versions.get(r["model_version"])}
                  for r in rows])


def store_scripts(conn: Connection, scripts: list[dict[str, Any]]) -> None:
    """Insert job_scripts rows whose sha256 is not stored yet (another ingest may store one meanwhile:
    that is no error, the text is the same by its hash)."""
    if not scripts:
        return
    table = cast(Table, JobScript.__table__)
    known: set[str] = set()
    shas = [s["sha256"] for s in scripts]
    for start in range(0, len(shas), 500):
        known.update(conn.execute(select(table.c.sha256).where(table.c.sha256.in_(shas[start:start + 500])))
                     .scalars())
    fresh = [s for s in scripts if s["sha256"] not in known]
    if not fresh:
        return
    name = conn.dialect.name
    if name in ("sqlite", "postgresql"):
        if name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        else:
            from sqlalchemy.dialects.postgresql import insert as dialect_insert  # type: ignore[assignment]
        conn.execute(dialect_insert(table).on_conflict_do_nothing(index_elements=["sha256"]), fresh)
    else:
        from sqlalchemy.dialects.mysql import insert as mysql_insert

        stmt = mysql_insert(table)
        conn.execute(stmt.on_duplicate_key_update(sha256=stmt.inserted.sha256), fresh)


def _registered(conn: Connection, digests: set[str]) -> dict[str, int]:
    """The model_versions id of each digest that a registered version has."""
    if not digests:
        return {}
    table = cast(Table, ModelVersion.__table__)
    rows = conn.execute(select(table.c.digest, table.c.id).where(table.c.digest.in_(sorted(digests)))
                        .order_by(table.c.version))
    return {digest: id_ for digest, id_ in rows}


LINK_WINDOW = timedelta(days=30)  # the daemon's decisions still looked for among the jobs


def link_decisions(engine: Engine, now: datetime | None = None) -> int:
    """Give the Lua hook's recorded decisions (no job id when slurmctld asked) the job their decision
    tag went into: the job whose AdminComment carries the decision id (only the hook, in slurmctld, sets
    it), of the user the decision was for. An array's tasks or a hetjob's components count as their job;
    a decision id found on two different jobs (a user copied the tag) links to neither. Returns how
    many were linked."""
    now = now or utcnow()
    sub = cast(Table, Submission.__table__)
    with engine.begin() as conn:
        pending = conn.execute(select(sub.c.id, sub.c.cluster, sub.c.user, sub.c.decision_id)
                               .where(sub.c.source == "lua", sub.c.job_id.is_(None), sub.c.decision_id.isnot(None),
                                      sub.c.submitted_at >= now - LINK_WINDOW)).all()
        if not pending:
            return 0
        found: dict[tuple[str, str | None], set[tuple[str, str]]] = {}
        ids = sorted({p.decision_id for p in pending})
        for start in range(0, len(ids), 500):
            rows = conn.execute(select(JOBS.c.cluster, JOBS.c.user, JOBS.c.job_id, JOBS.c.array_job_id,
                                       JOBS.c.het_job_id, JOBS.c.decision_id)
                                .where(JOBS.c.decision_id.in_(ids[start:start + 500])))
            for r in rows:
                base = r.array_job_id if r.array_job_id is not None else r.het_job_id
                found.setdefault((r.decision_id, r.user), set()).add(
                    (r.cluster, str(base) if base is not None else r.job_id))
        linked = 0
        for p in pending:
            jobs = {(cluster, job_id) for cluster, job_id in found.get((p.decision_id, p.user), set())
                    if p.cluster in (cluster, "default")}
            if len(jobs) == 1:
                cluster, job_id = next(iter(jobs))
                conn.execute(sub.update().where(sub.c.id == p.id).values(job_id=job_id, cluster=cluster))
                linked += 1
    return linked


SUBMISSIONS = _SpoolKind(lambda n: n.startswith("sub-") and n.endswith(".json"), parse_submission,
                         _admit_submissions, _store_submissions)


def _drain(engine: Engine, directory: str, kind: _SpoolKind, report: Report,
           trusted: Collection[int] | None = None, fetch: FetchJobs | None = None) -> Report:
    """Load every finished record of a spool, a batch at a time; see the comment above."""
    trusted = {0, os.geteuid()} if trusted is None else trusted
    try:
        names = sorted(n for n in os.listdir(directory) if kind.wanted(n))
    except FileNotFoundError:
        return report
    except OSError as exc:
        report.files_unreadable.append(f"{shown(directory)}: cannot list: {exc.strerror}")
        return report
    batch: list[SpoolFile] = []
    size = 0
    shares: dict[int, list[int]] = {}  # uid: [files, bytes] read this run
    for name in names:
        path = os.path.join(directory, name)
        try:
            f = open_spool_file(path)
        except SetAside as exc:
            _set_aside(path, exc.kind, str(exc), report)
            continue
        except _Unreadable:
            report.files_unreadable.append(shown(path))
            continue
        if f is None:
            continue
        if f.uid not in trusted:
            share = shares.setdefault(f.uid, [0, 0])
            if share[0] >= USER_FILES_PER_RUN or share[1] + len(f.data) > USER_BYTES_PER_RUN:
                report.files_deferred += 1
                continue
            share[0] += 1
            share[1] += len(f.data)
        batch.append(f)
        size += len(f.data)
        if len(batch) >= BATCH_FILES or size >= BATCH_BYTES:
            _load_batch(engine, batch, kind, report, trusted, fetch)
            batch, size = [], 0
    if batch:
        _load_batch(engine, batch, kind, report, trusted, fetch)
    return report


def _set_aside(path: str, kind: str, reason: str, report: Report) -> None:
    """Rename the file ``*.rejected`` (never read again) and report it. A name too long to take the
    suffix is cut to a short one that still starts like it and ends with a hash of the whole name, so
    it is not re-read and re-reported every night."""
    target = path + ".rejected"
    try:
        try:
            os.replace(path, target)
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            directory, name = os.path.split(path)
            start = name[:100]
            while len(os.fsencode(start)) > 100:  # whole characters, 100 bytes at most
                start = start[:-1]
            target = os.path.join(directory, f"{start}~{hexdigest('sha256', os.fsencode(name))[:16]}.rejected")
            os.replace(path, target)
            reason += f" (renamed {shown(os.path.basename(target))}: its name is too long to take .rejected)"
    except OSError as exc:
        reason += f" (could not be renamed: {exc.strerror})"
    report.files_rejected.append(f"{shown(path)}: {kind}: {reason}")
    report.rejected_kinds[kind] += 1


def _remove(path: str, report: Report) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        report.files_kept.append(f"{shown(path)}: loaded but not removed: {exc.strerror}")


def _load_batch(engine: Engine, files: list[SpoolFile], kind: _SpoolKind, report: Report,
                trusted: Collection[int], fetch: FetchJobs | None = None) -> None:
    parsed: list[tuple[SpoolFile, dict[str, Any]]] = []
    for f in files:
        try:
            parsed.append((f, kind.parse(f)))
        except Exception as exc:  # noqa: BLE001 - whatever one file does to the parser, the run goes on
            _set_aside(f.path, "malformed", _why(exc).removeprefix(f"{f.path}: "), report)
    if not parsed:
        return
    if fetch is not None:
        _fetch_missing(engine, parsed, fetch)
    chosen: list[tuple[SpoolFile, dict[str, Any]]] = []
    for (f, row), verdict in _admitted(engine, kind, parsed, trusted, report):
        if verdict.action == STORE:
            chosen.append((f, row))
        elif verdict.action == WAIT:
            report.files_waiting += 1
        elif verdict.action == DUPLICATE:
            report.files_duplicate += 1
            _remove(f.path, report)
        else:
            _set_aside(f.path, verdict.action, verdict.reason, report)
    if not chosen:
        return
    try:
        with engine.begin() as conn:
            kind.store(conn, [row for _, row in chosen])
        stored = chosen
    except Exception as exc:  # noqa: BLE001 - one record's fault: found below, one record at a time
        if _connection_problem(exc):
            raise
        stored = []
        for f, row in chosen:  # the database refused the batch: one transaction per record finds which
            try:
                with engine.begin() as conn:
                    kind.store(conn, [row])
                stored.append((f, row))
            except IntegrityError:
                report.files_duplicate += 1  # a concurrent ingest stored it first
                _remove(f.path, report)
            except Exception as one:  # noqa: BLE001 - this record's alone: it is set aside, the run goes on
                if _connection_problem(one):
                    raise
                first = str(getattr(one, "orig", one)).strip().splitlines() or [type(one).__name__]
                _set_aside(f.path, "refused by the database", first[0][:200], report)
    report.files_loaded += len(stored)
    for f, _ in stored:
        _remove(f.path, report)


def _why(exc: Exception) -> str:
    """A check's own message, or an unforeseen failure named by its type."""
    return str(exc) if isinstance(exc, ValueError | TypeError | KeyError) else f"{type(exc).__name__}: {str(exc)[:160]}"


FETCH_AFTER = timedelta(minutes=10)  # younger records' jobs come by sacct's window, or are still being written


def _fetch_missing(engine: Engine, parsed: list[tuple[SpoolFile, dict[str, Any]]], fetch: FetchJobs) -> None:
    """Ask Slurm by id for the jobs the history lacks that records at least ``FETCH_AFTER`` old
    name (``ingest_jobs_by_id``); one it cannot answer leaves its records waiting, as before. Not
    sooner: for a few seconds after a held job is cancelled, slurmdbd holds a stand-in row for it
    (no partition, job name 'allocation'), which would be stored for good."""
    old = utcnow().replace(tzinfo=UTC).timestamp() - FETCH_AFTER.total_seconds()
    keys = {(r["cluster"], r["job_id"]) for f, r in parsed if isinstance(r.get("job_id"), str) and f.mtime < old}
    with engine.connect() as conn:
        missing = keys - set(_job_users(conn, keys))
    if missing:
        try:
            fetch(sorted(missing))
        except (RuntimeError, OSError):
            pass


def _admitted(engine: Engine, kind: _SpoolKind, parsed: list[tuple[SpoolFile, dict[str, Any]]],
              trusted: Collection[int], report: Report) -> list[tuple[tuple[SpoolFile, dict[str, Any]], _Verdict]]:
    """Each parsed record with its verdict. Checks that fail for a batch are run one record at a time,
    and a record they still fail on is set aside: one record never stops the run."""
    try:
        with engine.connect() as conn:
            return list(zip(parsed, kind.admit(conn, parsed, trusted, utcnow()), strict=True))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        if _connection_problem(exc):
            raise
        if len(parsed) > 1:
            return [one for item in parsed for one in _admitted(engine, kind, [item], trusted, report)]
        _set_aside(parsed[0][0].path, "unexpected error", _why(exc), report)
        return []


def _connection_problem(exc: BaseException) -> bool:
    """A lost or locked database is everyone's problem, not one record's: it ends the run."""
    return isinstance(exc, DBAPIError) and (exc.connection_invalidated
                                            or isinstance(exc, OperationalError | InterfaceError))


def drain_spool(engine: Engine, directory: str, kind: _SpoolKind, report: Report | None = None,
                trusted: Collection[int] | None = None) -> Report:
    """Load one spool; ``trusted`` uids (default: root and this process's) may attach records to any job."""
    return _drain(engine, directory, kind, report or Report(), trusted)


def load_submissions(engine: Engine, directory: str, report: Report | None = None,
                     trusted: Collection[int] | None = None, fetch: FetchJobs | None = None) -> Report:
    """Load gsbatch's and the daemon's submission records (once each, by record id), then link the
    daemon's decisions to their jobs (``link_decisions``). ``fetch``: loads jobs the history lacks
    by id (the live ingest's ``ingest_jobs_by_id``), asked before a record is left waiting."""
    report = _drain(engine, directory, SUBMISSIONS, report or Report(), trusted, fetch)
    report.decisions_linked += link_decisions(engine)
    report.expired += expire_unlinked(engine)
    return report


def expire_unlinked(engine: Engine, now: datetime | None = None) -> int:
    """Delete stored records naming no job older than NO_JOB_KEEP, and the script texts only they
    named: no job will claim them, and without this a user could fill the store with them night
    after night. Returns how many were deleted."""
    cutoff = (now or utcnow()) - NO_JOB_KEEP
    sub, scripts = cast(Table, Submission.__table__), cast(Table, JobScript.__table__)
    old = (sub.c.job_id.is_(None)) & (sub.c.submitted_at < cutoff)
    with engine.begin() as conn:
        shas = set(conn.execute(select(sub.c.script_sha256).where(old, sub.c.script_sha256.isnot(None))).scalars())
        gone = conn.execute(sub.delete().where(old)).rowcount
        ordered = sorted(shas)
        for start in range(0, len(ordered), 500):
            part = ordered[start:start + 500]
            named = set(conn.execute(select(sub.c.script_sha256).where(sub.c.script_sha256.in_(part))).scalars())
            unnamed = [s for s in part if s not in named]
            if unnamed:
                conn.execute(scripts.delete().where(scripts.c.sha256.in_(unnamed)))
    return gone


# --- GPU collector records ------------------------------------------------------------------


def _gpu_row(f: SpoolFile) -> dict[str, Any]:
    from slurmgpu.collector.records import parse_record

    rec = parse_record(f.data, f.path)
    return {
        "cluster": rec.cluster, "job_id": rec.job_id, "hostname": rec.hostname, "source": rec.source,
        "gpus": len(rec.gpus), "peak_mem_mib": rec.peak_gpu_mem_mib,
        "peak_proc_mem_mib": max((g.peak_proc_mem_mib for g in rec.gpus if g.peak_proc_mem_mib is not None),
                                 default=None),
        "mean_util": rec.mean_gpu_util, "max_util": rec.max_gpu_util, "samples": rec.samples,
        "start_time": rec.start.replace(tzinfo=None), "end_time": rec.end.replace(tzinfo=None),
        "detail": [g._asdict() for g in rec.gpus],
        "gpu_oom": rec.gpu_oom.framework if rec.gpu_oom else None,
        "gpu_oom_line": rec.gpu_oom.line if rec.gpu_oom else None,
    }


_USAGE_KEY = ("cluster", "job_id", "hostname", "source")


def _admit_gpu(conn: Connection, items: list[tuple[SpoolFile, dict[str, Any]]], trusted: Collection[int],
               now: datetime) -> list[_Verdict]:
    """Root's collector records are taken as they are (a newer one for a job and host replaces the
    older); a user's own record only for a job of theirs, and never over one already stored."""
    users = _job_users(conn, {(r["cluster"], r["job_id"]) for f, r in items if f.uid not in trusted})
    table = cast(Table, GpuUsage.__table__)
    untrusted = [r for f, r in items if f.uid not in trusted]
    existing: set[tuple[str, ...]] = set()
    for r in untrusted:
        if conn.execute(select(table.c.id).where(*(table.c[k] == r[k] for k in _USAGE_KEY))).first():
            existing.add(tuple(r[k] for k in _USAGE_KEY))
    seen: set[tuple[str, ...]] = set()
    verdicts = []
    for f, row in items:
        key = tuple(row[k] for k in _USAGE_KEY)
        verdict = _linked(f, row["cluster"], row["job_id"], users, trusted, now, "a GPU record")
        if verdict.action == STORE and key in seen:
            verdict = _Verdict("duplicate GPU record", "another file in this run holds the record of this job and host")
        elif verdict.action == STORE and f.uid not in trusted and key in existing:
            verdict = _Verdict("duplicate GPU record", "a record of this job and host is already stored")
        if verdict.action == STORE:
            seen.add(key)
        verdicts.append(verdict)
    return verdicts


def _store_gpu(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, cast(Table, GpuUsage.__table__), rows, _USAGE_KEY)


GPU_RECORDS = _SpoolKind(lambda n: n.endswith(".json") and not n.startswith("."), _gpu_row, _admit_gpu, _store_gpu)


def load_gpu_records(engine: Engine, directory: str, report: Report | None = None,
                     trusted: Collection[int] | None = None) -> Report:
    """Load slurmgpu-monitor's per-job records (a host's record for a job replaces its older one)."""
    return _drain(engine, directory, GPU_RECORDS, report or Report(), trusted)
