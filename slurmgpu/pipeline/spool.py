"""Drop-box records: gsbatch's submission records, written by users, loaded by the admin ingest.

On a shared login node users get no write access to the database. gsbatch writes one small
JSON file per submission into a spool directory that is sticky and write-only for others
(mode 3733, owned by the nightly account and its group `slurmgpu`: nobody can list or read
anyone else's records) and the ingest, run by the nightly account, loads them and takes the user
from the file's owner, never from what the file says. In a setgid spool a record gets the
directory's group and mode 0640, so the nightly account (in that group) can read it and no other
user can; anywhere else it is 0600. Writes are atomic (temporary name, then rename), so the ingest
never sees half a record. See docs/security.md, "Spools and the nightly account".
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Mapping

from slurmgpu.typing_lite import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

# Version 2 (decision lineage) adds ``source`` ("gsbatch" or "lua"), ``script_text`` (the script's
# UTF-8 text, whose sha256 is ``script_sha256``), ``model_version`` (Bundle.digest, or None) and, in
# the daemon's records only, ``user`` and ``uid`` (whom slurmctld said the job is for). The ingest
# reads versions 1 and 2; version 1 records load as gsbatch's, without a script text.
RECORD_VERSION = 2
READ_VERSIONS = (1, 2)
SOURCES = ("gsbatch", "lua")
MAX_RECORD_BYTES = 1 << 20  # the ingest reads no larger file
MAX_SCRIPT_BYTES = 512 << 10  # a script's text rides in its record up to this size (UTF-8 bytes)
# Each free-form field (features, original_request, decision) at most this much JSON (``field_size``):
# the writer cuts long lists and strings to fit (``fitted``), the ingest stores no larger one.
MAX_FIELD_BYTES = 64 << 10
FREE_FIELDS = ("features", "original_request", "decision")
PERSONAL_SPOOL = os.path.join("~", ".local", "share", "slurmgpu", "spool")


def submission_spool(configured: str | None, env: Mapping[str, str]) -> str:
    """$SLURMGPU_SUBMISSION_SPOOL, then the site's spool, then a personal one."""
    return os.path.expanduser(env.get("SLURMGPU_SUBMISSION_SPOOL") or configured
                              or os.path.join(PERSONAL_SPOOL, "submissions"))


def atomic_write(path: str, data: bytes, mode: int) -> None:
    """Readers see no file or the whole file: temp file in the same directory, fsync, rename.

    The temp name starts with a dot so a ``*.json`` glob never picks it up; on any failure it is removed.
    """
    tmp = _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            _write_all(fd, data, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    sync_dir(os.path.dirname(path))


def write_files(directory: str, files: Sequence[tuple[str, bytes]], mode: int) -> list[OSError | None]:
    """Write several files into DIRECTORY, each as ``atomic_write`` does (a reader sees no file or the
    whole file), with one flush of the filesystem for all of them instead of an fsync per file: every
    temp file is written, then ``syncfs`` puts all their data on disk, then each is renamed and the
    directory fsync'd once. An fsync per file made the daemon's record writer slower than the daemon
    answers (about 200 records/s); the one flush also writes whatever else is pending on that
    filesystem. Where ``syncfs`` is missing or fails, each file is fsync'd as ``atomic_write`` does.
    Returns, for each file in order, None (written, durable) or why it was not (its temp file removed)."""
    results: list[OSError | None] = [None] * len(files)
    opened: list[tuple[int, int, str, str]] = []  # (index, fd, temp name, path)
    left: set[str] = set()  # temp names not renamed: removed whatever happens
    try:
        try:
            for i, (path, data) in enumerate(files):
                tmp = _temp_name(path)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
                except OSError as exc:
                    results[i] = exc
                    continue
                opened.append((i, fd, tmp, path))
                left.add(tmp)
                try:
                    _write_all(fd, data, mode)
                except OSError as exc:
                    results[i] = exc
            if opened and not _syncfs(opened[0][1]):
                for i, fd, _, _ in opened:
                    if results[i] is None:
                        try:
                            os.fsync(fd)
                        except OSError as exc:
                            results[i] = exc
        finally:
            for _, fd, _, _ in opened:
                os.close(fd)
        for i, _, tmp, path in opened:
            if results[i] is None:
                try:
                    os.replace(tmp, path)
                    left.discard(tmp)
                except OSError as exc:
                    results[i] = exc
    finally:
        for tmp in left:
            _unlink(tmp)
    if any(r is None for r in results):
        sync_dir(directory)
    return results


def _temp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}.tmp")


def _write_all(fd: int, data: bytes, mode: int) -> None:
    os.fchmod(fd, mode)  # whatever the umask
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_SYNCFS: list[Callable[[int], int] | None] = []  # libc's syncfs once looked up (None: there is none)


def _syncfs(fd: int) -> bool:
    """Flush the filesystem that holds ``fd`` (since Linux 5.8 a write-back error fails it); False
    when it could not be asked or failed. ctypes is imported only by a writer of batches."""
    if not _SYNCFS:
        try:
            import ctypes

            _SYNCFS.append(ctypes.CDLL(None, use_errno=True).syncfs)
        except (OSError, AttributeError):
            _SYNCFS.append(None)
    call = _SYNCFS[0]
    return call is not None and call(fd) == 0


def sync_dir(directory: str) -> None:
    """Make the renames into DIRECTORY durable (the files are complete either way)."""
    try:
        dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_output(path: str, data: bytes, mode: int) -> None:
    """Write an output file the admin named: a regular file or a new path is replaced atomically
    (atomic_write); anything else (a character device such as /dev/null, a FIFO, a symlink such as
    /dev/stdout) is opened and written in place, so the device, pipe or link stays what it was.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        atomic_write(path, data, mode)
        return
    if stat.S_ISREG(st.st_mode):
        atomic_write(path, data, mode)
        return
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)  # follows the link
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def gpu_spool(configured: str | None, env: Mapping[str, str]) -> str:
    """$SLURMGPU_GPU_SPOOL, then the site's collector spool, then a personal one."""
    return os.path.expanduser(env.get("SLURMGPU_GPU_SPOOL") or configured or os.path.join(PERSONAL_SPOOL, "gpu"))


def record_mode(directory: str) -> int:
    """0640 in a setgid spool (the file takes the directory's group: the nightly account's), else 0600.

    Only the setgid bit makes the group readable: without it the file would take the writer's own
    primary group, which on many sites every user shares.
    """
    try:
        return 0o640 if os.stat(directory).st_mode & stat.S_ISGID else 0o600
    except OSError:
        return 0o600  # the write itself will fail and say why


def field_size(value: Any) -> int:
    """A field's size as the record holds it (compact JSON, ASCII escapes)."""
    return len(json.dumps(value, separators=(",", ":"), sort_keys=True))


_SCALARS = frozenset({int, float, bool})  # exactly these types: stored as they are


def storable(value: Any, items: int = 100, chars: int = 4096) -> Any:
    """``value`` as a database stores it, whatever the job said: a string that is not UTF-8 (a file or
    job name's bytes, read with surrogateescape) or holds NUL becomes ``{"base64": its bytes}``, the
    bytes kept; a key of that kind becomes its text with ``\\xNN`` escapes (a key must be a string);
    a list or object longer than ``items`` keeps its first ones and ends with ``{"omitted": count}``
    (an object: key ``"omitted"``); a string longer than ``chars`` keeps its start and says how much
    was cut."""
    if value is None or type(value) in _SCALARS or _plain(value, chars):  # most of a decision record
        return value
    if isinstance(value, str):
        if _unstorable(value):
            import base64  # rare (bytes that are not UTF-8): gsbatch's start-up does not pay for it

            return {"base64": base64.b64encode(_raw(value)).decode()}
        return value if len(value) <= chars else f"{value[:chars]}... [{len(value) - chars} characters omitted]"
    if isinstance(value, list | tuple):
        kept = [v if v is None or type(v) in _SCALARS or _plain(v, chars) else storable(v, items, chars)
                for v in value[:items]]
        return kept + [{"omitted": len(value) - items}] if len(value) > items else kept
    if isinstance(value, Mapping):
        pairs = list(value.items())
        out = {k if _plain(k, chars) else _key(k, chars):
               v if v is None or type(v) in _SCALARS or _plain(v, chars) else storable(v, items, chars)
               for k, v in pairs[:items]}
        if len(pairs) > items:
            out["omitted"] = len(pairs) - items
        return out
    return value


def fitted(value: Any) -> Any:
    """``storable(value)`` cut harder until it is at most MAX_FIELD_BYTES; at worst only its size."""
    for items, chars in ((100, 4096), (10, 256), (1, 32)):
        out = storable(value, items, chars)
        if field_size(out) <= MAX_FIELD_BYTES:
            return out
    return {"omitted_bytes": field_size(storable(value))}


def _plain(value: Any, chars: int) -> bool:
    """A string stored as it is, tested without a call per character class: the walk's leaves and keys
    are mostly such (ASCII encodes to UTF-8 as it is), and a call of ``storable`` each cost the daemon's
    record writer half its time."""
    return type(value) is str and value.isascii() and len(value) <= chars and "\0" not in value


def _unstorable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return "\0" in text


def _raw(text: str) -> bytes:
    """The bytes a string was read from: surrogateescape gives them back; any other lone surrogate is
    kept as its own (invalid) UTF-8 encoding."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _key(key: Any, chars: int) -> str:
    text = key if isinstance(key, str) else str(key)
    if _unstorable(text):
        text = _raw(text).decode("utf-8", "backslashreplace").replace("\0", "\\x00")
    return text[:chars]


def write_record(directory: str, record: Mapping[str, Any]) -> str:
    """Write one submission record atomically, readable by its owner (and, in a setgid spool, by the
    spool's group); returns its path. See ``record_file``."""
    path, data = record_file(directory, record)
    atomic_write(path, data, record_mode(directory))
    return path


def record_file(directory: str, record: Mapping[str, Any]) -> tuple[str, bytes]:
    """A submission record's path in DIRECTORY and its bytes. The free-form fields are made storable
    and cut to fit (``fitted``), so the ingest stores every record of a job sbatch took. A record the
    ingest would still find too large goes without its script text (JSON escapes can make a text of
    MAX_SCRIPT_BYTES larger than the file limit)."""
    path = os.path.join(directory, f"sub-{record['record_id']}.json")
    # A record within MAX_FIELD_BYTES whole has every field within it (each field's JSON is part of the
    # record's): ``fitted`` would return each as ``storable`` does, so the record is dumped once.
    data = json.dumps({**record, **{k: storable(record[k]) for k in FREE_FIELDS if k in record}},
                      separators=(",", ":"), sort_keys=True).encode()
    if len(data) > MAX_FIELD_BYTES:
        record = {**record, **{k: fitted(record[k]) for k in FREE_FIELDS if k in record}}
        data = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
        if len(data) > MAX_RECORD_BYTES and record.get("script_text") is not None:
            data = json.dumps({**record, "script_text": None}, separators=(",", ":"), sort_keys=True).encode()
    return path, data


def script_text(data: bytes | None) -> str | None:
    """The text a record carries for a script's bytes: the bytes themselves when they are UTF-8 and
    at most MAX_SCRIPT_BYTES (so the stored text hashes to the record's script_sha256), else None."""
    if data is None or len(data) > MAX_SCRIPT_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def new_record(**fields: Any) -> dict[str, Any]:
    """A submission record of the current version; lineage fields not given are gsbatch's defaults
    (no script text, no model version)."""
    # os.urandom rather than uuid: importing uuid costs gsbatch ~10 ms.
    return {"version": RECORD_VERSION, "record_id": os.urandom(16).hex(),
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "source": SOURCES[0], "script_text": None, "model_version": None, **fields}


def write_private(path: str, data: bytes) -> None:
    """Atomically write a per-user cache file: mode 0600 in a directory created 0700, so no other
    user reads or plants what gsbatch will trust on the next submission."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    atomic_write(path, data, 0o600)


def ensure_personal_spool(directory: str) -> None:
    """A personal spool is created private (0700); a site spool is the admin's to create."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
