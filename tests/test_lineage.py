"""Decision lineage: every decision recorded with its source (gsbatch or the Lua hook's daemon), decider,
model version (Bundle.digest) and script, each script text stored once by sha256 (``job_scripts``).

The store tests run on SQLite, PostgreSQL and MariaDB; the live tests submit through gsbatch and through
the real job_submit.lua inside slurmctld, read real sacct, and ingest what was recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from test_serve import BUSY_A100, SAMPLE, daemon, quick_bundle, with_model
from test_slurm_lua import site  # noqa: F401 - the hook installed in slurmctld (module-scoped fixture)
from test_spool_trust import USER, _spool_dir, accounts, as_user  # noqa: F401 - accounts: a fixture

from slurmgpu.apps import serve, serve_socket
from slurmgpu.apps.serve_records import DecisionRecords
from slurmgpu.history import db, ingest, queries
from slurmgpu.learning import registry
from slurmgpu.pipeline import spool
from slurmgpu.pipeline.bundle import Bundle
from slurmgpu.pipeline.config import load_config
from slurmgpu.slurm.sacct import JobRecord

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLUSTER = "slurmgpu"  # the sample config's (and the local cluster's) name
SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:a100:1\npython train.py --arch resnet50 --batch-size 16\n"
OTHER_SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:t4:1\npython eval.py --arch resnet50 ✓\n"


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def job(job_id: str, user: str = "root", **extra: Any) -> JobRecord:
    values = dict.fromkeys(ingest.JOB_COLUMNS)
    values.update(cluster=CLUSTER, job_id=job_id, state="COMPLETED", gpu_count=1, gpu_type="a100", user=user,
                  submit_time=datetime(2026, 12, 1, 10), end_time=datetime(2026, 12, 1, 11), elapsed_s=3600)
    values.update(extra)
    return JobRecord(ingest.with_decision_id(values), 1)


def record(job_id: str | None, script: str | None = SCRIPT, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(cluster=CLUSTER, job_id=job_id, sbatch_exit=0, features={"script": None},
                                original_request={"gpus_total": 1}, changed=False,
                                decision={"decider": "model", "changed": False, "changes": []},
                                script_sha256=sha(script) if script is not None else None, script_text=script,
                                source="gsbatch", model_version="0123456789ab")
    base.update(fields)
    return spool.new_record(**base)


def stored(url: str, table: Any) -> list[dict[str, Any]]:
    with db.make_engine(url).connect() as conn:
        return [dict(r) for r in conn.execute(select(table)).mappings()]


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


# --- the store: scripts once, submissions linked ------------------------------------------------------


def test_each_script_is_stored_once_and_submissions_carry_source_decider_and_version(
        db_url: str, spool_dir: Path, tmp_path: Path) -> None:
    engine = db.make_engine(db_url)
    bundle = quick_bundle(with_model(load_config(SAMPLE)))
    version = registry.register(engine, bundle, str(tmp_path / "model.json"), active=True)
    digest = Bundle.load(str(tmp_path / "model.json")).digest
    assert registry.version_of(engine, digest)["version"] == version  # type: ignore[index]
    ingest.load_jobs(engine, [job("10"), job("11"), job("12_0", array_job_id=12, array_task_id=0),
                              job("12_1", array_job_id=12, array_task_id=1), job("13", user="someone")])
    for rec in (record("10", model_version=digest), record("11", model_version=digest),
                record("12", OTHER_SCRIPT, decision={"decider": "rules"}, model_version=None),
                record("13", OTHER_SCRIPT), spool.new_record(  # a version-1 record still loads
                    cluster=CLUSTER, job_id=None, script_sha256=None, sbatch_exit=1, features={},
                    original_request=None, decision=None, changed=False) | {"version": 1}):
        for key in ("source", "script_text", "model_version") if rec["version"] == 1 else ():
            del rec[key]
        spool.write_record(str(spool_dir), rec)
    report = ingest.load_submissions(engine, str(spool_dir))
    assert (report.files_loaded, report.files_rejected) == (5, []), report.files_rejected

    scripts = {r["sha256"]: r for r in stored(db_url, db.JobScript.__table__)}
    assert set(scripts) == {sha(SCRIPT), sha(OTHER_SCRIPT)}  # 4 submissions with a script, 2 texts
    assert scripts[sha(OTHER_SCRIPT)]["text"] == OTHER_SCRIPT  # non-ASCII kept exactly
    subs = {r["job_id"]: r for r in stored(db_url, db.Submission.__table__)}
    assert (subs["10"]["source"], subs["10"]["decider"], subs["10"]["model_version"]) == ("gsbatch", "model", digest)
    assert subs["10"]["script_sha256"] == sha(SCRIPT) and subs["10"]["model_version_id"] is not None
    assert (subs["12"]["decider"], subs["12"]["model_version"]) == ("rules", None)
    assert (subs["13"]["model_version"], subs["13"]["model_version_id"]) == ("0123456789ab", None)  # unregistered
    assert (subs[None]["source"], subs[None]["script_sha256"]) == ("gsbatch", None)  # the version-1 record

    # the same script again, in a later run: still one text
    spool.write_record(str(spool_dir), record("11", script=SCRIPT) | {"job_id": "10"})
    assert ingest.load_submissions(engine, str(spool_dir)).files_loaded == 1
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(db.JobScript)).scalar() == 2

    texts = queries.script_texts(engine)
    assert texts == {(CLUSTER, "10"): SCRIPT, (CLUSTER, "11"): SCRIPT, (CLUSTER, "12_0"): OTHER_SCRIPT,
                     (CLUSTER, "12_1"): OTHER_SCRIPT}  # job 13 is someone else's: its record was root's
    rows = queries.decision_rows(engine, model_version=digest[:6])
    assert {r["job_id"] for r in rows} == {"10", "11"} and all(r["registered_version"] == version for r in rows)
    assert rows[0]["state"] == "COMPLETED" and rows[0]["script_stored"]
    assert {r["job_id"] for r in queries.decision_rows(engine, source="lua")} == set()


def test_upgrade_marks_old_submissions_gsbatch_and_digests_registered_bundles(db_url: str, tmp_path: Path) -> None:
    bundle_file = tmp_path / "model-v1.json"
    bundle_file.write_bytes(b'{"some": "bundle bytes"}')
    db.downgrade(db_url, "0002")
    engine = db.make_engine(db_url)
    with engine.begin() as conn:  # the columns 0002 has: the model's newer ones are left out
        conn.execute(db.Submission.__table__.insert(), [{
            "record_id": "r1", "cluster": "c", "user": "u", "submitted_at": datetime(2026, 12, 1, 10), "features": {},
            "original_request": {}, "decision": {}, "changed": False}])
        conn.execute(db.ModelVersion.__table__.insert(), [{
            "name": "slurmgpu", "version": 1, "path": str(bundle_file), "created_at": datetime(2026, 12, 1, 10),
            "features": [], "metrics": {}, "active": True}])
    engine.dispose()
    db.upgrade(db_url)
    assert [r["source"] for r in stored(db_url, db.Submission.__table__)] == ["gsbatch"]
    assert [r["digest"] for r in stored(db_url, db.ModelVersion.__table__)] == [sha(bundle_file.read_bytes())[:12]]


# --- the spool is a trust boundary --------------------------------------------------------------------


def test_hostile_lineage_fields_are_set_aside_each_with_one_line(tmp_path: Path, spool_dir: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    big = "#!/bin/bash\n" + "# padding\n" * (spool.MAX_SCRIPT_BYTES // 10)
    bad = {
        "oversize": record(None, big),
        "wrong-sha": record(None, script_sha256=sha("something else")),
        "text-without-sha": record(None, script_sha256=None),
        "bad-source": record(None, source="slurmctld"),
        "bad-version": record(None, model_version="../../etc"),
        "surrogate": json.loads(json.dumps(record(None)).replace("train.py", "train\\udcff.py")),
        "lua-without-user": record(None, source="lua"),
    }
    for name, rec in bad.items():
        (spool_dir / f"sub-{name}.json").write_text(json.dumps(rec))
    assert len((spool_dir / "sub-oversize.json").read_bytes()) < spool.MAX_RECORD_BYTES  # refused for its text
    report = ingest.load_submissions(engine, str(spool_dir))
    assert report.files_loaded == 0 and report.rejected_kinds == {"malformed": len(bad)}, report.files_rejected
    reasons = {line.split("/sub-")[1].split(".json")[0]: line for line in report.files_rejected}
    expected = {"oversize": f"script_text: {len(big)} bytes, over the {spool.MAX_SCRIPT_BYTES}-byte limit",
                "wrong-sha": "not the record's script_sha256", "text-without-sha": "given without script_sha256",
                "bad-source": "source: expected gsbatch or lua", "bad-version": "model_version: expected string",
                "surrogate": "lone surrogate", "lua-without-user": "user: missing"}
    for name, fragment in expected.items():
        assert fragment in reasons[name] and "\n" not in reasons[name], (name, reasons[name])
    assert {p.name for p in spool_dir.iterdir()} == {f"sub-{n}.json.rejected" for n in bad}


def test_gsbatch_drops_a_text_too_large_for_its_record(tmp_path: Path) -> None:
    """JSON escapes can make a text of MAX_SCRIPT_BYTES larger than a record may be: the record goes
    without its text (the hash stays), never refused by the ingest for its size."""
    escaped = "#!/bin/bash\n" + "\x01" * (spool.MAX_SCRIPT_BYTES - 20)  # each \u0001 is 6 bytes in JSON
    path = spool.write_record(str(tmp_path), record(None, escaped))
    data = json.loads(Path(path).read_bytes())
    assert data["script_text"] is None and data["script_sha256"] == sha(escaped)
    assert spool.script_text(b"#!/bin/bash\n\xff\n") is None  # not UTF-8: no text, the hash only


def test_a_record_is_written_as_its_fields_fitted_one_by_one(tmp_path: Path) -> None:
    """A record small enough whole is dumped once, and reads as the record with each free field
    fitted on its own (``spool.fitted``): small, with a large script, with a field over its limit,
    with too many items, and with a name that is not UTF-8."""
    def each_fitted(rec: dict[str, Any]) -> dict[str, Any]:
        rec = {**rec, **{k: spool.fitted(rec[k]) for k in spool.FREE_FIELDS if k in rec}}
        return json.loads(json.dumps(rec, separators=(",", ":"), sort_keys=True))

    long_reason = "x" * 5000
    cases = [record(None), record(None, "#!/bin/bash\n" + "echo step\n" * 20_000),
             record(None, decision={"decider": "model", "reasons": [long_reason] * 30, "per_type": list(range(300))}),
             record(None, features={"script": None, "job": {f"k{n}": n for n in range(150)}}),
             record(None, features={"script": None, "script_name": "caf\udce9.sh"})]
    for rec in cases:
        assert json.loads(Path(spool.write_record(str(tmp_path), rec)).read_bytes()) == each_fitted(rec)


def _forge_lua_record(directory: str) -> str:
    """An ordinary user poses as the daemon: a "lua" record naming root as the job's user."""
    return os.path.basename(spool.write_record(directory, record(None, source="lua", user="root", uid=0)))


def test_the_daemon_writes_queued_records_with_one_flush_per_batch(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The records the writer found queued are written with one flush of the filesystem (before any is
    renamed into the spool) and one fsync of the directory, so the writer keeps up with the daemon;
    a record that cannot be built is counted and the others are still written."""
    events: list[str] = []
    monkeypatch.setattr(spool, "_syncfs", lambda fd: events.append(f"syncfs {sorted(os.listdir(tmp_path))}") or True)
    monkeypatch.setattr(spool, "sync_dir", lambda d: events.append(f"sync_dir {d}"))
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync"))
    records = DecisionRecords(str(tmp_path), "c", dict)
    batch = [("made", spool.new_record(job_id=str(n))) for n in range(5)]
    records.write([*batch, ("made", {"no": "record id"})])  # that one fails: counted, the others still written
    assert sorted(json.loads(p.read_text())["job_id"] for p in tmp_path.glob("sub-*.json")) == list("01234")
    assert (records.written, records.failed) == (5, 1)
    assert len(events) == 2 and events[1] == f"sync_dir {tmp_path}"
    assert events[0].startswith("syncfs") and "sub-" not in events[0].replace(".sub-", "")  # temp names only


def test_a_burst_of_records_is_written_whole_none_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 records queued at once (3 s of the daemon at 1,000 requests/s) are all written, each a whole
    record the ingest parses, and no temp file is left; only a queue of MAX_QUEUED waiting records drops
    one, and ``health`` reports the count."""
    records = DecisionRecords(str(tmp_path), "c", dict)
    for n in range(3000):
        records.put(("made", record(str(n), source="lua", user="alice", uid=1234)))
    assert records.close(60)
    files = sorted(tmp_path.iterdir())
    assert (records.written, records.dropped, records.failed, len(files)) == (3000, 0, 0, 3000)
    assert {ingest.parse_submission(ingest.open_spool_file(str(f)))["job_id"] for f in files} == \
        {str(n) for n in range(3000)}

    full = DecisionRecords(str(tmp_path / "full"), "c", dict)
    full.MAX_QUEUED = 3
    monkeypatch.setattr(full, "_run", lambda: time.sleep(30))  # a writer that takes nothing: the queue fills
    for n in range(5):
        full.put(("made", spool.new_record(job_id=str(n))))
    assert (full.queued, full.dropped) == (3, 2)
    assert not full.close(0.2) and full.written == 0


def test_the_writer_reads_a_job_sent_again_once_and_each_record_stays_its_own(tmp_path: Path) -> None:
    """A burst of one script (a loop of sbatch) reaches the writer as the same job many times: its
    request is read once, and each record still has its own decision; another job (its name
    alone differs) is read for itself, and the jobs kept are bounded."""
    reads: list[str] = []
    config = load_config(SAMPLE)

    def request_of(job: Mapping[str, Any]) -> Any:
        reads.append(job["name"])
        return serve.job_request(job, config.gpu_features())

    records = DecisionRecords(str(tmp_path), "c", request_of)
    job_a, job_b = hook_job(), {**hook_job(), "name": "other.sh"}
    items = [("build", {"decider": "rules", "id": f"d{n}", "apply": {}}, job_a if n < 5 else job_b,
              ("alice", 1234, "peer")) for n in range(6)]
    records.write(items)
    assert reads == [job_a["name"], "other.sh"] and records.written == 6
    written = {r["decision"]["id"]: r for r in (json.loads(p.read_bytes()) for p in tmp_path.glob("sub-*.json"))}
    assert sorted(written) == [f"d{n}" for n in range(6)]
    assert len({r["record_id"] for r in written.values()}) == 6
    assert written["d0"]["original_request"] == written["d4"]["original_request"] == \
        request_of(job_a).to_json()
    assert written["d5"]["features"]["script_name"] == "other.sh" and written["d0"]["script_sha256"]
    reads.clear()
    bounded = DecisionRecords(str(tmp_path), "c", request_of)
    bounded.READ_ENTRIES = 1  # full: the jobs kept are dropped, not grown
    bounded.write([items[0], items[-1], items[0]])
    assert reads == [job_a["name"], "other.sh", job_a["name"]] and bounded.written == 3


def test_a_batch_falls_back_to_an_fsync_per_file_and_a_failed_file_is_its_own(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where syncfs fails each file is fsync'd before its rename; a file that cannot be written fails
    alone, its temp file removed, and the others are written."""
    fsynced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(spool, "_syncfs", lambda fd: False)
    monkeypatch.setattr(os, "fsync", lambda fd: fsynced.append(fd) or real_fsync(fd))
    (tmp_path / "sub-b.json").mkdir()  # a directory where the second file should go: its rename fails
    files = [(str(tmp_path / f"sub-{n}.json"), f'{{"n": "{n}"}}'.encode()) for n in "abc"]
    results = spool.write_files(str(tmp_path), files, 0o600)
    assert [r is None for r in results] == [True, False, True] and isinstance(results[1], OSError)
    assert len(fsynced) == 4  # three files, then the directory
    assert json.loads((tmp_path / "sub-c.json").read_bytes()) == {"n": "c"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub-a.json", "sub-b.json", "sub-c.json"]


def test_only_the_daemons_account_may_write_the_hooks_records(accounts: None, tmp_path: Path) -> None:  # noqa: F811
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    subs = _spool_dir("sg-lineage-")
    try:
        forged = as_user(USER, _forge_lua_record, subs)
        daemons = os.path.basename(spool.write_record(subs, record(None, source="lua", user="alice", uid=1234)))
        report = ingest.load_submissions(db.make_engine(url), subs)  # run as root: root's records are trusted
        assert report.files_loaded == 1 and report.rejected_kinds == {"forged": 1}, report.files_rejected
        assert f"{forged}: forged: a decision record of the Lua hook's daemon, naming user root, but the file " \
               f"belongs to {USER}" in report.files_rejected[0]
        assert [(r["user"], r["source"]) for r in stored(url, db.Submission.__table__)] == [("alice", "lua")]
        assert sorted(os.listdir(subs)) == [f"{forged}.rejected"] and daemons not in os.listdir(subs)
    finally:
        shutil.rmtree(subs, ignore_errors=True)


# --- the daemon records what it decided for the hook --------------------------------------------------


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lineage-model") / "model.json"
    quick_bundle(with_model(load_config(SAMPLE))).save(str(path))
    return path


def hook_job(**extra: Any) -> dict[str, Any]:
    return {"script": SCRIPT.replace("resnet50 --batch-size 16", "resnet50 --batch-size 16 --image-size 224 "
                                     "--max-steps 1000 --fp16"),
            "tres_per_node": "gres:gpu:a100:1", "user_name": "alice", "user_id": 1234, "name": "train.sh", **extra}


def test_the_daemon_records_the_hooks_decisions_and_the_tag_links_the_job(db_url: str, model_file: Path,
                                                                         spool_dir: Path) -> None:
    service = serve.Service(with_model(load_config(SAMPLE)), str(model_file), free_gpus=lambda: BUSY_A100,
                            record_spool=str(spool_dir))
    slurmctld = serve.Peer(1, 0, 0, trusted=True)
    reply = service.handle(json.dumps({"op": "decide", "job": hook_job()}).encode(), slurmctld)
    decision = reply["decision"]
    digest = Bundle.load(str(model_file)).digest
    assert decision["decider"] == "model" and decision["model_version"] == digest
    assert decision["tag"].startswith(f"slurmgpu:d={decision['id']};m=model")
    user = serve.Peer(2, 4321, 4321, trusted=False)  # a user asking the daemon directly: not the hook
    assert "tag" not in service.handle(json.dumps({"op": "decide", "job": hook_job()}).encode(), user)["decision"]
    assert service.records is not None and service.records.flush() and service.records.written == 1
    (path,) = spool_dir.iterdir()
    rec = json.loads(path.read_bytes())
    assert (rec["source"], rec["user"], rec["uid"], rec["job_id"]) == ("lua", "alice", 1234, None)
    assert rec["script_text"] == hook_job()["script"] and rec["script_sha256"] == sha(hook_job()["script"])
    assert service.health()["records"]["written"] == 1

    engine = db.make_engine(db_url)
    ingest.load_jobs(engine, [job("77", user="alice", admin_comment=decision["tag"], comment="alice's own"),
                              job("78", user="mallory", admin_comment=decision["tag"]),  # not alice's job
                              job("79", user="alice", comment=decision["tag"])])  # a tag alice wrote herself
    report = ingest.load_submissions(engine, str(spool_dir))
    assert report.files_loaded == 1 and report.decisions_linked == 1
    (sub,) = stored(db_url, db.Submission.__table__)
    assert (sub["source"], sub["user"], sub["job_id"], sub["model_version"]) == ("lua", "alice", "77", digest)
    assert queries.script_texts(engine) == {(CLUSTER, "77"): hook_job()["script"]}
    (spool_dir / "sub-again.json").write_text(json.dumps(rec))  # the same record again: linked since, still a copy
    again = ingest.load_submissions(engine, str(spool_dir))
    assert (again.files_duplicate, again.files_rejected) == (1, []) and not list(spool_dir.iterdir())


def test_a_burst_of_one_request_is_decided_once_and_each_job_keeps_its_own_record(
        model_file: Path, spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = serve.Service(with_model(load_config(SAMPLE)), str(model_file), free_gpus=lambda: BUSY_A100,
                            record_spool=str(spool_dir))
    service.free = dict(BUSY_A100)
    slurmctld = serve.Peer(1, 0, 0, trusted=True)
    line = json.dumps({"op": "decide", "job": hook_job()}).encode()
    first, second = (service.handle(line, slurmctld)["decision"] for _ in range(2))
    assert service.reused == 1 and service.health()["reused"] == 1
    assert first["id"] != second["id"] and first["tag"].replace(first["id"], second["id"]) == second["tag"]
    same = {k: v for k, v in first.items() if k not in ("id", "tag")}
    assert same == {k: v for k, v in second.items() if k not in ("id", "tag")} and first["changes"]
    assert service.records is not None and service.records.flush() and service.records.written == 2
    assert sorted(json.loads(p.read_bytes())["decision"]["id"] for p in spool_dir.iterdir()) == \
        sorted([first["id"], second["id"]])
    # Still under the same view some seconds later (the queue is read again every 10 s): reused.
    service.recent = {key: (when - 5.0, *rest) for key, (when, *rest) in service.recent.items()}
    service.handle(line, slurmctld)
    assert service.reused == 2
    # Another user's identical line, another view of the cluster, or an older decision: decided anew.
    service.handle(line.replace(b'"user_id": 1234', b'"user_id": 1235'), slurmctld)
    service.free = {**BUSY_A100, "a100": 4}
    service.handle(line, slurmctld)
    monkeypatch.setattr(serve, "REUSE_S", 0.0)
    service.handle(line, slurmctld)
    assert service.reused == 2


def test_a_line_decided_anew_after_a_refresh_is_not_read_again(model_file: Path, spool_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A refresh of the cluster view makes the line's decision anew (the idle GPUs changed it), from
    the request read the first time; another line is read for itself."""
    reads: list[Mapping[str, Any]] = []
    read = serve.job_request
    monkeypatch.setattr(serve, "job_request", lambda job, features: reads.append(job) or read(job, features))
    service = serve.Service(with_model(load_config(SAMPLE)), str(model_file), free_gpus=lambda: BUSY_A100,
                            record_spool=str(spool_dir))
    service.free = dict(BUSY_A100)
    slurmctld = serve.Peer(1, 0, 0, trusted=True)
    line = json.dumps({"op": "decide", "job": hook_job()}).encode()
    busy = service.handle(line, slurmctld)["decision"]
    service.free = {**BUSY_A100, "a100": 4}  # a refresh: the asked cards are idle now
    idle = service.handle(line, slurmctld)["decision"]
    assert service.reused == 0 and len(reads) == 1 and busy["apply"] != idle["apply"]
    fresh = serve.Service(with_model(load_config(SAMPLE)), str(model_file), free_gpus=lambda: BUSY_A100)
    fresh.free = dict(service.free)
    anew = fresh.handle(line, slurmctld)["decision"]
    assert {k: v for k, v in idle.items() if k not in ("id", "tag")} == anew
    service.handle(json.dumps({"op": "decide", "job": hook_job(name="other.sh")}).encode(), slurmctld)
    assert len(reads) == 3  # the fresh daemon's, and the other line's


def test_a_tag_on_two_jobs_links_neither(tmp_path: Path, spool_dir: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    tag = "slurmgpu:d=aaaaaaaaaaaa;m=model"
    ingest.load_jobs(engine, [job("1", user="alice", admin_comment=tag), job("2", user="alice", admin_comment=tag),
                              job("3_0", user="alice", admin_comment=tag.replace("a", "b"), array_job_id=3),
                              job("3_1", user="alice", admin_comment=tag.replace("a", "b"), array_job_id=3)])
    for decision_id in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        spool.write_record(str(spool_dir), record(None, source="lua", user="alice", uid=1,
                                                  decision={"decider": "model", "id": decision_id}))
    assert ingest.load_submissions(engine, str(spool_dir)).decisions_linked == 1
    assert sorted((r["decision_id"], r["job_id"] or "-") for r in stored(url, db.Submission.__table__)) == [
        ("aaaaaaaaaaaa", "-"), ("bbbbbbbbbbbb", "3")]  # an array's tasks are one job


def test_gsbatch_through_the_daemon_records_the_daemons_model_version(model_file: Path, tmp_path: Path) -> None:
    from test_gsbatch import Recorder
    from test_serve import socket_dir

    from slurmgpu.apps import gsbatch

    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"', 1))
    script = tmp_path / "train.sh"
    script.write_text(hook_job()["script"])
    directory = socket_dir()
    sock = os.path.join(directory, "s.sock")
    records: list[dict[str, Any]] = []
    try:
        for where, socket_path in (("daemon", sock), ("in-process", str(tmp_path / "none.sock"))):
            out = tmp_path / where
            out.mkdir()
            env = {"SLURMGPU_CONFIG": str(config), "SLURMGPU_MODEL": str(model_file), "SLURMGPU_SOCKET": socket_path,
                   "SLURMGPU_SUBMISSION_SPOOL": str(out), "XDG_CACHE_HOME": str(tmp_path / "cache")}
            service = serve.Service(load_config(config), str(model_file), free_gpus=lambda: BUSY_A100,
                                    record_spool=str(tmp_path / "daemon-records"))
            with daemon(sock, service):
                assert gsbatch.main([str(script)], env=env, backend=Recorder()) == 0
            assert service.count == (1 if where == "daemon" else 0)
            (path,) = out.iterdir()
            records.append(json.loads(path.read_bytes()))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert not (tmp_path / "daemon-records").exists()  # a plan is gsbatch's to record, not the daemon's
    digest = Bundle.load(str(model_file)).digest
    for rec in records:
        assert (rec["source"], rec["model_version"], rec["version"]) == ("gsbatch", digest, 2)
        assert rec["script_text"] == script.read_text() and rec["script_sha256"] == sha(script.read_bytes())


# --- the live cluster -------------------------------------------------------------------------------------


def _wait_ended(job_ids: list[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                             capture_output=True, text=True, check=True).stdout
        states = dict(line.split("|")[:2] for line in out.splitlines() if line)
        if len(states) == len(job_ids) and not {"PENDING", "RUNNING", "REQUEUED"} & set(states.values()):
            return
        assert time.monotonic() < deadline, f"jobs {job_ids} did not end: {states}"
        time.sleep(1)


def _ingest_live(url: str, subs: str, since: datetime, job_ids: list[str]) -> ingest.Report:
    """The nightly order: sacct, then the spool. sacct's window (whole seconds) may show a job that has
    just ended a moment late, so the run is repeated until the jobs are in the store (the ingest is
    idempotent; the root-owned records here never wait for their job)."""
    engine = db.make_engine(url)
    deadline = time.monotonic() + 60
    report = ingest.Report()
    while True:
        report = _merge(report, ingest.ingest_sacct(engine, CLUSTER, since=since))
        report = ingest.load_submissions(engine, subs, report)
        with engine.connect() as conn:
            have = set(conn.execute(select(db.Job.job_id).where(db.Job.job_id.in_(job_ids))).scalars())
        if have == set(job_ids):
            return report
        assert time.monotonic() < deadline, f"jobs {sorted(set(job_ids) - have)} not in sacct's window"
        time.sleep(1)


def _merge(before: ingest.Report, sacct_run: ingest.Report) -> ingest.Report:
    """One report over the repeated runs: the spool counts add up, sacct's are the last run's."""
    sacct_run.files_loaded, sacct_run.files_rejected = before.files_loaded, before.files_rejected
    sacct_run.decisions_linked = before.decisions_linked
    return sacct_run


@pytest.mark.slurm
def test_gsbatch_on_the_cluster_stores_the_script_once_with_the_model_version(model_file: Path, tmp_path: Path,
                                                                             submitted: list[str]) -> None:
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"', 1))
    script = tmp_path / "train.sh"
    script.write_bytes(hook_job()["script"].replace("#SBATCH --gres", "#SBATCH -o /dev/null -t 1\n#SBATCH --gres")
                       .encode())
    subs = tmp_path / "spool"
    subs.mkdir()
    # PYTHONPATH: gsbatch runs this checkout's code, whichever checkout the venv was installed from
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "SLURMGPU_CONFIG": str(config), "SLURMGPU_MODEL": str(model_file),
           "SLURMGPU_SUBMISSION_SPOOL": str(subs), "SLURMGPU_SOCKET": str(tmp_path / "no.sock"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    since = db.utcnow() - timedelta(minutes=1)
    for _ in range(2):  # the same script twice
        res = subprocess.run(["gsbatch", "--hold", "--parsable", "--chdir=/tmp", str(script)], capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        submitted.append(res.stdout.strip().split(";")[0])
    infos = [subprocess.run(["scontrol", "-o", "show", "job", j], capture_output=True, text=True,
                            check=True).stdout for j in submitted]
    assert not any("slurmgpu:d=" in i for i in infos), infos  # the Comment is the user's; the record names the job
    subprocess.run(["scontrol", "release", *submitted], check=True)  # held jobs are not in sacct's time window
    _wait_ended(submitted)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    report = _ingest_live(url, str(subs), since, submitted)
    assert report.files_loaded == 2 and not report.files_rejected, report.summary()

    (kept,) = stored(url, db.JobScript.__table__)
    assert kept["sha256"] == sha(script.read_bytes()) and kept["text"].encode() == script.read_bytes()
    digest = Bundle.load(str(model_file)).digest
    subs_rows = stored(url, db.Submission.__table__)
    assert sorted(r["job_id"] for r in subs_rows) == sorted(submitted)
    assert {(r["source"], r["decider"], r["model_version"], r["script_sha256"]) for r in subs_rows} == {
        ("gsbatch", "model", digest, kept["sha256"])}
    engine = db.make_engine(url)
    with engine.connect() as conn:
        for j in submitted:  # the submission record names its job
            got = ingest.decision_of_job(conn, CLUSTER, j)
            assert got and got["job_id"] == j, (j, [(r["job_id"], r["state"], r["user"], r["comment"], r["decision_id"])
                                                    for r in stored(url, db.Job.__table__) if r["job_id"] in submitted],
                                                [(r["job_id"], r["decision_id"]) for r in subs_rows])
    assert queries.script_texts(engine) == {(CLUSTER, j): script.read_text() for j in submitted}


@pytest.mark.slurm
def test_the_real_hook_tags_the_job_and_the_daemons_record_links_to_it(site: Any, tmp_path: Path) -> None:  # noqa: F811
    if shutil.which("lua5.1") is None:
        pytest.skip("lua5.1 not installed")
    subs = tmp_path / "spool"
    subs.mkdir()
    service = serve.Service(site.config, site.model, lambda: BUSY_A100, reload_s=0.2, record_spool=str(subs))
    service.refresh_free()
    since = db.utcnow() - timedelta(minutes=1)
    with daemon(site.socket, service, serve_socket.access_for("slurm", "slurm", None)):
        res = subprocess.run(["sbatch", "--parsable", "--hold", "-p", "debug", "-o", "/dev/null", "-t", "1",
                              "--chdir=/tmp", "--gres=gpu:a100:4", str(site.script)],
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        job_id = res.stdout.strip().split(";")[0]
        site.jobs.append(job_id)
        assert service.records is not None and service.records.flush()
    info = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                          check=True).stdout
    (path,) = subs.iterdir()
    rec = json.loads(path.read_bytes())
    assert f" AdminComment=slurmgpu:d={rec['decision']['id']};m=model" in info, info
    assert (rec["source"], rec["user"], rec["uid"]) == ("lua", "root", 0)
    assert rec["model_version"] == Bundle.load(site.model).digest
    assert rec["script_sha256"] == sha(site.script.read_bytes())  # the hook sent the script as written
    subprocess.run(["scontrol", "release", job_id], check=True)
    _wait_ended([job_id])
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    report = _ingest_live(url, str(subs), since, [job_id])
    assert report.files_loaded == 1 and report.decisions_linked == 1, report.summary()
    (sub,) = stored(url, db.Submission.__table__)
    assert (sub["source"], sub["user"], sub["job_id"], sub["cluster"]) == ("lua", "root", job_id, CLUSTER)
    assert queries.decision_rows(db.make_engine(url), source="lua")[0]["state"] in ("COMPLETED", "FAILED")
    assert pwd.getpwuid(os.geteuid()).pw_name == "root"
