"""``slurmgpu report``: numbers on a hand-built history checked against values worked out by hand,
the CSV/JSON formats, the non-root restriction (a real unprivileged process), and the HTML page
rendered by a real headless Chromium."""

from __future__ import annotations

import csv
import io
import json
import os
import pwd
import random
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_alerts import demo_history  # noqa: F401 - the demo generator's history, ingested

from slurmgpu.cli.main import main
from slurmgpu.cli.report import report_cmd
from slurmgpu.history import db
from slurmgpu.history.db import GpuUsage, Job, Submission
from slurmgpu.reporting import queries, render, report

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_CONFIG = ROOT / "contrib" / "slurmgpu.toml"
SINCE, UNTIL = datetime(2026, 1, 1), datetime(2026, 1, 31)
main.add_command(report_cmd)  # as cli.py registers it; harmless when it already has


def local(utc: datetime) -> str:
    """The CLI takes local times and the store holds UTC: the local spelling of a UTC instant."""
    return utc.replace(tzinfo=UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S")


WINDOW = ("--since", local(SINCE), "--until", local(UNTIL))


def add_job(rows: list[dict[str, Any]], job_id: str, user: str, account: str, gpu_type: str | None, gpus: int,
            elapsed_s: int, end: datetime, state: str = "COMPLETED", cluster: str = "slurmgpu", **extra: Any) -> None:
    rows.append({"cluster": cluster, "job_id": job_id, "user": user, "account": account, "gpu_type": gpu_type,
                 "gpu_count": gpus, "elapsed_s": elapsed_s, "state": state, "end_time": end,
                 "submit_time": end - timedelta(seconds=elapsed_s + 600),
                 "start_time": end - timedelta(seconds=elapsed_s), "job_id_raw": int(re.sub(r"\D.*", "", job_id)),
                 **extra})


def usage(job_id: str, peak: float, util: float, per_gpu_util: list[float], host: str = "n1",
          cluster: str = "slurmgpu") -> dict[str, Any]:
    return {"cluster": cluster, "job_id": job_id, "hostname": host, "source": "nvml", "gpus": len(per_gpu_util),
            "peak_mem_mib": peak, "max_util": util, "mean_util": util / 2, "samples": 10,
            "detail": [{"index": i, "peak_mem_mib": peak, "max_util": u} for i, u in enumerate(per_gpu_util)]}


def submission(job_id: str, user: str, original: dict[str, Any], changes: list[dict[str, Any]],
               per_type: list[dict[str, Any]] | None = None, cluster: str = "slurmgpu") -> dict[str, Any]:
    return {"record_id": f"rec-{job_id}", "cluster": cluster, "job_id": job_id, "user": user,
            "submitted_at": datetime(2026, 1, 2), "features": {}, "original_request": original,
            "decision": {"decider": "model", "changed": bool(changes), "refused": None, "reasons": [],
                         "changes": changes, "per_type": per_type or []},
            "changed": bool(changes)}


def candidate(gpu_type: str, gpus: int, wait: float, runtime: float) -> dict[str, Any]:
    return {"gpu_type": gpu_type, "gpus": gpus, "fits": True, "pred_peak_mem_mib": 1000.0,
            "pred_runtime_s": runtime, "expected_wait_s": wait}


def insert(url: str, jobs: list[dict[str, Any]], usages: list[dict[str, Any]], subs: list[dict[str, Any]]) -> None:
    engine = db.make_engine(url)
    keys = {k for j in jobs for k in j}  # an executemany insert takes its columns from the first row
    with engine.begin() as conn:
        conn.execute(Job.__table__.insert(), [dict.fromkeys(keys) | j for j in jobs])
        if usages:
            columns = {k for u in usages for k in u}
            conn.execute(GpuUsage.__table__.insert(), [dict.fromkeys(columns) | u for u in usages])
        if subs:
            conn.execute(Submission.__table__.insert(), subs)
    engine.dispose()


def small_history(url: str) -> None:
    """The history the expected numbers below were worked out from (config: a100 80 GiB, v100 32, t4 16)."""
    jobs: list[dict[str, Any]] = []
    add_job(jobs, "101", "alice", "ml", "a100", 2, 3600, datetime(2026, 1, 10, 12))  # 2 GPU-h, 1 of 2 GPUs busy
    add_job(jobs, "102", "alice", "ml", "a100", 1, 7200, datetime(2026, 1, 11, 12))  # 2 GPU-h, idle
    add_job(jobs, "103", "bob", "phys", "v100", 4, 1800, datetime(2026, 1, 12, 12), state="OUT_OF_MEMORY",
            sacct_gpu_mem_mib=40000.0, sacct_gpu_util=80.0)  # 2 GPU-h, sacct only, peak above the card
    add_job(jobs, "104", "bob", "phys", "t4", 1, 3600, datetime(2026, 1, 20, 12))  # 1 GPU-h, unmeasured
    add_job(jobs, "500_3", "carol", "ml", "v100", 2, 3600, datetime(2026, 1, 15, 12), job_id_raw=503,
            array_job_id=500, array_task_id=3)  # array task: collector knows its raw id, gsbatch the array's
    add_job(jobs, "105", "alice", "ml", "a100", 8, 3600, UNTIL)  # ends at --until: outside the window
    add_job(jobs, "106", "alice", "ml", "a100", 8, 3600, SINCE - timedelta(seconds=1))  # before the window
    add_job(jobs, "107", "alice", "ml", None, 0, 3600, datetime(2026, 1, 10))  # no GPUs
    add_job(jobs, "108", "dave", "ml", "a100", 1, 3600, datetime(2026, 1, 10), cluster="other")  # other cluster
    usages = [usage("101", 40960.0, 90.0, [90.0, 2.0]), usage("102", 100.0, 0.0, [0.0]),
              usage("503", 16384.0, 50.0, [50.0, 40.0]), usage("105", 1.0, 0.0, [0.0] * 8)]
    subs = [
        submission("103", "bob", {"gpu_type": "v100", "gpus_total": 8, "partition": "gpu"},
                   [{"index": 0, "gpu_type": None, "gpus_total": 4, "partition": None}],
                   [candidate("v100", 8, 1800.0, 100.0), candidate("v100", 4, 0.0, 150.0),
                    candidate("a100", 8, 1800.0, 60.0)]),
        submission("104", "bob", {"gpu_type": "a100", "gpus_total": 1, "partition": "gpu"},
                   [{"index": 0, "gpu_type": "t4", "gpus_total": None, "partition": "gpu-small"}]),
        submission("500", "carol", {"gpu_type": "v100", "gpus_total": 4, "partition": "gpu"},
                   [{"index": 0, "gpu_type": None, "gpus_total": 2, "partition": None}]),
        submission("101", "alice", {"gpu_type": "a100", "gpus_total": 2, "partition": "gpu"}, []),
    ]
    insert(url, jobs, usages, subs)


def run_report(url: str, *args: str) -> Any:
    return CliRunner().invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", url, "report", *WINDOW, *args])


def test_report_numbers_match_hand_computed_values(db_url: str) -> None:
    small_history(db_url)
    res = run_report(db_url, "--format", "json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["window"] == {"since": "2026-01-01T00:00:00Z", "until": "2026-01-31T00:00:00Z"}
    types = {t["gpu_type"]: t for t in data["gpu_types"]}
    assert list(types) == ["a100", "v100", "t4"]  # by GPU-hours, ties in first-seen order
    a100_share = (2 * 0.5 + 2 * 100 / 81920) / 4
    assert types["a100"] == pytest.approx({"gpu_type": "a100", "jobs": 2, "gpu_hours": 4.0, "measured_gpu_hours": 4.0,
                                           "mem_used_share": a100_share, "idle_gpu_hours": 2.0, "mem_asked_gib": 80.0,
                                           "mem_used_gib": (2 * 40 + 2 * 100 / 1024) / 4}, abs=1e-4)
    # job 103's sacct peak (40000 MiB) is capped at the 32 GiB card: share 1.0 for 2 GPU-h, 0.5 for 2 GPU-h.
    assert types["v100"] == pytest.approx({"gpu_type": "v100", "jobs": 2, "gpu_hours": 4.0, "measured_gpu_hours": 4.0,
                                           "mem_used_share": 0.75, "idle_gpu_hours": 0.0, "mem_asked_gib": 32.0,
                                           "mem_used_gib": 24.0}, abs=1e-4)
    assert types["t4"] == {"gpu_type": "t4", "jobs": 1, "gpu_hours": 1.0, "measured_gpu_hours": 0.0,
                           "mem_used_share": None, "idle_gpu_hours": 0.0, "mem_asked_gib": None, "mem_used_gib": None}
    users = {(u["user"], u["account"]): u for u in data["users"]}
    assert list(users) == [("alice", "ml"), ("bob", "phys"), ("carol", "ml")]
    assert users["alice", "ml"] == pytest.approx({
        "user": "alice", "account": "ml", "jobs": 2, "gpu_hours": 4.0, "idle_gpu_hours": 2.0,
        "mem_asked_gib": 80.0, "mem_used_gib": (2 * 40 + 2 * 100 / 1024) / 4, "mem_used_share": a100_share,
        "gpus_asked": 3, "gpus_busy": 1, "ooms": 0, "gpu_ooms": 0, "changed": 0, "gpu_hours_saved": 0.0,
        "queue_hours_saved": None}, abs=1e-4)
    # (8 - 4 GPUs) x 0.5 h = 2 GPU-h; queue: 1800 s expected as asked (v100 x 8), 0 s as decided = 0.5 h.
    assert users["bob", "phys"] == pytest.approx({
        "user": "bob", "account": "phys", "jobs": 2, "gpu_hours": 3.0, "idle_gpu_hours": 0.0,
        "mem_asked_gib": 32.0, "mem_used_gib": 32.0, "mem_used_share": 1.0, "gpus_asked": 0, "gpus_busy": 0,
        "ooms": 1, "gpu_ooms": 0, "changed": 2, "gpu_hours_saved": 2.0, "queue_hours_saved": 0.5}, abs=1e-4)
    assert users["carol", "ml"] == pytest.approx({
        "user": "carol", "account": "ml", "jobs": 1, "gpu_hours": 2.0, "idle_gpu_hours": 0.0,
        "mem_asked_gib": 32.0, "mem_used_gib": 16.0, "mem_used_share": 0.5, "gpus_asked": 2, "gpus_busy": 2,
        "ooms": 0, "gpu_ooms": 0, "changed": 1, "gpu_hours_saved": 2.0, "queue_hours_saved": None}, abs=1e-4)
    assert data["changes"] == [
        {"change": "4 -> 2 GPUs", "jobs": 1, "users": 1, "gpu_hours_saved": 2.0, "queue_hours_saved": None},
        {"change": "8 -> 4 GPUs", "jobs": 1, "users": 1, "gpu_hours_saved": 2.0, "queue_hours_saved": 0.5},
        {"change": "a100 -> t4; partition gpu -> gpu-small", "jobs": 1, "users": 1, "gpu_hours_saved": 0.0,
         "queue_hours_saved": None},
    ]
    assert data["totals"] == pytest.approx({
        "jobs": 5, "gpu_hours": 9.0, "idle_gpu_hours": 2.0, "mem_used_share": (4 * a100_share + 4 * 0.75) / 8,
        "ooms": 1, "gpu_ooms": 0, "changed": 3, "gpu_hours_saved": 4.0, "queue_hours_saved": 0.5,
        "advised": 0, "advised_gpu_hours": 0.0, "advised_queue_hours": None}, abs=1e-4)
    assert data["advised"] == []
    assert {(d["date"], d["gpu_type"]): d["gpu_hours"] for d in data["daily"]} == {
        ("2026-01-10", "a100"): 2.0, ("2026-01-11", "a100"): 2.0, ("2026-01-12", "v100"): 2.0,
        ("2026-01-15", "v100"): 2.0, ("2026-01-20", "t4"): 1.0}
    assert "gpu_hours_saved" in data["definitions"]


def test_filters_by_user_account_and_window(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    small_history(url)
    only_bob = json.loads(run_report(url, "--format", "json", "--user", "bob").output)
    assert only_bob["user"] == "bob" and [u["user"] for u in only_bob["users"]] == ["bob"]
    ml = json.loads(run_report(url, "--format", "json", "--account", "ml").output)
    assert {u["user"] for u in ml["users"]} == {"alice", "carol"}
    other = json.loads(run_report(url, "--format", "json", "--cluster", "other").output)
    assert [u["user"] for u in other["users"]] == ["dave"]
    res = CliRunner().invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", url, "report", "--since", "2026-01-12",
                                    "--until", "2026-01-10"])
    assert res.exit_code == 1 and "--since must be before --until" in res.output


def test_csv_and_table_formats(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    small_history(url)
    res = run_report(url, "--format", "csv")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.output)))
    # alerts: alice's idle job (2 GPU-h) and 1 of 2 idle GPUs (1 GPU-h), bob's host-memory kill (2 GPU-h)
    assert [r["section"] for r in rows] == ["gpu_type"] * 3 + ["user"] * 3 + ["change"] * 3 + ["alert"] * 3
    assert [(r["user"], r["kind"], r["wasted_gpu_hours"]) for r in rows if r["section"] == "alert"] == [
        ("bob", "host_oom", "2.0"), ("alice", "no_gpu_use", "2.0"), ("alice", "idle_gpus", "1.0")]
    t4 = next(r for r in rows if r["section"] == "gpu_type" and r["gpu_type"] == "t4")
    assert (t4["gpu_hours"], t4["mem_used_share"], t4["user"]) == ("1.0", "", "")
    bob = next(r for r in rows if r["user"] == "bob")
    assert (bob["ooms"], bob["changed"], bob["gpu_hours_saved"], bob["queue_hours_saved"]) == ("1", "2", "2.0", "0.5")
    table = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", url, "report",
                                                           *WINDOW])
    assert table.exit_code == 0, table.output
    assert "9.0 GPU-h (2.0 idle)" in table.output and "a100 -> t4; partition gpu -> gpu-small" in table.output


def test_empty_window_prints_empty_report(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    data = json.loads(run_report(url, "--format", "json").output)
    assert data["totals"]["jobs"] == 0 and data["totals"]["mem_used_share"] is None and data["users"] == []


def use(**fields: Any) -> queries.JobUse:
    base = {"job_id": "1", "user": "u", "account": "a", "gpu_type": "a100", "gpu_count": 4, "elapsed_s": 7200,
            "state": "COMPLETED", "end_time": datetime(2026, 1, 2), "peak_mib": None, "max_util": None,
            "gpus_busy": None, "original": None, "decision": None, "changed": False}
    return queries.JobUse(**(base | fields))


def test_change_descriptions_and_estimates() -> None:
    het = {"gpu_type": None, "gpus_total": 3, "components": [{"gpu_type": None, "gpus_total": 2, "partition": None},
                                                             {"gpu_type": "t4", "gpus_total": 1, "partition": "gpu"}]}
    decision = {"changes": [{"index": 1, "gpu_type": None, "gpus_total": None, "partition": "gpu-small"}]}
    assert report.describe_change(het, decision) == "component 1: partition gpu -> gpu-small"
    # An untyped request: the baseline is the requested count of any type with the soonest finish.
    untyped = use(changed=True, original={"gpu_type": None, "gpus_total": 4},
                  decision={"changes": [{"index": 0, "gpu_type": "v100", "gpus_total": 2}],
                            "per_type": [candidate("a100", 4, 600.0, 1000.0), candidate("v100", 4, 0.0, 3000.0),
                                         candidate("v100", 2, 100.0, 3500.0)]})
    assert report.describe_change(untyped.original, untyped.decision) == "any -> v100; 4 -> 2 GPUs"
    limited = {"changes": [{"index": 0, "gpu_type": "v100", "time_limit_s": 93600}]}
    assert report.describe_change({"gpu_type": "a100", "gpus_total": 1, "time_limit_s": 3600}, limited) == \
        "a100 -> v100; time limit 01:00:00 -> 1-02:00:00"
    assert report.queue_seconds_saved(untyped) == 500.0
    assert report.gpu_hours_saved(untyped) == 4.0  # (4 - 2) GPUs x 2 h
    assert report.queue_seconds_saved(untyped._replace(changed=False)) is None
    assert report.gpu_hours_saved(untyped._replace(changed=False)) == 0.0


def test_html_escapes_names_and_renders_an_empty_window() -> None:
    evil = "<script>alert(1)</script>"
    rep = report.build([use(user=evil, account='"><img src=x>', gpu_type="<b>")], None,
                       datetime(2026, 1, 1), datetime(2026, 1, 31))
    page = render.to_html(rep, datetime(2026, 2, 1))
    assert "<script" not in page and "<img" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    empty = render.to_html(report.build([], None, datetime(2026, 1, 1), datetime(2026, 1, 2)), datetime(2026, 1, 2))
    assert empty.count("None in this window.") == 4


# --- a user who is not root sees only their own jobs --------------------------------------------

UNPRIVILEGED = "sguser"


def _as_unprivileged(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI run in a forked child that dropped to the unprivileged
    user for good: a real non-root uid, so the command's own checks decide what it may see.
    (runuser would need an interpreter that user can execute, which a pyenv under /root is not.)"""
    pw = pwd.getpwnam(UNPRIVILEGED)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            os.environ["HOME"] = pw.pw_dir
            res = CliRunner().invoke(main, list(args))
            answer = [res.exit_code, res.stdout, res.stderr]
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
            answer = [99, "", f"child failed: {exc!r}"]
        with os.fdopen(write_end, "w") as out:
            json.dump(answer, out)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as got:
        answer = json.load(got)
    os.waitpid(pid, 0)
    return answer[0], answer[1], answer[2]


@pytest.fixture
def shared_db() -> Iterator[str]:
    """A history the unprivileged user can open (SQLite's WAL needs write access to the files)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    try:
        pwd.getpwnam(UNPRIVILEGED)
    except KeyError:
        pytest.skip(f"user {UNPRIVILEGED} does not exist")
    directory = tempfile.mkdtemp(prefix="slurmgpu-report-")
    os.chmod(directory, 0o777)
    url = f"sqlite:///{directory}/h.db"
    db.upgrade(url)
    small_history(url)
    jobs: list[dict[str, Any]] = []
    add_job(jobs, "900", UNPRIVILEGED, "slurmgpu", "t4", 2, 3600, datetime(2026, 1, 5))
    insert(url, jobs, [], [])
    # Root sees everyone (this run also imports all the child needs: the stdlib may be unreadable to it).
    as_root = json.loads(run_report(url, "--format", "json").output)
    assert {u["user"] for u in as_root["users"]} == {"alice", "bob", "carol", UNPRIVILEGED}
    run_report(url, "--format", "csv")
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666)
    yield url
    shutil.rmtree(directory)


def test_unprivileged_user_sees_only_own_rows(shared_db: str) -> None:
    base = ("--config", str(SAMPLE_CONFIG), "--db", shared_db, "report", *WINDOW)
    code, out, err = _as_unprivileged(*base, "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["user"] == UNPRIVILEGED
    assert [(u["user"], u["gpu_hours"]) for u in data["users"]] == [(UNPRIVILEGED, 2.0)]
    assert data["totals"]["jobs"] == 1 and data["changes"] == []
    code, out, err = _as_unprivileged(*base, "--format", "csv", "--account", "ml")  # others' account: nothing
    assert code == 0 and out.count("\n") == 1, (out, err)
    code, out, err = _as_unprivileged(*base, "--user", "alice", "--format", "json")
    assert (code, out) == (1, "")
    assert err.splitlines() == ["slurmgpu: error: --user: you may only report on your own jobs, not alice's"]


# --- the HTML page in a real browser -------------------------------------------------------------


def realistic_history(url: str, seed: int = 7) -> None:
    """A month of a small GPU cluster: 14 users in 5 accounts, some wasteful, some changed by gsbatch."""
    rng = random.Random(seed)
    people = [("anna", "nlp"), ("ben", "nlp"), ("chen", "vision"), ("dara", "vision"), ("eli", "physics"),
              ("fatima", "chem"), ("gus", "chem"), ("hana", "nlp"), ("ivan", "vision"), ("jo", "physics"),
              ("kai", "bio"), ("lena", "bio"), ("mo", "nlp"), ("nia", "chem")]
    cards = {"a100": 81920.0, "v100": 32768.0, "t4": 16384.0}
    jobs: list[dict[str, Any]] = []
    usages: list[dict[str, Any]] = []
    subs: list[dict[str, Any]] = []
    for n in range(900):
        user, account = rng.choice(people[: 4 + n % 11])
        gtype = rng.choices(["a100", "v100", "t4"], [5, 3, 2])[0]
        gpus = rng.choice([1, 1, 1, 2, 4, 8] if gtype == "a100" else [1, 1, 2, 4])
        elapsed = int(rng.lognormvariate(8.3, 1.0))
        end = datetime(2026, 11, 1) + timedelta(seconds=rng.uniform(0, 30 * 86400))
        state = rng.choices(["COMPLETED", "FAILED", "OUT_OF_MEMORY", "TIMEOUT", "CANCELLED"], [80, 6, 5, 4, 5])[0]
        job_id = str(20000 + n)
        add_job(jobs, job_id, user, account, gtype, gpus, elapsed, end, state=state)
        if rng.random() < 0.85:
            lazy = user in ("gus", "kai") or rng.random() < 0.08
            share = rng.uniform(0.05, 0.3) if lazy else rng.uniform(0.25, 0.98)
            util = rng.uniform(0, 4) if lazy and rng.random() < 0.5 else rng.uniform(30, 100)
            per_gpu = [util if i == 0 or not lazy else rng.uniform(0, 3) for i in range(gpus)]
            usages.append(usage(job_id, share * cards[gtype], util, per_gpu))
        if rng.random() < 0.5:
            asked = gpus * 2 if rng.random() < 0.3 else gpus
            change = ({"index": 0, "gpu_type": None, "gpus_total": gpus, "partition": None} if asked != gpus
                      else {"index": 0, "gpu_type": gtype, "gpus_total": None, "partition": None})
            was = "a100" if asked != gpus or gtype != "a100" else "v100"
            original = {"gpu_type": gtype if asked != gpus else was, "gpus_total": asked, "partition": "gpu"}
            changed = asked != gpus or rng.random() < 0.25
            per_type = [candidate(original["gpu_type"], asked, 1800.0, elapsed), candidate(gtype, gpus, 0.0, elapsed)]
            subs.append(submission(job_id, user, original, [change] if changed else [], per_type))
    insert(url, jobs, usages, subs)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail("chromium not installed (CI=true: `apt-get install -y chromium`)")
    pytest.skip("chromium not installed: `apt-get install -y chromium` to check the HTML report in a browser")


def _browser(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_html_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    chromium = _chromium()
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    realistic_history(url)
    page = tmp_path / "report.html"
    res = CliRunner().invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", url, "report",
                                    "--since", local(datetime(2026, 11, 1)), "--until", local(datetime(2026, 12, 1)),
                                    "--html", str(page)])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"wrote {page}: 900 GPU jobs"
    source = page.read_text()
    # Self-contained: no scripts, no links, no src/href but in-page ones.
    assert not re.search(r"<script|<link|<img|<iframe|\b(?:src|href)\s*=|url\(|@import", source, re.I)
    assert oct(page.stat().st_mode & 0o777) == "0o644"

    dom = _browser(chromium, tmp_path / "profile", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<table>") == 4 and html.count("<svg") == 5
    assert _clipped_labels(html) == []
    memory = html[html.index("GPU memory per GPU by type"):html.index("GPU memory per GPU by user")]
    assert re.search(r'class="value">[\d.,]+ of 80 GiB</text>', memory), memory[:2000]  # a100: used of allocated
    users = html[html.index("GPU memory per GPU by user"):html.index("<h2>GPU types</h2>")]
    assert ">gus (chem)</text>" in users and users.count('class="value"') == 12
    assert len(re.findall(r"<rect ", html)) > 60
    for heading in ("GPU types", "Users and accounts", "Changes by slurmgpu", "Alerts", "How the numbers are made"):
        assert f"<h2>{heading}</h2>" in html
    for cell in ('<td class="t">a100</td>', '<td class="t">gus</td>', '<td class="t">chem</td>',
                 '<td class="t">v100 -&gt; a100</td>', "<td>2,491.6</td>"):
        assert cell in html
    # the alerts: gus (who leaves GPUs idle) is told how many GPUs to ask for
    alerts = html[html.index("<h2>Alerts</h2>"):html.index("<h2>How the numbers are made</h2>")]
    idle = re.search(r'<td class="t">gus</td><td class="t">chem</td><td class="t">idle GPUs in multi-GPU jobs</td>'
                     r'(?:<td>[^<]*</td>){3}<td class="t">\d+</td><td class="t">(\d+) of (\d+) GPUs idle</td>'
                     r'<td class="t">use (\d+) GPU\(s\), not (\d+) \(--gres=gpu:\w+:(\d+)\)</td>', alerts)
    assert idle, alerts[:3000]
    assert int(idle[3]) < int(idle[4]) and idle[3] == idle[5]
    assert "host memory (Slurm OUT_OF_MEMORY)" in alerts and "GPU type too powerful" in alerts

    shot = tmp_path / "report.png"
    res = _browser(chromium, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,1600",
                   "--hide-scrollbars", page.as_uri())
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1200, 1600)
        colors = img.convert("RGB").getcolors(maxcolors=1 << 16) or []
    # The charts drew: the bar colours cover a real area of the screenshot.
    painted = {c: n for n, c in colors}
    assert painted.get((0x3B, 0x6F, 0xB6), 0) > 5000 and painted.get((0xC8, 0xCD, 0xD4), 0) > 2000
    if os.environ.get("SLURMGPU_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "report.png")


def _clipped_labels(html: str) -> list[str]:
    """The chart texts that reach past their SVG's viewBox, measured in the page's own font
    (DejaVu Sans at the template's sizes: 12 px, 11 px for values and axes)."""
    from PIL import ImageFont

    fonts = {px: ImageFont.truetype("DejaVuSans.ttf", px) for px in (11, 12)}
    out = []
    for width, body in re.findall(r'<svg[^>]*viewBox="0 0 ([\d.]+) [\d.]+"[^>]*>(.*?)</svg>', html, re.S):
        for x, anchor, css, text in re.findall(r'<text x="([\d.-]+)" y="[\d.-]+" text-anchor="(\w+)"'
                                               r'(?: class="(\w+)")?>([^<]*)</text>', body):
            size = fonts[11 if css else 12].getlength(text.replace("&amp;", "&"))
            start = float(x) - {"start": 0, "middle": size / 2, "end": size}[anchor]
            if start < 0 or start + size > float(width):
                out.append(text)
    return out


def test_chart_labels_are_never_clipped() -> None:
    """Big totals and long names: the bars make room for their labels in the page's font."""
    rows = [("a-very-long-user-name (an-account)", [(123456.0, "#000", "")]), ("b", [(20000.0, "#000", "")])]
    chart = render.bar_chart("t", rows, "GPU-h", [])
    svg = (f'<svg viewBox="0 0 {chart.width} {chart.height}">' + "".join(
        f'<text x="{t.x:.1f}" y="{t.y:.1f}" text-anchor="{t.anchor}"' + (f' class="{t.css}"' if t.css else "")
        + f">{t.text}</text>" for t in chart.texts) + "</svg>")
    assert "123,456 GPU-h" in svg and _clipped_labels(svg) == []


def test_tables_fit_the_terminal_and_wide_shows_every_column(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    small_history(url)
    args = ["--config", str(SAMPLE_CONFIG), "--db", url, "report", *WINDOW]
    for columns in ("80", "100"):
        narrow = CliRunner(env={"COLUMNS": columns}).invoke(main, args)
        assert narrow.exit_code == 0, narrow.output
        assert max(len(line) for line in narrow.output.splitlines()) <= int(columns), narrow.output
        assert "--wide shows them all" in narrow.output
        assert ("GiB/GPU asked" in narrow.output) == (columns == "100")  # the wider terminal shows more
    wide = CliRunner(env={"COLUMNS": "80"}).invoke(main, [*args, "--wide"])
    assert wide.exit_code == 0, wide.output
    assert "GiB/GPU asked" in wide.output and "example job" in wide.output and "--wide shows" not in wide.output
    assert "use 1 GPU(s), not 2 (--gres=gpu:a100:1)" in wide.output  # a fix is never folded in --wide
    alerts_only = CliRunner(env={"COLUMNS": "80"}).invoke(main, [*args, "--alerts", "--json"])
    data = json.loads(alerts_only.output)
    assert [(a["user"], a["kind"]) for a in data["alerts"]] == [("bob", "host_oom"), ("alice", "no_gpu_use"),
                                                                ("alice", "idle_gpus")]
    assert data["totals"]["wasted_gpu_hours"] == 5.0
    clash = CliRunner().invoke(main, [*args, "--json", "--format", "csv"])
    assert clash.exit_code == 1 and "--json and --format csv" in clash.output


def test_advised_decisions_are_shown_apart_from_applied_ones() -> None:
    """Advise mode (pipeline/modes.py): the record holds the decision, marked advised, and says
    nothing changed; the report counts it under 'advised, not applied', never as changed."""
    change = {"changes": [{"index": 0, "gpu_type": None, "gpus_total": 2}],
              "per_type": [candidate("v100", 4, 3600.0, 3000.0), candidate("v100", 2, 0.0, 3500.0)]}
    original = {"gpu_type": "v100", "gpus_total": 4}
    jobs = [use(job_id="1", gpu_type="v100", original=original, changed=False,
                decision={**change, "mode": "advise", "advised": True}),
            use(job_id="2", gpu_type="v100", user="w", original=original, changed=False,
                decision={**change, "mode": "advise", "advised": True}),
            use(job_id="3", gpu_type="v100", original=original, changed=True, decision=change),
            use(job_id="4", original=original, changed=False,  # advise mode, nothing to advise
                decision={"changes": [], "mode": "advise", "advised": False})]
    rep = report.build(jobs, None, datetime(2026, 1, 1), datetime(2026, 1, 31))
    totals = rep.totals()
    assert (totals["changed"], totals["gpu_hours_saved"], totals["queue_hours_saved"]) == (1, 4.0, 1.0)
    assert (totals["advised"], totals["advised_gpu_hours"], totals["advised_queue_hours"]) == (2, 8.0, 2.0)
    assert rep.advised == (report.ChangeRow("4 -> 2 GPUs", 2, 2, 8.0, 2.0),)
    assert render.headline(rep).endswith(
        "1 changed by slurmgpu (4.0 GPU-h saved); advised, not applied: 2 jobs, est. 8.0 GPU-h / 2.0 queue-h")
    assert json.loads(render.to_json(rep))["advised"] == [
        {"change": "4 -> 2 GPUs", "jobs": 2, "users": 2, "gpu_hours_saved": 8.0, "queue_hours_saved": 2.0}]
    assert [line.split(",")[0] for line in render.to_csv(rep).splitlines()].count("advised") == 1
    assert "Advised, not applied" in render.table_rows(rep)
    assert "advised, not applied" in render.to_html(rep, datetime(2026, 2, 1))
    assert "Advised, not applied" not in render.table_rows(report.build(jobs[2:], None, datetime(2026, 1, 1),
                                                                        datetime(2026, 1, 31)))


def oom_history(url: str) -> None:
    """GPU OOMs the collector saw, against the usable memory NVML reported (a T4: 15,360 MiB, not 16 GiB)."""
    jobs: list[dict[str, Any]] = []
    day = datetime(2026, 1, 10)
    add_job(jobs, "301", "tess", "ml", "t4", 1, 3600, day, state="FAILED", partition="gpu-small")
    add_job(jobs, "302", "tess", "ml", "v100", 2, 3600, day, state="TIMEOUT", partition="gpu")
    add_job(jobs, "303", "tess", "ml", "a100", 1, 3600, day, partition="gpu")  # caught its OOM and finished
    add_job(jobs, "304", "tess", "ml", "v100", 1, 3600, day, state="OUT_OF_MEMORY", partition="gpu")  # host memory
    add_job(jobs, "305", "tess", "ml", "a100", 1, 3600, day, state="FAILED", partition="gpu")  # another error
    t4 = usage("301", 15000.0, 90.0, [90.0])  # 97.7% of 15,360 MiB; 91.6% of the nominal 16 GiB
    t4["detail"][0]["memory_total_mib"] = 15360.0
    said = usage("302", 20000.0, 90.0, [90.0, 90.0])
    said["gpu_oom"], said["gpu_oom_line"] = "pytorch", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    caught = usage("303", 81000.0, 90.0, [90.0])
    caught["gpu_oom"] = "pytorch"
    insert(url, jobs, [t4, said, caught, usage("305", 1000.0, 90.0, [90.0])], [])


def test_gpu_ooms_have_one_definition_in_headline_tables_and_alerts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    oom_history(url)
    data = json.loads(run_report(url, "--format", "json").output)
    assert (data["totals"]["ooms"], data["totals"]["gpu_ooms"]) == (3, 2)
    assert [(u["ooms"], u["gpu_ooms"]) for u in data["users"]] == [(3, 2)]
    oom_alerts = {a["kind"]: a for a in data["alerts"]}
    assert (oom_alerts["gpu_oom"]["jobs"], oom_alerts["host_oom"]["jobs"]) == (2, 1)
    jobs = queries.load_jobs(db.make_engine(url), SINCE, UNTIL)
    from slurmgpu.pipeline.config import load_config
    from slurmgpu.reporting import alerts

    found = {a.job_id: a for j in jobs for a in alerts.job_alerts(j, load_config(str(SAMPLE_CONFIG)))}
    assert {k: a.kind for k, a in found.items()} == {"301": "gpu_oom", "302": "gpu_oom", "304": "host_oom"}
    assert found["301"].detail == "peak 14.6 GiB of the card's 15.0 GiB"
    assert found["302"].detail.startswith("pytorch reported CUDA out of memory; peak 19.5 GiB of the card's 32.0 GiB")
    assert "3 OOMs (2 GPU)" in render.headline(report.build(jobs, load_config(str(SAMPLE_CONFIG)), SINCE, UNTIL))
    page = run_report(url, "--html", str(tmp_path / "r.html"))
    assert page.exit_code == 0, page.output
    assert re.search(r'<div class="v">3</div><div class="k">OOM jobs \(2 GPU, 1 host memory\)</div>',
                     (tmp_path / "r.html").read_text())


def test_gpu_oom_count_on_the_demo_history_matches_its_alerts(demo_history: tuple[Any, Any, str]) -> None:  # noqa: F811
    """The demo's history: the headline's OOM count is its own alerts' GPU and host OOM jobs."""
    from slurmgpu.pipeline.config import load_config

    hist, engine, _ = demo_history
    config = load_config(str(SAMPLE_CONFIG))
    built = report.build(queries.load_jobs(engine, datetime(2000, 1, 1), hist.cut), config, datetime(2000, 1, 1),
                         hist.cut)
    by_kind = {r.kind: 0 for r in built.alerts}
    for r in built.alerts:
        by_kind[r.kind] += r.jobs
    assert by_kind.get("gpu_oom", 0) > 0
    totals = built.totals()
    assert (totals["gpu_ooms"], totals["ooms"]) == (by_kind["gpu_oom"], by_kind["gpu_oom"] + by_kind.get("host_oom", 0))


def test_jobs_table_is_sized_to_the_terminal(tmp_path: Path) -> None:
    """`slurmgpu jobs` at 80, 120 and 250 columns: as many columns as fit, `user` kept at 80,
    every column once there is room, and no line wider than the terminal."""
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    small_history(url)
    header = ("job", "user", "partition", "state", "GPUs", "elapsed", "peak GiB/GPU", "max util %")
    shown = {}
    for columns in (80, 120, 250):
        res = CliRunner(env={"COLUMNS": str(columns)}).invoke(main, ["--db", url, "jobs"])
        assert res.exit_code == 0, res.output
        assert max(len(line) for line in res.output.splitlines()) <= columns, res.output
        head = next(line for line in res.output.splitlines() if line.startswith("┃"))
        shown[columns] = [h for h in header if f" {h} " in head]
        assert ("--wide shows them all" in res.output) == (len(shown[columns]) < len(header))
    assert "user" in shown[80] and 5 <= len(shown[80]) < len(header)
    assert shown[120] == shown[250] == list(header)


def test_the_installed_models_held_out_figures_are_shown_as_evaluated(tmp_path: Path) -> None:
    """The registry's active version, with the figures it was installed with (``train``'s held-out
    evaluation, the decider replayed beside the datasheet's and the users' picks), in JSON and table;
    a version trained later but kept out by the gate is not the one shown."""
    from test_models import history
    from test_serve import quick_bundle

    from slurmgpu.learning import evaluation, registry, train
    from slurmgpu.pipeline.config import load_config

    config = load_config(SAMPLE_CONFIG)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    small_history(url)
    engine = db.make_engine(url)
    assert json.loads(run_report(url, "--format", "json").output)["model"] is None
    train_rows, test_rows = train.split_by_time(history(600), 5)
    bundle = train.fit(train_rows, config, iterations=60)[0]
    figures = registry.metrics(bundle, train_rows, test_rows, config)
    bundle.data["metrics"] = figures
    model_file = str(tmp_path / "model.json")
    installed = registry.register(engine, bundle, model_file, active=True)
    kept_out = quick_bundle(config)
    kept_out.data["metrics"] = {"test_jobs": 1, "memory_under_prediction_rate": 0.5, "memory_jobs": 1}
    registry.register(engine, kept_out, model_file, active=False)

    shown = json.loads(run_report(url, "--format", "json").output)["model"]
    assert (shown["version"], shown["metrics"]) == (installed, json.loads(json.dumps(figures)))
    assert figures["test_jobs"] and figures["decider"]["replayed"] and figures["memory_bound_median_error"] is not None
    table = CliRunner(env={"COLUMNS": "250"}).invoke(main, ["--config", str(SAMPLE_CONFIG), "--db", url, "report",
                                                           *WINDOW])
    assert table.exit_code == 0, table.output
    text = " ".join(table.output.split())
    assert "Installed model on held-out jobs" in text and f"v{installed} (" in text
    assert f"{figures['memory_under_prediction_rate']:.1%} of {figures['memory_jobs']} jobs" in text
    assert f"{figures['memory_bound_median_error']:.1%}" in text
    decided = figures["decider"]
    assert f"{decided['oom_decided']} / {decided['oom_as_asked']}" in text
    for who in evaluation.PICKERS:
        assert (evaluation.picked(decided, who) or "") in text
    page = tmp_path / "r.html"
    assert run_report(url, "--html", str(page)).exit_code == 0
    html = page.read_text()
    assert "Installed model on held-out jobs" in html and evaluation.picked(decided, "model") in html
