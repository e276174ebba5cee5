"""The nightly ingest against records that are wrong in every way a user can make them: whatever one
record holds (types, ranges, encodings, times, names, sizes), it is loaded, left to wait or set aside
with a reason, and the run and the records behind it go on."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from test_spool_trust import (  # noqa: F401 - accounts and site are fixtures
    CONFIG,
    NIGHTLY,
    OTHER,
    USER,
    Site,
    accounts,
    as_user,
    cli_ingest,
    drop,
    job,
    site,
    submissions,
    write,
)

from slurmgpu.history import db, ingest
from slurmgpu.pipeline import spool
from slurmgpu.slurm.sacct import JobRecord

CLUSTER = "c1"


def record(job_id: str | None = None, **fields: Any) -> dict[str, Any]:
    base = dict(cluster=CLUSTER, job_id=job_id, script_sha256=None, sbatch_exit=0, features={"script": None},
                original_request={"gpus_total": 1}, decision={"changed": False}, changed=False)
    return spool.new_record(**{**base, **fields})


def stored_ids(engine: Any) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(db.Submission.record_id)).scalars())


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """One store for all examples (records have fresh ids), with root's job 100 (this test runs as
    the file owner: as root where the suite runs, or as whoever runs it)."""
    home = tempfile.mkdtemp(prefix="sg-harden-")
    url = f"sqlite:///{home}/h.db"
    db.upgrade(url)
    eng = db.make_engine(url)
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(cluster=CLUSTER, job_id="100", state="COMPLETED", gpu_count=1, user=ingest._owner(os.geteuid()))
    ingest.load_jobs(eng, [JobRecord(values, 1)])
    yield eng
    eng.dispose()
    shutil.rmtree(home)


# --- item: one record stops the nightly -----------------------------------------------------------

FIELDS = ("version", "record_id", "submitted_at", "cluster", "job_id", "script_sha256", "sbatch_exit", "features",
          "original_request", "decision", "changed", "source", "script_text", "model_version", "user")
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates, NUL, ...
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3), max_leaves=6)
OFFSETS = st.integers(min_value=-1439, max_value=1439).map(lambda m: f"{'+-'[m < 0]}{abs(m) // 60:02}:{abs(m) % 60:02}")
TIMES = st.builds(lambda when, offset: when.isoformat() + offset, st.datetimes(), OFFSETS)
ENCODINGS = ("utf-8", "utf-16", "utf-32", "latin-1")


def _encoded(rec: dict[str, Any], encoding: str) -> bytes:
    text = json.dumps(rec, ensure_ascii=encoding != "utf-8")
    return text.encode(encoding, "surrogatepass")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES | TIMES, min_size=1, max_size=3),
       encoding=st.sampled_from(ENCODINGS), job=st.sampled_from([None, "100", "123456"]), cut=st.integers(0, 4))
@example(changes={"submitted_at": "0001-01-01T00:00:00+00:01"}, encoding="utf-8", job=None, cut=0)
@example(changes={"submitted_at": "9999-12-31T23:59:59-23:59"}, encoding="utf-8", job=None, cut=0)
def test_no_record_stops_the_run(engine: Any, changes: dict[str, Any], encoding: str, job: str | None,
                                 cut: int) -> None:
    """A record with any fields in any encoding (or cut short) ends loaded, waiting or set aside with a
    reason; a good record in the same run is stored; nothing raises."""
    directory = tempfile.mkdtemp(prefix="sg-fuzz-")
    try:
        bad = {**record(job), **changes}
        data = _encoded(bad, encoding)
        Path(directory, "sub-a-bad.json").write_bytes(data[:len(data) - cut])
        good = record()
        spool.write_record(directory, good)
        report = ingest.load_submissions(engine, directory, trusted=())
        assert good["record_id"] in stored_ids(engine)
        assert report.files_loaded + len(report.files_rejected) + report.files_waiting + report.files_duplicate == 2
        left = sorted(os.listdir(directory))
        assert left in ([], ["sub-a-bad.json"], ["sub-a-bad.json.rejected"]), left
        assert (left == ["sub-a-bad.json"]) == (report.files_waiting == 1)
        assert all(": " in line for line in report.files_rejected)  # "path: kind: reason"
    finally:
        shutil.rmtree(directory)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs, whose times go past year 9999")
def test_a_modification_time_past_year_9999_does_not_stop_the_run(engine: Any) -> None:
    """A record's owner sets its mtime; on tmpfs (or btrfs) it can lie past what a datetime holds,
    which made the wait for an unknown job raise for the whole batch."""
    directory = tempfile.mkdtemp(prefix="sg-mtime-", dir="/dev/shm")
    try:
        far = os.path.join(directory, os.path.basename(spool.write_record(directory, record("777"))))
        os.utime(far, (1e12, 1e12))
        good = record()
        spool.write_record(directory, good)
        report = ingest.load_submissions(engine, directory, trusted=())
        assert good["record_id"] in stored_ids(engine) and report.files_loaded == 1
        assert report.files_waiting == 1 and os.path.exists(far)  # its job may still come
    finally:
        shutil.rmtree(directory)


def test_a_check_failing_on_one_record_sets_only_that_one_aside(engine: Any, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An unforeseen fault in the admission checks of one record (here a lookup that raises for it)
    sets that record aside with the fault named; the rest of its batch loads."""
    bad, good = record(cluster="boom"), record()
    for rec in (bad, good):
        spool.write_record(str(tmp_path), rec)
    real = ingest._linked

    def linked(f: ingest.SpoolFile, cluster: str, *args: Any) -> Any:
        if cluster == "boom":
            raise OverflowError("a fault no check foresaw")
        return real(f, cluster, *args)

    monkeypatch.setattr(ingest, "_linked", linked)
    report = ingest.load_submissions(engine, str(tmp_path), trusted=())
    assert good["record_id"] in stored_ids(engine) and bad["record_id"] not in stored_ids(engine)
    assert report.rejected_kinds == {"unexpected error": 1}
    assert "OverflowError: a fault no check foresaw" in report.files_rejected[0]


# --- item: names the ingest cannot rename ----------------------------------------------------------


def _long_names(subs: str) -> list[str]:
    """sguser's part: two 255-byte names (one where 100 bytes end mid-character) with bad content."""
    return [drop(subs, name, "{not json") for name in ("sub-" + "x" * 246 + ".json", "sub-x" + "é" * 122 + ".json")]


def test_a_name_too_long_for_rejected_is_set_aside_once(site: Site) -> None:  # noqa: F811 - the fixture
    """A 255-byte name cannot take ``.rejected``: it was re-read and re-reported, exit 1, every night.
    Now it is renamed to a short name ending ``.rejected`` once, and the next run has nothing to say."""
    names = as_user(USER, _long_names, site.subs)
    first = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert first["exception"] is None and first["code"] == 1, first
    assert "2 rejected (2 malformed)" in first["stdout"] and first["stderr"].count("its name is too long") == 2
    left = os.listdir(site.subs)
    assert len(left) == 2, left
    assert all(n.endswith(".rejected") and len(os.fsencode(n)) <= 126 and n.isprintable() for n in left), left
    assert sorted(n[:40] for n in left) == sorted(n[:40] for n in names)  # still starts like the original
    again = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert again["code"] == 0, again
    assert "spool records" not in again["stdout"] and sorted(os.listdir(site.subs)) == sorted(left)


# --- item: records the ingest rejected for jobs that ran -----------------------------------------


def _gsbatch_as_user(directory: str, subs: str) -> list[str]:
    """gsbatch run by the user on each script of ``directory`` (names as bytes); what it printed."""
    from slurmgpu.apps import gsbatch

    env = {"PATH": "/usr/bin:/bin", "SLURMGPU_CONFIG": str(CONFIG), "SLURMGPU_SUBMISSION_SPOOL": subs}
    printed = []
    for name in sorted(os.listdir(os.fsencode(directory))):
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # gsbatch passes sbatch's bytes on
        with contextlib.redirect_stdout(out):
            code = gsbatch.main([os.fsdecode(os.path.join(os.fsencode(directory), name))], env=env)
        out.flush()
        printed.append(f"{code}:{out.buffer.getvalue().decode()}")  # type: ignore[attr-defined]
    return printed


@pytest.mark.slurm
def test_every_job_sbatch_took_gets_a_record_the_ingest_stores(site: Site, submitted: list[str]) -> None:  # noqa: F811
    """sguser submits, through gsbatch on the real cluster, a script whose file and job name are not
    UTF-8 (caf\\xe9), one with 1,900 directives sbatch ignores and one with 162,000 (a 15 MB record
    before; now past the directive budget: not read, submitted and recorded as kept). Every record
    is stored: the bytes kept (base64), the long list cut to 100 entries and a count."""
    scripts = tempfile.mkdtemp(prefix="sg-scripts-")
    head = "#!/bin/bash\n#SBATCH -o /dev/null -t 1 --chdir=/tmp -p gpu-small --gres=gpu:t4:1\n"
    Path(os.fsdecode(os.path.join(os.fsencode(scripts), b"caf\xe9.sh"))).write_bytes(
        head.encode() + b"#SBATCH --job-name=caf\xe9\ntrue\n")
    Path(scripts, "ignored.sh").write_text(head + "true\n" + "".join(f"#SBATCH --x{i}\n" for i in range(1_900)))
    Path(scripts, "unread.sh").write_text(head + "true\n" + "".join(f"#SBATCH --x{i}\n" for i in range(162_000)))
    for name in os.listdir(scripts):
        os.chmod(os.path.join(scripts, name), 0o644)
    os.chmod(scripts, 0o755)
    try:
        printed = as_user(USER, _gsbatch_as_user, scripts, site.subs)
    finally:
        shutil.rmtree(scripts)
    ids = [re.fullmatch(r"0:Submitted batch job (\d+)\n", p) for p in printed]
    assert all(ids), printed
    submitted.extend(m.group(1) for m in ids if m)
    ingest.load_jobs(db.make_engine(site.url), [job(jid, USER) for jid in submitted])  # as sacct will show them

    res = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert res["code"] == 0 and "3 spool records loaded, 0 rejected" in res["stdout"], res
    with db.make_engine(site.url).connect() as conn:
        rows = {r.job_id: r for r in conn.execute(select(db.Submission.job_id, db.Submission.features,
                                                         db.Submission.original_request, db.Submission.decision))}
    named, ignored, unread = (rows[jid] for jid in submitted[:3])
    assert named.features["script_name"] == {"base64": base64.b64encode(b"caf\xe9.sh").decode()}
    assert named.original_request["job_name"] == {"base64": base64.b64encode(b"caf\xe9").decode()}
    lines = ignored.original_request["ignored_directives"]
    assert len(lines) == 101 and lines[0]["text"] == "#SBATCH --x0" and lines[-1] == {"omitted": 1_800}, lines[-1]
    assert unread.original_request is None and unread.decision["decider"] == "keep"
    assert "162,001 directive lines" in unread.decision["reasons"][0]


WRITTEN = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | ANY_TEXT
    | st.text(max_size=1).map(lambda c: c * 5000),
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: xs * 40) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=WRITTEN)
def test_whatever_a_job_says_the_writer_makes_storable(engine: Any, value: Any) -> None:
    """Any value gsbatch or the daemon puts in a free-form field (bytes that are not UTF-8, NUL, long
    strings and lists) is written so that the ingest stores the record."""
    directory = tempfile.mkdtemp(prefix="sg-write-")
    try:
        rec = record(features={"script": None, "x": value}, original_request={"x": value})
        spool.write_record(directory, rec)
        report = ingest.load_submissions(engine, directory)
        assert report.files_loaded == 1, report.files_rejected
    finally:
        shutil.rmtree(directory)


# --- item: filling the database ---------------------------------------------------------------------


def _many(subs: str, count: int) -> list[str]:
    return [write(subs, record(None, sbatch_exit=1)) for _ in range(count)]


def test_one_users_share_of_a_run_is_bounded(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """sguser floods the spool with records naming no job; one run stores only their share (the rest
    wait in the spool, under its disk quota), while sgother's records all land."""
    monkeypatch.setattr(ingest, "USER_FILES_PER_RUN", 5)
    as_user(USER, _many, site.subs, 8)
    as_user(OTHER, _many, site.subs, 2)
    first = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert "7 spool records loaded, 0 rejected, 3 over their user's share of this run" in first["stdout"], first
    assert sorted(r["user"] for r in submissions(site.url).values()) == [OTHER] * 2 + [USER] * 5
    second = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert "3 spool records loaded, 0 rejected" in second["stdout"] and os.listdir(site.subs) == [], second


def test_records_naming_no_job_expire_with_their_scripts(engine: Any, tmp_path: Path) -> None:
    """A stored record naming no job is deleted after NO_JOB_KEEP with the script text only it named;
    a newer one, one naming a job and a script another record names stay; a record dated in the
    future (to dodge the expiry) is set aside."""
    now = datetime.now(UTC)

    def text(n: int) -> dict[str, Any]:
        body = f"#!/bin/bash\necho {n}\n"
        return {"script_text": body, "script_sha256": hashlib.sha256(body.encode()).hexdigest()}

    def at(days: float) -> str:
        return (now - timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%S+00:00")

    old, shared_old, new, with_job = (record(None, submitted_at=at(40), **text(1)),
                                      record(None, submitted_at=at(40), **text(2)),
                                      record(None, submitted_at=at(10), **text(2)),
                                      record("100", submitted_at=at(40), **text(3)))
    future = record(None, submitted_at=at(-3))
    for rec in (old, shared_old, new, with_job, future):
        spool.write_record(str(tmp_path), rec)
    report = ingest.load_submissions(engine, str(tmp_path))
    assert report.expired == 2 and "2 records naming no job expired" in report.summary()
    assert report.rejected_kinds == {"malformed": 1} and "is in the future" in report.files_rejected[0]
    ids = stored_ids(engine)
    assert new["record_id"] in ids and with_job["record_id"] in ids
    assert old["record_id"] not in ids and shared_old["record_id"] not in ids
    with engine.connect() as conn:
        shas = set(conn.execute(select(db.JobScript.sha256)).scalars())
    assert text(1)["script_sha256"] not in shas and {text(2)["script_sha256"], text(3)["script_sha256"]} <= shas
