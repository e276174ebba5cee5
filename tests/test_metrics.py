"""Prometheus metrics: the daemon counts what it answered on its socket, a scrape over HTTP sums every
process's values; the nightly writes a node_exporter textfile. Both are read back with
prometheus_client's own parser."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmgpu.apps import metrics, serve
from slurmgpu.pipeline.bundle import Bundle
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.policy import Candidate, ComponentChange, Decision

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = Path(sys.executable).parent
SCRIPT = "#!/bin/bash\ntrue\n"


def samples(text: str) -> dict[str, Counter[tuple[tuple[str, str], ...]]]:
    """Sample name -> {sorted labels: value}, as prometheus_client parses the exposition."""
    out: dict[str, Counter[tuple[tuple[str, str], ...]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, Counter())[tuple(sorted(s.labels.items()))] += s.value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A 0755 directory the daemon's dropped account can traverse (pytest's tmp_path is 0700)."""
    path = tempfile.mkdtemp(prefix="slurmgpu-metrics-test-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on this TCP port."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    fields = [r.split() for r in rows]
    return [f[1].split(":")[0] for f in fields if f[3] == "0A" and int(f[1].split(":")[1], 16) == port]


def test_serve_counts_what_the_hook_and_gsbatch_asked_and_a_scrape_sums_it(shared_dir: str) -> None:
    sock, store, port = os.path.join(shared_dir, "s.sock"), os.path.join(shared_dir, "metrics"), free_port()
    proc = subprocess.Popen([str(BIN / "slurmgpu"), "--config", str(SAMPLE), "serve", "--socket", sock, "--group", "",
                             "--slurm-user", "", "--run-as", "nobody", "--metrics-port", str(port),
                             "--metrics-dir", store], stderr=subprocess.PIPE, text=True)
    moved = {"script": SCRIPT, "tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small"}
    kept = {"script": SCRIPT, "tres_per_node": "gres:gpu:a100:2", "partition": "gpu"}
    big = {**moved, "script": SCRIPT + "# padding\n" * 1200}  # past INLINE_BYTES: answered in a child process
    plan = {"op": "plan", "config": os.path.realpath(SAMPLE), "script": "#!/bin/bash\n#SBATCH -p gpu-small "
            "--gres=gpu:a100:1\nsrun train.py\n", "script_name": "train.sh", "options": [], "env": {}}
    try:
        deadline = time.monotonic() + 20
        while serve.call(sock, {"op": "health"}) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        replies = [serve.call(sock, {"op": "decide", "job": job}, 5) for job in (moved, moved, moved, kept, kept, big)]
        replies.append(serve.call(sock, {"op": "decide", "job": "not an object"}, 5))
        replies.append(serve.call(sock, plan, 5))
        serve.call(sock, {"op": "health"})  # not a decision: not counted
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            text = page.read().decode()
        listening = _listening(port)
        mode, owner = os.stat(store).st_mode, os.stat(store).st_uid
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    moved_apply = {"partition": "gpu"}
    assert [r["decision"]["apply"] for r in replies[:6]] == [moved_apply] * 3 + [{}] * 2 + [moved_apply]
    assert replies[6] == {"ok": False, "error": "'job' must be an object"}
    assert replies[7]["ok"] and replies[7]["plan"]["decision"]["changes"][0]["partition"] == "gpu"
    got = samples(text)
    decisions = {dict(k)["source"] + " " + dict(k)["outcome"] + " " + dict(k)["reason"]: v
                 for k, v in got["slurmgpu_decisions_total"].items()}
    assert decisions == {"hook changed partition": 4, "hook kept as_asked": 2, "hook error bad_request": 1,
                         "gsbatch changed partition": 1}
    assert got["slurmgpu_moves_total"] == Counter({(("from_type", "v100"), ("to_type", "v100")): 4,
                                                   (("from_type", "a100"), ("to_type", "a100")): 1})
    counts = got["slurmgpu_decision_latency_seconds_count"]
    assert counts == Counter({(("source", "hook"),): 7, (("source", "gsbatch"),): 1})
    assert got["slurmgpu_decision_latency_seconds_sum"][(("source", "hook"),)] > 0
    assert got["slurmgpu_predicted_oom_prevented_total"] == Counter({(): 0})  # rules decisions predict nothing
    assert not any("user" in name for k in got.values() for labels in k for name, _ in labels)
    assert listening == ["0100007F"]  # 127.0.0.1 only
    assert stat.S_IMODE(mode) == 0o700 and owner == pwd.getpwnam("nobody").pw_uid
    assert not os.listdir(store) or all(name.endswith(".db") for name in os.listdir(store))


def test_a_decision_is_reduced_to_bounded_labels_and_its_own_estimates() -> None:
    """A model move from a type predicted to run out of memory: counted as an OOM prevented, with
    the GPU-hours of the two candidates' predictions; a type the config does not name is 'other'."""
    config = load_config(SAMPLE)
    asked = Candidate("t4", 2, False, 20000.0, 7200.0, 0.0)
    chosen = Candidate("a100", 1, True, 20000.0, 1800.0, 60.0)
    decision = Decision((ComponentChange(0, gpu_type="a100", gpus_total=1),), ("model: ...",), decider="model",
                        per_type=(asked, chosen)).to_json()
    seen = metrics.observe("hook", decision, 0.001, "t4", 2, config.gpu_types)
    assert (seen.outcome, seen.reason, seen.decider, seen.move, seen.oom_prevented) == \
        ("changed", "type+count", "model", ("t4", "a100"), True)
    assert seen.gpu_hours_saved == pytest.approx((2 * asked.pred_runtime_s - 1 * chosen.pred_runtime_s) / 3600)
    assert metrics.observe("hook", decision, 0.001, "h200", 2, config.gpu_types).move == ("other", "a100")
    assert metrics.observe("hook", decision, 0.001, "h200", 2, config.gpu_types).gpu_hours_saved is None
    advised = metrics.observe("hook", {**decision, "mode": "advise"}, 0.001, "t4", 2, config.gpu_types)
    assert (advised.outcome, advised.move, advised.gpu_hours_saved) == ("advised", None, None)
    refused = Decision(refusal="no such partition", decider="rules").to_json()
    assert metrics.observe("gsbatch", refused, 0.0, None, None, config.gpu_types)[1:3] == ("refused", "unsatisfiable")


def test_the_metrics_directory_must_be_private(tmp_path: Path) -> None:
    from slurmgpu.pipeline.errors import InputError

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(InputError, match="mode 0700"):
        metrics.prepare_directory(str(loose))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(InputError, match="no symlink"):
        metrics.prepare_directory(str(link))
    private = tmp_path / "private"
    metrics.prepare_directory(str(private))
    (private / "counter_123.db").write_bytes(b"old")
    (private / "keep.txt").write_text("not ours")
    metrics.prepare_directory(str(private))
    assert sorted(os.listdir(private)) == ["keep.txt"] and stat.S_IMODE(private.stat().st_mode) == 0o700


def _nightly_store(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A config on an empty SQLite store and spool of its own (the nightly ingests the live sacct into it)."""
    db, spool = tmp_path / "history.db", tmp_path / "subs"
    spool.mkdir()
    config = tmp_path / "slurmgpu.toml"
    config.write_text(SAMPLE.read_text().replace("sqlite:////var/lib/slurmgpu/slurmgpu.db", f"sqlite:///{db}")
                      .replace("/var/spool/slurmgpu/submissions", str(spool)))
    env = {**os.environ, "SLURMGPU_CONFIG": str(config), "SLURMGPU_MODEL": str(tmp_path / "model.json")}
    env.pop("SLURMGPU_DB_URL", None)
    subprocess.run([str(BIN / "slurmgpu"), "db", "upgrade"], env=env, check=True, capture_output=True)
    return config, env


def test_nightly_writes_a_textfile_with_its_outcome_and_the_installed_model(tmp_path: Path) -> None:
    """The nightly on a store with too little history to train fails; its textfile says so, with the
    installed model's version and the figures it was installed with."""
    from test_models import history
    from test_serve import quick_bundle, with_model

    from slurmgpu.learning import registry

    _, env = _nightly_store(tmp_path)
    model_config = with_model(load_config(SAMPLE))
    bundle = quick_bundle(model_config)
    rows = history(200, seed=3)
    bundle.data["metrics"] = registry.metrics(bundle, rows[:150], rows[150:], model_config)
    bundle.save(env["SLURMGPU_MODEL"])
    out = tmp_path / "textfile" / "slurmgpu.prom"
    out.parent.mkdir()
    before = time.time()
    run = subprocess.run([str(BIN / "slurmgpu"), "nightly", "--metrics-textfile", str(out)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "too little history" in run.stderr, run.stdout + run.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o644 and sorted(os.listdir(out.parent)) == ["slurmgpu.prom"]
    got = samples(out.read_text())
    installed = Bundle.load(env["SLURMGPU_MODEL"])
    figures = installed.data["metrics"]
    assert got["slurmgpu_nightly_success"] == Counter({(): 0})
    assert before <= got["slurmgpu_nightly_last_run_timestamp_seconds"][()] <= time.time()
    assert got["slurmgpu_model_info"] == Counter({(("version", installed.digest),): 1})
    assert got["slurmgpu_model_runtime_mdape_ratio"][()] == pytest.approx(figures["runtime_mdape"])
    assert got["slurmgpu_model_replay_jobs"][(("kind", "replayed"),)] == figures["decider"]["replayed"]
    assert got["slurmgpu_model_evaluated_jobs"][(("figure", "memory"),)] == figures["memory_jobs"]
