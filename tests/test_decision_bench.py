"""The decision benchmark's mechanics (benchmarks/bench_decision.py), on a small instance: the
baselines and the oracle are scored right against the published throughputs, the work is really
hidden from what the decider reads of a script, users ask by habit, out-of-memory runs are in the
history. Nothing here asserts how well the decider does: the benchmark reports that."""

from __future__ import annotations

import csv
import importlib.util
import math
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path

import pytest

from slurmgpu.history import db
from slurmgpu.history.imports import import_history
from slurmgpu.learning import train
from slurmgpu.pipeline.features import script_features

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_decision", ROOT / "benchmarks" / "bench_decision.py")
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def table() -> dict:
    return bench.throughputs()


def _published(model: str, batch: str, gpu: str, gpus: int) -> float:
    """The fixture's row, read independently of the benchmark's reader."""
    with open(ROOT / "tests" / "fixtures" / "published" / "throughput.csv", newline="") as fh:
        return next(float(r["steps_per_s"]) for r in csv.DictReader(fh)
                    if (r["source"], r["model"], r["batch_size"], r["gpu"], r["num_gpus"]) ==
                    ("gavel_sim", model, batch, gpu, str(gpus)))


def _family(fams: list, model: str, batch: str, gpus: int):
    return next(f for f in fams if (f.model, f.batch, f.gpus) == (model, batch, gpus))


def test_oracle_and_datasheet_rule_are_scored_on_the_measurements(table) -> None:
    """Gavel measured the P100 fastest for the recommendation model and the V100 slowest: the
    datasheet rule (V100) scores their ratio, the oracle 1. ResNet-50 at batch 128 (15169 MiB
    published) does not fit a 12 GiB K80: asking for one is an OOM scored 0."""
    fams = bench.families(table)
    rec = _family(fams, "Recommendation", "512", 1)
    p100, v100 = _published("Recommendation", "512", "p100", 1), _published("Recommendation", "512", "v100", 1)
    assert bench.oracle(rec, table) == ("p100", p100)
    assert bench.datasheet_choice(rec) == "v100"
    assert bench.score(rec, ("v100", 1), table) == {"oom": False, "ratio": pytest.approx(v100 / p100)}
    assert bench.score(rec, ("p100", 1), table)["ratio"] == 1.0
    big = _family(fams, "ResNet-50", "128", 1)
    assert big.peak_mib == 15169 and not bench.fits(big, "k80") and bench.fits(big, "v100")
    assert bench.score(big, ("k80", 1), table) == {"oom": True, "ratio": 0.0}
    # Gavel left K80 ResNet-50 batch 128 on 8 GPUs unmeasured: the family stays, it does not fit there.
    assert ("k80", 8) not in table[("ResNet-50", "128")] and _family(fams, "ResNet-50", "128", 8)
    # A count never measured for the job is no score at all, not a guess.
    assert bench.score(_family(fams, "A3C", "", 1), ("v100", 2), table) == {"oom": False, "ratio": None}
    # The oracle is the best measured type at the job's count, among those it fits.
    for fam in fams:
        best = max(table[fam.key][(t, fam.gpus)] for t in bench.TYPES if bench.fits(fam, t))
        assert bench.oracle(fam, table)[1] == best


def test_summary_counts_shares_means_and_ooms() -> None:
    scores = [{"oom": False, "ratio": 1.0}, {"oom": False, "ratio": 0.96}, {"oom": False, "ratio": 0.5},
              {"oom": True, "ratio": 0.0}, {"oom": False, "ratio": None}]
    s = bench.summary(scores, random.Random(0))
    assert (s["jobs"], s["oom"], s["unmeasured"]) == (4, 1, 1)
    assert s["within_5pct"] == 0.5 and s["mean_ratio"] == pytest.approx(2.46 / 4)
    assert s["within_5pct_ci"][0] <= 0.5 <= s["within_5pct_ci"][1]
    assert s["mean_ratio_ci"][0] <= s["mean_ratio"] <= s["mean_ratio_ci"][1]


def _history(table, visible: bool) -> tuple[list, list[dict]]:
    fams = bench.families(table)
    history, _ = bench.workload(5, fams, table, 400, 0)
    return history, bench.accounting(history, table, 5, visible)


def test_work_is_hidden_from_the_features_the_decider_reads(table, tmp_path: Path) -> None:
    """Imported and read back as training reads it (train.history_rows), every run of a job family
    (model, batch, GPUs) has the same script features although its work spans two orders of magnitude; with the work
    visible, the steps feature is the job's own."""
    history, rows = _history(table, visible=False)
    bench.write_csv(tmp_path / "h.csv", rows)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    assert import_history(engine, str(tmp_path / "h.csv"), "bench").jobs.inserted == len(rows)
    assert "peak_gpu_mem_mib" not in rows[0]
    read = train.history_rows(engine)
    assert len(read) == len(rows) and all(r["peak"] is None for r in read)
    steps = {j.job_id: j.steps for j in history}
    fams = {j.job_id: j.family for j in history}
    by_family: dict[object, list] = defaultdict(list)  # the benchmark's family: model, batch, GPUs
    for r in read:
        by_family[fams[_job(r["job_id"], fams)]].append(r)
        assert str(steps[_job(r["job_id"], steps)]) not in r["text"].split()
    spans = []
    for runs in by_family.values():
        assert len({tuple(sorted(r["script"].items())) for r in runs}) == 1
        work = [steps[_job(r["job_id"], steps)] for r in runs]
        if len(work) >= 20:
            spans.append(max(work) / min(work))
    assert spans and statistics.median(spans) > 30
    _, visible = _history(table, visible=True)
    for job, row in zip(history, visible, strict=False):
        if row["job_id"] == job.job_id:
            assert script_features(row["script"])["log_steps"] == pytest.approx(math.log(job.steps))


def _job(row_id: str, jobs: Mapping[str, object]) -> str:
    """The job a history row is a run of (a resubmission after an OOM is the id with a 1 appended)."""
    return row_id if row_id in jobs else row_id[:-1]


def test_users_ask_their_habitual_type_and_oom_runs_are_in_the_history(table) -> None:
    history, rows = _history(table, visible=False)
    asked: dict[str, Counter] = defaultdict(Counter)
    for job in history:
        asked[job.user][job.gpu_type] += 1
    habits = {u: c.most_common(1)[0] for u, c in asked.items()}
    assert sum(n for _, n in habits.values()) / len(history) >= 0.8  # 85% by habit, the rest at random
    assert all(n / sum(asked[u].values()) >= 0.5 for u, (_, n) in habits.items())
    assert len({t for t, _ in habits.values()}) >= 2  # habits differ between users
    fams = {j.job_id: j.family for j in history}
    ooms = [r for r in rows if r["state"] == "OUT_OF_MEMORY"]
    assert ooms
    for r in ooms:  # only where the published peak exceeds the card, then resubmitted where it fits
        assert not bench.fits(fams[r["job_id"]], r["gpu_type"])
        retry = next(x for x in rows if x["job_id"] == r["job_id"] + "1")
        assert bench.fits(fams[r["job_id"]], retry["gpu_type"])
    assert all(bench.fits(fams[_job(r["job_id"], fams)], r["gpu_type"]) for r in rows if r["state"] != "OUT_OF_MEMORY")
    assert {r["state"] for r in rows} >= {"COMPLETED", "FAILED", "OUT_OF_MEMORY"}


def test_a_small_instance_runs_end_to_end(tmp_path: Path) -> None:
    """Import, train, ask the decider, score: every held-out job is scored for every policy, and
    the oracle is the measured best by construction."""
    r = bench.run_seed(2, False, 400, 24, 30, tmp_path / "run")
    table = bench.throughputs()
    history, _ = bench.workload(2, bench.families(table), table, 400, 24)
    # The held-out jobs are in accounting (for evaluate's figures) but never in what was trained on.
    assert r["held_out"] == 24 and r["history_rows"] == len(bench.accounting(history, table, 2, False))
    assert r["evaluate_on_history"]["runtime_mdape"] > 0
    # evaluate does not judge type choices by runtimes that spread with hidden work
    assert r["evaluate_on_history"]["throughput_jobs"] == 0 < r["evaluate_on_history"]["throughput_hidden_work"]
    for name in ("decider", "requests", "datasheet", "oracle"):
        assert r[name]["jobs"] + r[name]["unmeasured"] == 24
    assert r["oracle"]["within_5pct"] == 1.0 and r["oracle"]["mean_ratio"] == 1.0 and r["oracle"]["oom"] == 0
    assert r["datasheet"]["oom"] == 0 and r["datasheet"]["unmeasured"] == 0
    assert "| hidden | 2 |" in bench.table_md([r])
