"""Users see their own efficiency (issue 28, item 9), live on the local cluster as ``sguser``.

With the documented modes the history database is 0600 to the nightly account, so an ordinary
user's ``seff``, ``jobs`` and ``report`` used to end with "unable to open database file". They now
ask ``slurmgpu serve``, which knows who asks (SO_PEERCRED) and answers only that user's jobs; root
(and the daemon's own account) sees every job. seff also gives CPU and host-memory efficiency from
sacct, and a running job is answered from Slurm instead of "not in the history database".
"""

from __future__ import annotations

import _strptime  # noqa: F401 - loaded here: the sguser child cannot read this interpreter's library
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from test_report import SAMPLE_CONFIG, UNPRIVILEGED, _as_unprivileged, add_job, insert
from test_serve import daemon, sock  # noqa: F401 - the socket fixture

from slurmgpu.apps import serve, serve_socket, userview
from slurmgpu.cli.main import main
from slurmgpu.history import db, ingest
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.slurm import sacct, usage

OTHER_JOB = "99999901"  # another user's job: stored, unknown to Slurm
NOW = datetime.utcnow().replace(microsecond=0)  # noqa: DTZ003 - the history stores naive UTC


def wait_for(job_id: str, states: set[str], timeout_s: float = 60.0) -> str:
    deadline, state = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True,
                             text=True, check=False).stdout.split()
        state = out[0] if out else ""
        if state.split()[0:1] and state.split()[0] in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {state or 'unknown'} after {timeout_s} s")


def sbatch_as_sguser(*words: str) -> str:
    res = subprocess.run(["runuser", "-u", UNPRIVILEGED, "--", "sbatch", "--parsable", "-p", "debug", *words],
                         capture_output=True, text=True, check=True, cwd="/tmp")
    return res.stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def finished() -> Iterator[str]:
    """sguser's finished job: 2 CPUs, one busy for about 8 s (CPU efficiency near 50%)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as sguser")
    job = sbatch_as_sguser("-n", "2", "-J", "access-busy", "--wrap", "timeout 8 sh -c 'while :; do :; done'; true")
    try:
        wait_for(job, {"COMPLETED", "FAILED"})
    except AssertionError:
        subprocess.run(["scancel", job], check=False)
        raise
    time.sleep(1)  # the batch step's TotalCPU reaches slurmdbd just after the job's end
    yield job


@pytest.fixture
def private_history(finished: str) -> Iterator[str]:
    """The documented history: a SQLite file 0600 to its owner (root here) in a directory anyone may
    list. It holds sguser's real job (loaded as the ingest loads sacct), a GPU job of sguser's and a
    GPU job and a stored-only job of another user's."""
    directory = tempfile.mkdtemp(prefix="slurmgpu-access-")
    os.chmod(directory, 0o755)
    url = f"sqlite:///{directory}/history.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    records = usage.live_jobs([finished])
    ingest.load_jobs(engine, [sacct.JobRecord(records[finished].values, 0)])
    engine.dispose()
    jobs: list[dict[str, Any]] = []
    add_job(jobs, "99999902", UNPRIVILEGED, "slurmgpu", "t4", 1, 3600, NOW - timedelta(days=1))
    add_job(jobs, OTHER_JOB, "alice", "ml", "a100", 2, 7200, NOW - timedelta(days=1))
    insert(url, jobs, [], [])
    os.chmod(f"{directory}/history.db", 0o600)
    yield url
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def history_daemon(private_history: str, sock: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: F811
    """slurmgpu serve (as root, as it runs before --run-as) serving that history; sguser may connect."""
    access = serve_socket.Access(frozenset({0, pwd.getpwnam(UNPRIVILEGED).pw_uid}))
    monkeypatch.setenv("SLURMGPU_SOCKET", sock)
    with daemon(sock, serve.Service(load_config(SAMPLE_CONFIG), database_url=private_history), access, mode=0o666):
        yield private_history


def as_sguser(url: str, *args: str) -> tuple[int, str, str]:
    return _as_unprivileged("--config", str(SAMPLE_CONFIG), "--db", url, *args)


@pytest.mark.slurm
def test_a_user_sees_their_own_job_with_cpu_and_memory_efficiency(history_daemon: str, finished: str) -> None:
    code, out, err = as_sguser(history_daemon, "seff", finished, "--json")
    assert code == 0, err
    [s] = json.loads(out)
    assert (s["job_id"], s["user"], s["state"]) == (finished, UNPRIVILEGED, "COMPLETED")
    host = s["host"]
    assert host["cpus"] == 2 and host["elapsed_s"] >= 7
    lines = subprocess.run(["sacct", "-n", "-P", "-o", "JobID,TotalCPU", "-j", finished], capture_output=True,
                           text=True, check=True).stdout.splitlines()  # the job's line sums its steps (-X: 0)
    total_cpu = dict(line.split("|") for line in lines)[finished]  # e.g. 00:07.812
    minutes, seconds = total_cpu.split(":")[-2:]
    assert host["total_cpu_s"] == pytest.approx(int(minutes) * 60 + float(seconds), abs=0.01)
    assert host["cpu_efficiency"] == pytest.approx(host["total_cpu_s"] / (2 * host["elapsed_s"]), abs=1e-3)
    assert 0 < host["cpu_efficiency"] <= 0.6, host  # one busy CPU of two (less on a loaded machine)
    assert host["req_mem_mib"] > 0 and 0 < host["mem_efficiency"] < 1, host
    code, text, err = as_sguser(history_daemon, "seff", finished)
    assert code == 0, err
    lines = text.splitlines()
    assert f"User/Account: {UNPRIVILEGED}/slurmgpu" in lines
    assert "Cores: 2" in lines
    assert any(line.startswith("CPU Efficiency: ") and "of 00:00:" in line for line in lines), text


@pytest.mark.slurm
def test_another_users_job_is_refused_and_root_sees_all(history_daemon: str, finished: str) -> None:
    code, out, err = as_sguser(history_daemon, "seff", OTHER_JOB)
    assert (code, out) == (1, "")
    assert err.splitlines() == [f"slurmgpu: error: job {OTHER_JOB} belongs to another user: you may only see "
                                "your own jobs"]
    for asker in ("cli", "daemon"):  # root reads the database itself, or asks the daemon
        if asker == "cli":
            res = CliRunner().invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", history_daemon, "seff",
                                            OTHER_JOB, finished, "--json"])
            assert res.exit_code == 0, res.output
            seen = json.loads(res.output)
        else:
            reply = serve.call(os.environ["SLURMGPU_SOCKET"], {"op": "seff", "jobs": [OTHER_JOB, finished]}, 10.0)
            assert reply is not None and reply["ok"], reply
            seen = [a["json"] for a in reply["seff"]]
        assert [(s["job_id"], s["user"]) for s in seen] == [(OTHER_JOB, "alice"), (finished, UNPRIVILEGED)]


@pytest.mark.slurm
def test_jobs_and_report_show_a_user_only_their_own(history_daemon: str, finished: str) -> None:
    code, out, err = as_sguser(history_daemon, "jobs", "--json")
    assert code == 0, err
    assert sorted(r["job_id"] for r in json.loads(out)) == sorted([finished, "99999902"])
    code, out, err = as_sguser(history_daemon, "jobs", "--user", "alice")
    assert (code, out) == (1, "") and "you may only list your own jobs, not alice's" in err
    since = (NOW - timedelta(days=3)).strftime("%Y-%m-%d")
    code, out, err = as_sguser(history_daemon, "report", "--since", since, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["user"], report["totals"]["jobs"]) == (UNPRIVILEGED, 1), report  # not alice's job
    assert [u["user"] for u in report["users"]] == [UNPRIVILEGED]
    res = CliRunner().invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", history_daemon, "report", "--since",
                                    since, "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["totals"]["jobs"] == 2, res.output


@pytest.mark.slurm
def test_a_running_job_is_answered_from_slurm(history_daemon: str, submitted: list[str]) -> None:
    job = sbatch_as_sguser("-n", "1", "-J", "access-running", "--wrap", "sleep 120")
    submitted.append(job)
    wait_for(job, {"RUNNING"})
    time.sleep(6)  # one accounting sample (JobAcctGatherFrequency=5)
    code, text, err = as_sguser(history_daemon, "seff", job)
    assert code == 0, err
    lines = text.splitlines()
    assert "State: RUNNING (exit code 0)" in lines, text
    assert any(line.startswith("CPU Utilized so far: ") for line in lines), text
    assert any(line.startswith("Missing: GPU figures: the job is RUNNING") for line in lines), text


def test_coordinators_see_their_accounts_and_admins_everything() -> None:
    """Slurm's rule for sacct, from sacctmgr's answer (changing the live cluster's coordinators is not
    a test's business): a coordinator sees the accounts they coordinate, an Operator every job."""
    def sacctmgr(answer: str) -> usage.Runner:
        return lambda argv: answer if argv[0] == "sacctmgr" else None

    me = pwd.getpwuid(os.getuid()).pw_name
    coord = userview.Viewer(os.getuid(), run=sacctmgr(f"{me}|None|ml,phys\n"))
    assert coord.may_see("alice", "ml") and coord.may_see("bob", "phys") and not coord.may_see("carol", "bio")
    assert coord.scope(None, "list") == me and coord.scope("alice", "list") == "alice"
    plain = userview.Viewer(os.getuid(), run=sacctmgr(f"{me}|None|\n"))
    assert plain.may_see(me, "bio") and not plain.may_see("alice", "ml")
    with pytest.raises(InputError, match="you may only list your own jobs, not alice's"):
        plain.scope("alice", "list")
    assert userview.Viewer(os.getuid(), run=sacctmgr(f"{me}|Operator|\n")).may_see("alice", "ml")
    assert not userview.Viewer(os.getuid(), run=lambda argv: None).may_see("alice", "ml")  # sacctmgr down


def test_a_bad_history_request_gets_one_line() -> None:
    service = serve.Service(load_config(SAMPLE_CONFIG), database_url="sqlite:///:memory:")
    peer = serve.Peer(1, 65534, 65534)
    for message, why in (({"op": "seff", "jobs": "1"}, "'jobs' must be a list"),
                         ({"op": "seff", "jobs": ["1"] * 101}, "at most 100 job ids"),
                         ({"op": "jobs", "limit": "x"}, "'limit' must be a whole number"),
                         ({"op": "report", "since": "yesterday", "until": None}, "must be an ISO time")):
        reply = service.handle(json.dumps(message).encode(), peer)
        assert reply["ok"] is False and why in reply["error"] and "\n" not in reply["error"], reply
    assert serve.Service.slow(b'{"op": "seff", "jobs": []}') and not serve.Service.slow(b'{"op": "health"}')
    no_db = serve.Service(load_config(SAMPLE_CONFIG)).handle(b'{"op": "jobs"}', peer)
    assert no_db == {"ok": False, "error": "this daemon serves no history database"}


def test_total_cpu_keeps_its_fraction_and_a_running_job_sums_its_steps() -> None:
    fields = usage.LIVE_FIELDS
    def row(**values: str) -> str:
        return usage.LIVE_DELIMITER.join(values.get(f, "") for f in fields)

    sacct_out = "\n".join([
        row(JobID="7", JobIDRaw="7", Cluster="c", User="u", Account="a", State="RUNNING", Elapsed="00:01:40",
            NCPUS="4", ReqTRES="cpu=4,mem=2G,node=1", NNodes="1", TotalCPU="00:00:00"),
        row(JobID="8", JobIDRaw="8", Cluster="c", User="u", Account="a", State="COMPLETED", Elapsed="00:00:10",
            NCPUS="2", ReqTRES="cpu=2,mem=1000M,node=2", NNodes="2", TotalCPU="00:07.500"),
        row(JobID="8.batch", State="COMPLETED", MaxRSS="102400K", TotalCPU="00:07.500"),
    ]) + "\n"
    sstat_out = "7.batch|204800K|cpu=00:01:00,mem=200M\n7.0|1048576K|cpu=00:02:00,mem=1G\n"

    def run(argv: Any) -> str | None:
        return sacct_out if argv[0] == "sacct" else sstat_out if argv[0] == "sstat" else None

    got = usage.live_jobs(["7", "8"], run=run)
    done = got["8"].use
    assert (done.total_cpu_s, done.cpu_efficiency, done.max_rss_mib, done.req_mem_mib) == (7.5, 0.375, 100.0, 500.0)
    running = got["7"].use
    assert running.live and running.total_cpu_s == 180.0 and running.max_rss_mib == 1024.0
    assert running.cpu_efficiency == pytest.approx(180 / 400) and running.mem_efficiency == 0.5


def test_a_history_request_never_holds_up_health_or_decisions(sock: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                              tmp_path: Any) -> None:
    """A seff lookup runs sacct and reads the database (about 0.3 s): answered in the I/O thread it held
    every health check 0.29 s; in a child process, health answered in 12 ms at worst meanwhile."""
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)

    def slow_seff(*_: Any, **__: Any) -> list[dict[str, Any]]:
        time.sleep(1.5)
        return []

    monkeypatch.setattr(userview, "seff_answers", slow_seff)
    with daemon(sock, serve.Service(load_config(SAMPLE_CONFIG), database_url=url)):
        import threading

        done: list[Any] = []
        asker = threading.Thread(target=lambda: done.append(serve.call(sock, {"op": "seff", "jobs": ["1"]}, 5.0)))
        asker.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        health = serve.call(sock, {"op": "health"}, 5.0)
        waited = time.monotonic() - t0
        asker.join()
    assert health is not None and health["ok"]
    assert waited < 0.75, f"health waited {waited:.2f} s behind a history request"
    assert done == [{"ok": True, "seff": []}]


def test_seff_says_so_when_accounting_could_not_be_asked(tmp_path: Any) -> None:
    """sacct failing or timing out is not a job accounting does not know: the answer says which."""
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    viewer = userview.Viewer(os.getuid(), everyone=True)
    assert usage.live_jobs(["12345"], run=lambda argv: None) is None
    down = userview.seff_answers(engine, ["12345"], None, None, viewer,
                                 live=lambda ids, cluster: usage.live_jobs(ids, cluster, run=lambda argv: None))
    empty = userview.seff_answers(engine, ["12345"], None, None, viewer,
                                  live=lambda ids, cluster: usage.live_jobs(ids, cluster, run=lambda argv: ""))
    assert "could not be asked" in down[0]["error"] and "does not know it" not in down[0]["error"]
    assert empty[0]["error"].endswith("accounting does not know it")


def test_a_job_whose_accounting_row_is_not_whole_yet_is_still_known() -> None:
    """Captured from slurmdbd here a second after a job ended: its row has QOS and Eligible Unknown and
    ReqMem "16?" (the job asked for 500M); seff must not say accounting does not know the job."""
    row = ("8183|8183|slurmgpu|root|root||Unknown|2026-12-07T04:26:52|Unknown|2026-12-07T04:26:53|"
           "2026-12-07T04:26:53|00:00:00||COMPLETED|0:0||billing=1,cpu=1,mem=500M,node=1|1|1|16?|||gpu2|"
           "allocation|00:00.002|\n")
    row = row.replace("|", usage.LIVE_DELIMITER)  # printed here with "|"; live_jobs asks for its own delimiter
    got = usage.live_jobs(["8183"], run=lambda argv: row if argv[0] == "sacct" else None)
    assert got is not None and got["8183"].values["state"] == "COMPLETED" and got["8183"].use.req_mem_mib is None
