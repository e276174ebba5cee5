"""Drop-box records: gsbatch's submission records, written by users, loaded by the admin ingest.

On a shared login node users get no write access to the database. gsbatch writes one small
JSON file per submission into a spool directory that is sticky and write-only for others
(mode 1733: nobody can list or read anyone else's records) and the ingest, run by the admin,
loads them and takes the user from the file's owner, never from what the file says.
Writes are atomic (temporary name, then rename), so the ingest never sees half a record.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

RECORD_VERSION = 1
PERSONAL_SPOOL = os.path.join("~", ".local", "share", "slurmgpu", "spool")


def submission_spool(configured: str | None, env: Mapping[str, str]) -> str:
    """$SLURMGPU_SUBMISSION_SPOOL, then the site's spool, then a personal one."""
    return os.path.expanduser(env.get("SLURMGPU_SUBMISSION_SPOOL") or configured
                              or os.path.join(PERSONAL_SPOOL, "submissions"))


def atomic_write(path: str, data: bytes, mode: int) -> None:
    """Readers see no file or the whole file: temp file in the same directory, fsync, rename.

    The temp name starts with a dot so a ``*.json`` glob never picks it up; on any failure it is removed.
    """
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable; the file is complete either way
        dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)



def gpu_spool(configured: str | None, env: Mapping[str, str]) -> str:
    """$SLURMGPU_GPU_SPOOL, then the site's collector spool, then a personal one."""
    return os.path.expanduser(env.get("SLURMGPU_GPU_SPOOL") or configured or os.path.join(PERSONAL_SPOOL, "gpu"))


def write_record(directory: str, record: Mapping[str, Any]) -> str:
    """Write one submission record atomically, readable by its owner only; returns its path."""
    path = os.path.join(directory, f"sub-{record['record_id']}.json")
    atomic_write(path, json.dumps(record, separators=(",", ":"), sort_keys=True).encode(), 0o600)
    return path


def new_record(**fields: Any) -> dict[str, Any]:
    # os.urandom rather than uuid: importing uuid costs gsbatch ~10 ms.
    return {"version": RECORD_VERSION, "record_id": os.urandom(16).hex(),
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), **fields}


def write_private(path: str, data: bytes) -> None:
    """Atomically write a per-user cache file: mode 0600 in a directory created 0700, so no other
    user reads or plants what gsbatch will trust on the next submission."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    atomic_write(path, data, 0o600)


def ensure_personal_spool(directory: str) -> None:
    """A personal spool is created private (0700); a site spool is the admin's to create."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
