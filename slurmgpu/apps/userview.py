"""What a user may see of the history, and the answers ``seff``, ``jobs`` and ``report`` give: for
the CLI reading the database itself, and for the daemon answering users who cannot (the history
database is 0600 to the nightly account, and a plain SQLite reader would see every user's rows).

Slurm's rule for sacct is the model: a user sees their own jobs; an account coordinator also the
jobs of the accounts they coordinate; root, SlurmUser, the nightly account and Slurm's
administrators and operators every job. Whoever asks is the uid the kernel names (SO_PEERCRED,
or the CLI's own uid), never what a request says.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.reporting import queries, seff
from slurmgpu.reporting.queries import JobUse
from slurmgpu.slurm import usage

MAX_SEFF_JOBS = 100  # job ids in one seff request: the reply (a few KiB each) stays far under 4 MiB
MAX_JOB_ROWS = 1000  # rows in one jobs answer (about 600 bytes each)
MAX_REPORT_JOBS = 20_000  # jobs behind one report answer (about 150 bytes each)
STORED_ONLY = ("GPU memory and utilisation", "decision:")  # seff's notes that a job Slurm alone has replaces
LIVE_STATES = frozenset({"RUNNING", "PENDING", "SUSPENDED", "REQUEUED", "RESIZING"})


class Viewer:
    """One asking user and what they may see; their Slurm standing (sacctmgr) is read only when
    a job is not their own, so a user looking at their own jobs costs no sacctmgr call."""

    def __init__(self, uid: int, everyone: bool = False, run: usage.Runner = usage.run_command) -> None:
        try:
            self.name: str | None = pwd.getpwuid(uid).pw_name
        except (KeyError, OverflowError):
            self.name = None
        self.uid, self._everyone, self._run = uid, everyone, run
        self._standing: usage.Standing | None = None

    @classmethod
    def this_process(cls) -> Viewer:
        """The user running this command, who reads the database directly (root sees everyone)."""
        uid = os.geteuid()
        return cls(uid, everyone=uid == 0)

    def standing(self) -> usage.Standing:
        if self._standing is None:
            self._standing = (usage.standing(self.name, self._run) if self.name and not self._everyone
                              else usage.Standing(self._everyone, frozenset()))
        return self._standing

    @property
    def everyone(self) -> bool:
        return self._everyone or self.standing().admin

    def may_see(self, user: str | None, account: str | None) -> bool:
        if self._everyone or (user is not None and user == self.name):
            return True
        return self.everyone or (account is not None and account in self.standing().coordinates)

    def scope(self, user: str | None, what: str) -> str | None:
        """The user filter for a listing: one's own jobs unless one may see more; another user's
        only for an admin or a coordinator (whose rows are then cut to their accounts)."""
        if self.everyone:
            return user
        if user and user != self.name and not self.standing().coordinates:
            raise InputError(f"you may only {what} your own jobs, not {user}'s", option="--user")
        return user or self.name


def _same_job(row: Any, live: usage.LiveJob) -> bool:
    """A history row and a sacct row are one job when submitted at the same time (ids are reused)."""
    return bool(row.cluster == live.values["cluster"] and row.submit_time == live.values["submit_time"])


def seff_answers(engine: Any, job_ids: Sequence[str], cluster: str | None, config: Config | None,
                 viewer: Viewer, live: Any = usage.live_jobs) -> list[dict[str, Any]]:
    """Per job id: ``{"job_id", "text", "json"}``, or ``{"job_id", "error"}`` for a job unknown or
    not the viewer's to see. Finished jobs come from the history with CPU and host memory from
    sacct; a job the history does not have yet (running, or not ingested) from Slurm alone."""
    found = {j: queries.find_job(engine, j, cluster) for j in job_ids}
    slurm = live(list(job_ids), cluster)  # None: sacct could not be asked
    known: Mapping[str, usage.LiveJob] = slurm if slurm is not None else {}
    out: list[dict[str, Any]] = []
    for job_id in job_ids:
        one, now = found[job_id], known.get(job_id)
        if one is None and now is None:
            out.append({"job_id": job_id, "error": f"job {job_id} is not in the history database, and Slurm's "
                                                   + ("accounting does not know it" if slurm is not None else
                                                      "accounting could not be asked (sacct failed or did not "
                                                      "answer in time): try again")})
            continue
        user, account = ((one.job.user, one.job.account) if one is not None else
                         (known[job_id].values["user"], known[job_id].values["account"]))
        if not viewer.may_see(user, account):
            out.append({"job_id": job_id, "error": f"job {job_id} belongs to another user: you may only see "
                                                   "your own jobs"})
            continue
        notes, live_only = [], one is None
        if one is None:
            assert now is not None
            one = queries.OneJob(SimpleNamespace(**now.values), [], None)
            if now.values["state"] in LIVE_STATES:
                notes.append(f"GPU figures: the job is {now.values['state']}; they come once it has ended and the "
                             "nightly ingest has loaded its collector record")
            else:
                notes.append("GPU figures and the decision: the nightly ingest has not loaded this job yet")
        elif now is None or not _same_job(one.job, now):
            now = None
            notes.append("CPU and host memory: Slurm's accounting has no record of this job now")
        figures = seff.build(one, config)
        missing = [m for m in figures.missing if not (live_only and m.startswith(STORED_ONLY))]
        figures = figures._replace(host=now.use if now else None, missing=[*notes, *missing])
        out.append({"job_id": job_id, "text": seff.to_text(figures), "json": figures.to_dict()})
    return out


def jobs_answer(engine: Any, viewer: Viewer, user: str | None, since: datetime | None, job_ids: Sequence[str],
                limit: int) -> dict[str, Any]:
    """``slurmgpu jobs``: the newest rows the viewer may see, and how many more the limit left out."""
    from slurmgpu.history.queries import job_count, job_rows

    user = viewer.scope(user, "list")
    limit = max(1, min(limit, MAX_JOB_ROWS))
    rows = job_rows(engine, user=user, since=since, job_ids=job_ids, limit=limit)
    left_out = job_count(engine, user=user, since=since, job_ids=job_ids) - len(rows) if len(rows) == limit else 0
    return {"jobs": [r for r in rows if viewer.may_see(r["user"], r["account"])], "left_out": left_out}


def report_jobs(engine: Any, viewer: Viewer, since: datetime, until: datetime, user: str | None,
                account: str | None, cluster: str | None) -> tuple[list[JobUse], str | None]:
    """``slurmgpu report``'s jobs, only those the viewer may see, and the user filter applied."""
    user = viewer.scope(user, "report on")
    jobs = queries.load_jobs(engine, since, until, user=user, account=account, cluster=cluster)
    return [j for j in jobs if viewer.may_see(j.user, j.account)], user


def jobs_to_json(jobs: Sequence[JobUse]) -> list[dict[str, Any]]:
    return [{**j._asdict(), "end_time": j.end_time.isoformat() if j.end_time else None} for j in jobs]


def jobs_from_json(items: Sequence[Mapping[str, Any]]) -> list[JobUse]:
    """JobUse rows as the daemon sent them (its report answer)."""
    return [JobUse(**{**item, "end_time": datetime.fromisoformat(item["end_time"]) if item.get("end_time") else None})
            for item in items]
