"""The spools are a trust boundary: any user can drop files there. Real accounts (root creates them),
real uids writing through the real writer, the real ingest run by an unprivileged nightly account.

Accounts: ``sguser`` (made by the local cluster script) and ``sgother`` submit; ``sgnightly`` runs the
ingest and is in group ``sgspool``, which stands for the site's ``slurmgpu`` group.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from slurmgpu.cli.main import main
from slurmgpu.collector import records as gpu_records
from slurmgpu.history import db, ingest
from slurmgpu.pipeline import spool
from slurmgpu.reporting import queries
from slurmgpu.slurm.sacct import JobRecord

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = ROOT / "contrib" / "slurmgpu.toml"  # cluster "slurmgpu"
CLUSTER = "slurmgpu"
USER, OTHER, NIGHTLY, GROUP = "sguser", "sgother", "sgnightly", "sgspool"
TARGET_S = 30.0


# --- accounts and running as them ---------------------------------------------------------------


def _run(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode not in (0, 9):  # 9: already exists (another test run made it)
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")


@pytest.fixture(scope="session")
def accounts() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make accounts and write as other users")
    if shutil.which("useradd") is None:
        pytest.skip("useradd not installed")
    _run("groupadd", "-f", "-r", GROUP)
    for name in (USER, OTHER, NIGHTLY):
        try:
            pwd.getpwnam(name)
        except KeyError:
            _run("useradd", "-r", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", name)
    _run("usermod", "-a", "-G", GROUP, NIGHTLY)
    assert NIGHTLY in grp.getgrnam(GROUP).gr_mem


def as_user(name: str, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> Any:
    """fn(*args) in a forked child that dropped to the account for good (real, effective and saved ids,
    its groups); returns fn's JSON-able result, or raises with the child's error. A child still running
    after ``timeout`` (a hang) is killed and the test fails."""
    pw = pwd.getpwnam(name)
    groups = sorted({pw.pw_gid} | {g.gr_gid for g in grp.getgrall() if name in g.gr_mem})
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(read_end)
            os.setgroups(groups)
            os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
            os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
            os.environ["HOME"] = "/nonexistent"
            answer = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write_end, "w") as out:
            json.dump(answer, out, default=str)
        os._exit(0)
    os.close(write_end)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_end, 65536), b"")))
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        reader.join()
        os.close(read_end)
        pytest.fail(f"{fn.__name__} as {name} still running after {timeout:.0f} s: it hangs")
    os.waitpid(pid, 0)
    os.close(read_end)
    answer = json.loads(b"".join(chunks) or b'{"error": "child died"}')
    if "error" in answer:
        raise RuntimeError(f"{fn.__name__} as {name}: {answer['error']}")
    return answer["ok"]


def cli_ingest(url: str, subs: str, gpus: str) -> dict[str, Any]:
    """`slurmgpu ingest` (no sacct: the jobs are in the store already), timed."""
    env = {"SLURMGPU_SUBMISSION_SPOOL": subs, "SLURMGPU_GPU_SPOOL": gpus}
    start = time.monotonic()
    res = CliRunner().invoke(main, ["--config", str(CONFIG), "--db", url, "ingest", "--from-file", "/dev/null"],
                             env=env)
    return {"code": res.exit_code, "stdout": res.stdout, "stderr": res.stderr, "seconds": time.monotonic() - start,
            "exception": repr(res.exception) if res.exception and not isinstance(res.exception, SystemExit) else None}


# --- a spool, a store -----------------------------------------------------------------------------


@dataclass
class Site:
    url: str
    subs: str  # submission spool: 3733, owner the nightly account, group sgspool
    gpus: str  # GPU spool, the same


def _spool_dir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    os.chown(path, pwd.getpwnam(NIGHTLY).pw_uid, grp.getgrnam(GROUP).gr_gid)
    os.chmod(path, 0o3733)
    return path


def job(job_id: str, user: str, **extra: Any) -> JobRecord:
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(cluster=CLUSTER, job_id=job_id, state="COMPLETED", gpu_count=2, gpu_type="a100", user=user,
                  submit_time=datetime(2026, 12, 1, 10), end_time=datetime(2026, 12, 1, 11), elapsed_s=3600,
                  **extra)
    return JobRecord(values, 1)


@pytest.fixture
def site(accounts: None, db_url: str) -> Iterator[Site]:
    """The store (on each backend; SQLite's file owned by the nightly account) with jobs of three users:
    100 and 103 are sguser's, 101 sgother's, 102 an array of sguser's, 104 root's."""
    nightly = pwd.getpwnam(NIGHTLY)
    made = []
    if db_url.startswith("sqlite"):
        home = tempfile.mkdtemp(prefix="sg-store-")
        made.append(home)
        db_url = f"sqlite:///{home}/h.db"
        db.upgrade(db_url)
        for name in os.listdir(home):
            os.chown(os.path.join(home, name), nightly.pw_uid, nightly.pw_gid)
        os.chown(home, nightly.pw_uid, nightly.pw_gid)
    ingest.load_jobs(db.make_engine(db_url), [
        job("100", USER), job("101", OTHER), job("102_0", USER, job_id_raw=102, array_job_id=102, array_task_id=0),
        job("102_1", USER, job_id_raw=105, array_job_id=102, array_task_id=1), job("103", USER), job("104", "root")])
    s = Site(db_url, _spool_dir("sg-subs-"), _spool_dir("sg-gpus-"))
    made += [s.subs, s.gpus]
    warm = tempfile.mkdtemp()  # import everything the ingest imports while root can still read the interpreter
    db.upgrade(f"sqlite:///{warm}/w.db")
    write(warm, record(None))
    assert "1 spool records loaded" in cli_ingest(f"sqlite:///{warm}/w.db", warm, warm)["stdout"]
    shutil.rmtree(warm)
    yield s
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def record(job_id: str | None, **fields: Any) -> dict[str, Any]:
    base = dict(cluster=CLUSTER, job_id=job_id, script_sha256="ab" * 32, sbatch_exit=0,
                features={"script": {"lines": 3}}, original_request={"gpus_total": 2, "gpu_type": "a100"},
                decision={"changed": False, "changes": []}, changed=False)
    base.update(fields)
    return spool.new_record(**base)


def write(directory: str, rec: dict[str, Any]) -> str:
    """What gsbatch does, as whoever runs this."""
    return os.path.basename(spool.write_record(directory, rec))


def drop(directory: str, name: str, data: str | bytes, mode: int = 0o640) -> str:
    """A file with any content, as whoever runs this."""
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    return name


def submissions(url: str) -> dict[str, dict[str, Any]]:
    t = db.Submission
    with db.make_engine(url).connect() as conn:
        rows = conn.execute(select(t.record_id, t.user, t.job_id, t.changed, t.decision)).mappings().all()
    return {r["record_id"]: dict(r) for r in rows}


# --- the hostile spool ----------------------------------------------------------------------------


def _hostile_as_user(subs: str, good: dict[str, Any], scratch: str) -> dict[str, str]:
    """sguser's part: good records, a copy, a clash, malformed ones, a FIFO, a symlink, a hard link,
    an oversize file, one whose job is not in sacct yet, one that job never came for, an unreadable one."""
    names = {"good": write(subs, good), "array": write(subs, record("102")),
             "waiting": write(subs, record("999"))}
    names["copy"] = drop(subs, "sub-zz-copy.json", json.dumps(good))
    names["clash"] = drop(subs, "sub-zz-clash.json", json.dumps({**good, "changed": True}))
    bad = {
        "not-json": "{not json",
        "deep": "[" * 200_000 + "]" * 200_000,
        "nan": json.dumps(record("100")).replace('"sbatch_exit": 0', '"sbatch_exit": NaN'),
        "huge-float": json.dumps(record("100", features={"x": 1})).replace('"x": 1', '"x": 1e999'),
        "changed-str": json.dumps(record("100", changed="false")),
        "exit-str": json.dumps(record("100", sbatch_exit="0")),
        "job-int": json.dumps(record(None) | {"job_id": 100}),
        "features-list": json.dumps(record("100", features=[1, 2])),
        "surrogate": json.dumps(record("100", features={"s": "\ud800"})),
        "nul-cluster": json.dumps(record("100", cluster="c\u0000")),
        "bad-id": json.dumps(record("100") | {"record_id": "../../etc/passwd"}),
        "version-3": json.dumps(record("100") | {"version": 3}),
        "missing": json.dumps({k: v for k, v in record("100").items() if k != "decision"}),
        "list": "[1, 2, 3]",
        "binary": b"\xff\xfe\x00garbage",
    }
    for key, data in bad.items():
        names[key] = drop(subs, f"sub-bad-{key}.json", data)
    names["oversize"] = drop(subs, "sub-big.json", json.dumps(record("100", features={"pad": "x" * (2 << 20)})))
    os.mkfifo(os.path.join(subs, "sub-f.json"), 0o640)
    names["fifo"] = "sub-f.json"
    os.symlink(os.path.join(subs, names["good"]), os.path.join(subs, "sub-l.json"))
    names["symlink"] = "sub-l.json"
    outside = os.path.join(scratch, "mine.json")
    with open(outside, "w") as fh:
        json.dump(record("100"), fh)
    os.link(outside, os.path.join(subs, "sub-h.json"))
    names["hardlink"] = "sub-h.json"
    names["stale"] = write(subs, record("998"))
    two_days_ago = time.time() - 2 * 86400
    os.utime(os.path.join(subs, names["stale"]), (two_days_ago, two_days_ago))
    names["unreadable"] = drop(subs, "sub-private.json", json.dumps(record("100")), mode=0o600)
    return names


def _hostile_as_other(subs: str) -> dict[str, str]:
    """sgother's part: a good record of their own job, a failed submission, and a forged record for
    sguser's job 100 that claims slurmgpu changed it."""
    return {"other": write(subs, record("101")), "refused": write(subs, record(None, sbatch_exit=1)),
            "forged": write(subs, record("100", changed=True,
                                         decision={"changed": True, "changes": [{"gpu_type": "t4"}]}))}


def test_hostile_spool_loads_every_good_record_and_sets_aside_the_rest(site: Site) -> None:
    good = record("100")
    scratch = tempfile.mkdtemp()  # kept until the end: the hard link's other name lives there
    os.chmod(scratch, 0o1777)
    try:
        _hostile(site, good, scratch)
    finally:
        shutil.rmtree(scratch)


def _hostile(site: Site, good: dict[str, Any], scratch: str) -> None:
    names = as_user(USER, _hostile_as_user, site.subs, good, scratch)
    names |= as_user(OTHER, _hostile_as_other, site.subs)
    names["root"] = write(site.subs, record("104"))  # root is trusted
    mode = os.stat(os.path.join(site.subs, names["good"]))
    assert (stat.S_IMODE(mode.st_mode), mode.st_gid) == (0o640, grp.getgrnam(GROUP).gr_gid)

    first = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert first["exception"] is None, first
    assert first["seconds"] < TARGET_S, first
    print(f"hostile spool ingest: {first['seconds']:.2f} s; {first['stdout'].strip()}")
    assert first["code"] == 1 and "Traceback" not in first["stderr"]

    stored = submissions(site.url)
    loaded = {"good": good["record_id"]}
    assert {r["user"] for r in stored.values()} == {USER, OTHER, "root"}
    assert sorted((r["user"], r["job_id"] or "-") for r in stored.values()) == sorted(
        [(USER, "100"), (USER, "102"), (OTHER, "101"), (OTHER, "-"), ("root", "104")])
    assert stored[loaded["good"]]["changed"] is False  # the clash (changed: true) did not replace it
    assert "5 spool records loaded, 22 rejected" in first["stdout"], first["stdout"]
    assert "1 duplicates removed, 1 waiting for their job in sacct, 1 unreadable by this account" in first["stdout"]

    left = set(os.listdir(site.subs))
    kept = {names["waiting"], names["unreadable"]}
    aside = {n for k, n in names.items() if k not in ("good", "array", "waiting", "unreadable", "copy", "other",
                                                      "refused", "root")}
    assert left == kept | {f"{n}.rejected" for n in aside}, left ^ (kept | {f"{n}.rejected" for n in aside})
    assert stat.S_ISFIFO(os.lstat(os.path.join(site.subs, "sub-f.json.rejected")).st_mode)
    assert os.path.islink(os.path.join(site.subs, "sub-l.json.rejected"))
    reasons = {name: line for line in first["stderr"].splitlines() for name in aside if f"/{name}: " in line}
    assert set(reasons) == aside, aside - set(reasons)
    expected = {"fifo": "not a regular file: a FIFO", "symlink": "not a regular file: a symbolic link",
                "hardlink": "hard link: 2 hard links", "oversize": "oversize:", "forged": "forged:",
                "clash": "duplicate record_id:", "stale": "job unknown:", "changed-str": "changed: expected true/false",
                "exit-str": "sbatch_exit: expected integer", "job-int": "job_id: expected string",
                "deep": "not JSON", "nan": "NaN is not allowed", "huge-float": "out of range",
                "surrogate": "lone surrogate", "nul-cluster": "NUL character", "bad-id": "record_id: expected",
                "version-3": "version: expected 1 or 2", "missing": "decision: missing", "binary": "not JSON"}
    for key, fragment in expected.items():
        assert fragment in reasons[names[key]], (key, reasons[names[key]])
    assert f"of user {USER}, but the file belongs to {OTHER}" in reasons[names["forged"]]
    assert f"/{names['unreadable']}" in first["stderr"] and "left in place" in first["stderr"]

    again = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)  # nothing changes, nothing aborts
    assert again["exception"] is None and again["seconds"] < TARGET_S, again
    assert submissions(site.url) == stored
    assert "0 spool records loaded, 0 rejected, 1 waiting for their job in sacct, 1 unreadable" in again["stdout"]

    ingest.load_jobs(db.make_engine(site.url), [job("999", USER)])  # sacct now shows the job: the record lands
    third = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert "1 spool records loaded, 0 rejected" in third["stdout"], third
    assert submissions(site.url).keys() - stored.keys() and names["waiting"] not in os.listdir(site.subs)


def _forge_future(subs: str) -> str:
    return write(subs, record("200", changed=True, decision={"changed": True, "changes": [{"gpu_type": "t4"}]}))


def test_forged_record_never_changes_another_users_history(site: Site) -> None:
    """sgother guesses sguser's next job id and drops a record claiming slurmgpu changed it; the
    record waits for the job, then is set aside as forged: the report's `changed` stays false."""
    engine = db.make_engine(site.url)
    forged = as_user(OTHER, _forge_future, site.subs)
    first = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert "1 waiting" in first["stdout"] and first["code"] == 0, first
    ingest.load_jobs(engine, [job("200", USER)])
    before = {j.job_id: j for j in queries.load_jobs(engine, datetime(2026, 11, 1), datetime(2027, 1, 1))}
    second = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert second["code"] == 1 and f"{forged}: forged: a submission record for job {CLUSTER}/200" in second["stderr"]
    after = {j.job_id: j for j in queries.load_jobs(engine, datetime(2026, 11, 1), datetime(2027, 1, 1))}
    assert after == before and after["200"].changed is False and after["200"].decision is None
    assert submissions(site.url) == {}


# --- GPU collector records -------------------------------------------------------------------------


def gpu_record(job_id: str, peak: float, host: str = "node1") -> gpu_records.JobRecord:
    g = gpu_records.GpuRecord(0, "GPU-1", "NVIDIA A100", 81920.0, peak, None, 50.0, 90.0, 3)
    return gpu_records.JobRecord(1, "nvml", CLUSTER, job_id, host, None, datetime(2026, 12, 1, 10, tzinfo=UTC),
                                 datetime(2026, 12, 1, 11, tzinfo=UTC), 5.0, 3, (g,), peak, 50.0, 90.0)


def _gpu_as_user(directory: str) -> list[str]:
    """sguser: a record for their own job, one for sgother's job 101, one over root's for job 103."""
    return [os.path.basename(gpu_records.write_record(gpu_record(j, 1.0, "mine"), directory))
            for j in ("100", "101")] + [os.path.basename(gpu_records.write_record(gpu_record("103", 1.0),
                                                                                  directory))]


def test_gpu_records_trust_root_and_a_jobs_own_user_only(site: Site) -> None:
    engine = db.make_engine(site.url)
    root_rec = gpu_records.write_record(gpu_record("103", 70000.0), site.gpus)  # the prolog's collector, as root
    gpu_records.write_record(gpu_record("101", 50000.0), site.gpus)
    first = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert "2 spool records loaded, 0 rejected" in first["stdout"], first
    assert not os.path.exists(root_rec)
    own, forged, over_root = as_user(USER, _gpu_as_user, site.gpus)
    os.mkfifo(os.path.join(site.gpus, f"{CLUSTER}_104_node1.json"))
    second = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
    assert "1 spool records loaded, 3 rejected" in second["stdout"], second
    assert f"{forged}: forged: a GPU record for job {CLUSTER}/101 of user {OTHER}, but the file belongs to {USER}" \
        in second["stderr"]
    assert f"{over_root}: duplicate GPU record" in second["stderr"]
    peaks = {(j.job_id): j.peak_mib for j in queries.load_jobs(engine, datetime(2026, 11, 1), datetime(2027, 1, 1))}
    assert (peaks["100"], peaks["101"], peaks["103"]) == (1.0, 50000.0, 70000.0)
    assert sorted(os.listdir(site.gpus)) == sorted([f"{forged}.rejected", f"{over_root}.rejected",
                                                    f"{CLUSTER}_104_node1.json.rejected"])
    assert own not in os.listdir(site.gpus)


def test_read_only_gpu_spool_loads_and_says_it_cannot_remove(site: Site) -> None:
    """A GPU spool made 2750 root:slurmgpu (group may read, not remove): records still load, the run
    says which it could not remove, and loading them again changes nothing."""
    os.chown(site.gpus, 0, grp.getgrnam(GROUP).gr_gid)
    os.chmod(site.gpus, 0o2750)
    path = gpu_records.write_record(gpu_record("103", 70000.0), site.gpus)
    for _ in range(2):
        res = as_user(NIGHTLY, cli_ingest, site.url, site.subs, site.gpus)
        assert res["code"] == 0 and "1 spool records loaded, 0 rejected" in res["stdout"], res
        assert f"spool record {path}: loaded but not removed: Permission denied" in res["stderr"]
    with db.make_engine(site.url).connect() as conn:
        assert conn.execute(select(db.GpuUsage.job_id, db.GpuUsage.peak_mem_mib)).all() == [("103", 70000.0)]


# --- the permission model ------------------------------------------------------------------------


def _try_read(path: str) -> str:
    try:
        with open(path) as fh:
            return "read " + str(len(fh.read()))
    except PermissionError:
        return "denied"


def test_records_readable_by_the_nightly_group_only(accounts: None) -> None:
    setgid = _spool_dir("sg-perm-")
    plain = tempfile.mkdtemp(prefix="sg-plain-")
    os.chmod(plain, 0o1733)
    try:
        in_setgid = os.path.join(setgid, as_user(USER, write, setgid, record("1")))
        in_plain = os.path.join(plain, as_user(USER, write, plain, record("1")))
        st = os.stat(in_setgid)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, grp.getgrnam(GROUP).gr_gid)
        assert stat.S_IMODE(os.stat(in_plain).st_mode) == 0o600  # no setgid: the writer's group, so private
        assert as_user(NIGHTLY, _try_read, in_setgid).startswith("read ")
        assert as_user(OTHER, _try_read, in_setgid) == "denied"
        with pytest.raises(RuntimeError, match="PermissionError"):
            as_user(OTHER, os.listdir, setgid)
        assert as_user(NIGHTLY, os.listdir, setgid) == [os.path.basename(in_setgid)]
        with pytest.raises(RuntimeError, match="PermissionError"):  # sticky: only the owner may remove it
            as_user(OTHER, os.unlink, in_setgid)
        as_user(NIGHTLY, os.replace, in_setgid, in_setgid + ".rejected")  # the directory's owner may
    finally:
        shutil.rmtree(setgid)
        shutil.rmtree(plain)


# --- the command line: a locked store, rendered units, outputs that are not files -----------------


def test_locked_sqlite_gives_one_line_within_seconds(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    export = tmp_path / "sacct.txt"
    export.write_text("JobID|User|State|Partition\n1|alice|COMPLETED|gpu\n")
    holder = sqlite3.connect(tmp_path / "h.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        start = time.monotonic()
        res = subprocess.run([str(BIN / "slurmgpu"), "--db", url, "ingest", "--from-file", str(export), "--no-spool"],
                             capture_output=True, text=True, timeout=60, check=False)
        took = time.monotonic() - start
    finally:
        holder.rollback()
        holder.close()
    assert res.returncode != 0 and took < db.LOCK_TIMEOUT_S + 5, (res, took)
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert re.fullmatch(rf"slurmgpu: error: database {re.escape(url)} is locked by another writer .*run again when "
                        r"it has finished\n", res.stderr), res.stderr


def test_nightly_stops_before_training_when_the_store_is_locked(tmp_path: Path, sample_config: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    holder = sqlite3.connect(tmp_path / "h.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        res = subprocess.run([str(BIN / "slurmgpu"), "--db", url, "nightly"], capture_output=True, text=True,
                             timeout=120, check=False, env={**os.environ, "SLURMGPU_CONFIG": str(sample_config)})
    finally:
        holder.rollback()
        holder.close()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res
    assert "ingest failed (exit 2); not training" in res.stdout and "nightly: train" not in res.stdout, res


def test_nightly_units_carry_a_time_limit(tmp_path: Path) -> None:
    res = subprocess.run([str(BIN / "slurmgpu"), "render", "nightly", "--out", str(tmp_path), "--timeout", "90m"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert "\nTimeoutStartSec=90m\n" in (tmp_path / "slurmgpu-nightly.service").read_text()
    cron = (tmp_path / "slurmgpu.cron").read_text().splitlines()[-1]
    assert re.fullmatch(r"17 3 \* \* \* slurmgpu timeout --kill-after=60 90m \S+/slurmgpu nightly >> \S+ 2>&1", cron)
    for sample in ("slurmgpu-nightly.service", "slurmgpu.cron"):  # the samples are what the renderer writes
        text = (ROOT / "contrib" / "nightly" / sample).read_text()
        assert "TimeoutStartSec=4h" in text or "timeout --kill-after=60 4h" in text


def test_write_output_replaces_files_and_writes_through_devices_and_links(tmp_path: Path) -> None:
    regular = tmp_path / "out.lua"
    regular.write_text("old")
    inode = regular.stat().st_ino
    spool.write_output(str(regular), b"new", 0o644)
    assert regular.read_text() == "new" and regular.stat().st_ino != inode  # replaced atomically
    spool.write_output(str(tmp_path / "fresh.lua"), b"x", 0o644)
    assert (tmp_path / "fresh.lua").read_text() == "x"
    link = tmp_path / "stdout"
    link.symlink_to("/dev/null")  # as /dev/stdout is a link to /proc/self/fd/1
    spool.write_output(str(link), b"x", 0o644)
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert sorted(os.listdir(tmp_path)) == ["fresh.lua", "out.lua", "stdout"]  # no temporary left in the directory
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    spool.write_output(str(fifo), b"through the pipe", 0o644)
    reader.join(10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(IsADirectoryError):
        spool.write_output(str(tmp_path), b"x", 0o644)


# --- the real cluster ------------------------------------------------------------------------------


def _sbatch(*argv: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "--chdir=/tmp", "-o", "/dev/null", "-t", "1", *argv],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip().split(";")[0]


def _real_records(subs: str, own: str, theirs: str) -> dict[str, str]:
    return {"own": write(subs, record(own)), "forged": write(subs, record(theirs, changed=True))}


@pytest.mark.slurm
def test_real_jobs_real_sacct_records_linked_by_owner(accounts: None, tmp_path: Path) -> None:
    """sguser and root each submit a real job; sguser drops a record for each; the nightly account
    ingests real sacct and the spool: sguser's own record lands, the one for root's job is set aside."""
    started = datetime.now() - timedelta(seconds=5)
    mine = subprocess.run(["runuser", "-u", USER, "--", "sbatch", "--parsable", "--chdir=/tmp", "-o", "/dev/null",
                           "-t", "1", "--gres=gpu:t4:1", "-p", "gpu-small", "--wrap", "true"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip().split(";")[0]
    roots = _sbatch("--gres=gpu:t4:1", "-p", "gpu-small", "--wrap", "true")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,User,State", "-j", f"{mine},{roots}"],
                             capture_output=True, text=True, check=True).stdout
        done = [line for line in out.splitlines() if line.split("|")[2] == "COMPLETED"]
        if len(done) == 2:
            break
        time.sleep(2)
    else:
        pytest.fail(f"jobs {mine}, {roots} did not finish: {out}")
    nightly = pwd.getpwnam(NIGHTLY)
    home = tempfile.mkdtemp(prefix="sg-store-")
    subs, gpus = _spool_dir("sg-subs-"), _spool_dir("sg-gpus-")
    try:
        url = f"sqlite:///{home}/h.db"
        db.upgrade(url)
        for path in [home, *(os.path.join(home, n) for n in os.listdir(home))]:
            os.chown(path, nightly.pw_uid, nightly.pw_gid)
        names = as_user(USER, _real_records, subs, mine, roots)

        def live(url: str, subs: str, gpus: str) -> dict[str, Any]:
            res = CliRunner().invoke(main, ["--config", str(CONFIG), "--db", url, "ingest", "--since",
                                            started.strftime("%Y-%m-%dT%H:%M:%S")],
                                     env={"SLURMGPU_SUBMISSION_SPOOL": subs, "SLURMGPU_GPU_SPOOL": gpus})
            return {"code": res.exit_code, "stdout": res.stdout, "stderr": res.stderr,
                    "exception": repr(res.exception) if not isinstance(res.exception, SystemExit) else None}

        db.upgrade(f"sqlite:///{tmp_path}/warm.db")
        live(f"sqlite:///{tmp_path}/warm.db", str(tmp_path), str(tmp_path))  # imports, while root

        # sacct may show a just-finished job to a query a moment late: the nightly run is idempotent and
        # leaves a record whose job it cannot see yet waiting, so run it until nothing waits.
        runs: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while not runs or "waiting for their job" in runs[-1]["stdout"]:
            assert time.monotonic() < deadline, runs
            if runs:
                time.sleep(1)
            runs.append(as_user(NIGHTLY, live, url, subs, gpus))
        loaded = sum(int(re.search(r"(\d+) spool records loaded", r["stdout"]).group(1)) for r in runs)  # type: ignore[union-attr]
        assert loaded == 1 and any("rejected (1 forged)" in r["stdout"] for r in runs), runs
        assert any(f"{names['forged']}: forged: a submission record for job {CLUSTER}/{roots} of user root, but the "
                   f"file belongs to {USER}" in r["stderr"] for r in runs), runs
        stored = list(submissions(url).values())
        assert [(r["user"], r["job_id"]) for r in stored] == [(USER, mine)]
        assert sorted(os.listdir(subs)) == [f"{names['forged']}.rejected"]
    finally:
        for path in (home, subs, gpus):
            shutil.rmtree(path, ignore_errors=True)
