"""Drop-box records: gsbatch's submission records, written by users, loaded by the admin ingest.

On a shared login node users get no write access to the database. gsbatch writes one small
JSON file per submission into a spool directory that is sticky and write-only for others
(mode 1733: nobody can list or read anyone else's records) and the ingest, run by the admin,
loads them and takes the user from the file's owner, never from what the file says.
Writes are atomic (temporary name, then rename), so the ingest never sees half a record.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

RECORD_VERSION = 1
PERSONAL_SPOOL = os.path.join("~", ".local", "share", "slurmgpu", "spool")


def submission_spool(configured: str | None, env: Mapping[str, str]) -> str:
    """$SLURMGPU_SUBMISSION_SPOOL, then the site's spool, then a personal one."""
    return os.path.expanduser(env.get("SLURMGPU_SUBMISSION_SPOOL") or configured
                              or os.path.join(PERSONAL_SPOOL, "submissions"))


def write_record(directory: str, record: Mapping[str, Any]) -> str:
    """Write one record atomically, readable by its owner only; returns the final path."""
    name = f"sub-{record['record_id']}.json"
    tmp = os.path.join(directory, f".{name}.tmp")
    data = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        final = os.path.join(directory, name)
        os.replace(tmp, final)
        return final
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def new_record(**fields: Any) -> dict[str, Any]:
    return {"version": RECORD_VERSION, "record_id": uuid.uuid4().hex,
            "submitted_at": datetime.now(UTC).isoformat(timespec="seconds"), **fields}


def ensure_personal_spool(directory: str) -> None:
    """A personal spool is created private (0700); a site spool is the admin's to create."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
