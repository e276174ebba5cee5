"""The workload model: catalog, memory and time model, the generator's habits, and its outputs
going through the real parsers and ingest. Expected numbers are worked out by hand from the
formulas and figures in slurmgpu/workload/data.toml."""

from __future__ import annotations

import collections
import filecmp
import math
import os
import re
import statistics
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmgpu.cli.workload import workload_group
from slurmgpu.collector.records import read_record, write_record
from slurmgpu.history import db, ingest
from slurmgpu.history.queries import job_rows
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_script
from slurmgpu.simulation.workload import (
    DEFAULT_CLUSTER,
    LARGE_CLUSTER,
    JobSpec,
    fits,
    generate,
    load_catalog,
    peak_mem_mib,
    runtime_s,
)
from slurmgpu.simulation.workload.emit import emit, sacct_lines, spool_record
from slurmgpu.simulation.workload.perf import run_model
from slurmgpu.simulation.workload.schedule import Outcome, simulate
from slurmgpu.slurm import sacct

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sacct" / "jobs_parsable2.txt"
START = datetime(2026, 11, 2)
CAT = load_catalog()


def _set_zone(monkeypatch, zone: str):
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    sacct._utc_offset.cache_clear()  # the parser caches each hour's offset; a process keeps one zone
    yield
    monkeypatch.undo()
    time.tzset()
    sacct._utc_offset.cache_clear()


@pytest.fixture(autouse=True)
def _utc(monkeypatch):
    yield from _set_zone(monkeypatch, "UTC")


@pytest.fixture(params=["UTC", "Asia/Kolkata"])
def zone(request, monkeypatch):
    """sacct prints local time: the round trip must hold in and outside UTC."""
    yield from _set_zone(monkeypatch, request.param)


def job(family: str, **params) -> JobSpec:
    p = {"lora": False, "lora_r": 0, "zero": 0, "grad_ckpt": False, "steps": 1000, "nproc": 1, "lr": 1e-4,
         "precision": "fp16", "launcher": "python", **params}
    return JobSpec("1", 1, "u", 1001, "a", family, p, START, "A100-80", 1, "gpu", 86400, None, "j", 8, 65536,
                   "", False, False, 0.0)


def llm(**params) -> JobSpec:
    return job("llm_finetune", **{"model": "llama-2-13b", "batch_size": 1, "seq_len": 2048, "precision": "bf16",
                                  **params})


# ---- catalog -------------------------------------------------------------------------------------

def test_catalog_every_number_has_a_source_or_named_assumption() -> None:
    assert set(CAT.gpu_types) == {"K80", "P100", "T4", "V100-16", "V100-32", "A10", "A40", "L40S", "A100-40",
                                  "A100-80", "H100", "H200"}
    for g in CAT.gpu_types.values():
        assert "datasheet" in g.source and g.memory_gib > 0 and g.mem_bw_gbs > 0
        assert 0 < g.fp32_tflops <= g.fp16_tflops and g.nvml_name
    assert CAT.gpu_types["A100-80"][:5] == ("A100-80", 80, 19.5, 312, 2039)
    assert all(m.source for m in CAT.models.values()) and all(o.source for o in CAT.optimizers.values())
    assert all(a.why for a in CAT.assumptions.values())
    assert math.isclose(sum(f.share for f in CAT.families.values()), 1.0)
    text = (ROOT / "slurmgpu" / "simulation" / "workload" / "data.toml").read_text()
    for name in re.findall(r"assumption ([a-z0-9]+_\w+)", text):
        assert name in CAT.assumptions, f"data.toml names an assumption it does not define: {name}"


def test_default_cluster_matches_the_sample_config(sample_config: Path) -> None:
    config = load_config(str(sample_config))
    assert config.site.cluster == DEFAULT_CLUSTER.name
    for part in DEFAULT_CLUSTER.partitions:
        conf = config.partitions[part.name]
        assert [p.gres for p in part.pools] == list(conf.gpu_types)
        assert {p.gpus_per_node for p in part.pools} == {conf.gpus_per_node}
        assert {len(p.hosts) for p in part.pools} == {conf.nodes}
        assert part.default == conf.default
        for pool in part.pools:
            assert CAT.gpu_types[pool.gpu_type].memory_gib == config.gpu_types[pool.gres].memory_gib
    assert set(LARGE_CLUSTER.gpu_types()) == set(CAT.gpu_types)


# ---- memory model --------------------------------------------------------------------------------

def test_memory_by_hand_resnet50() -> None:
    # fp16 SGD-momentum: 25.6M params x (2 + 2 + 8) B + 4 images x 45 MB, 5% allocator slack, 0.75 GiB overhead.
    expected = (25.6e6 * 12 + 4 * 45e6) * 1.05 / 2**20 + 768
    got = peak_mem_mib(job("cnn_train", model="resnet50", batch_size=4, image_size=224), "T4", 1)
    assert got == pytest.approx(expected)


def test_memory_by_hand_llm_lora_with_checkpointing() -> None:
    # 13B LoRA r=16 on q,v: 40 layers x 2 x 16 x 2 x 5120 adapter params at 16 B; frozen 13.02B at 2 B;
    # activations: 40 x 2sh + one layer's 34sh x 0.65 (16-bit) + s x 32000 x 10 B of logits.
    s, h = 2048, 5120
    static = 40 * 2 * 16 * 2 * h * 16 + 13.02e9 * 2
    act = 40 * 2 * s * h + s * h * 34 * 0.65 + s * 32000 * 10
    expected = (static + act) * 1.05 / 2**20 + 768
    assert peak_mem_mib(llm(lora=True, lora_r=16, grad_ckpt=True), "A100-40", 1) == pytest.approx(expected)


@pytest.mark.parametrize("case", [
    job("cnn_train", model="resnet50", image_size=224),
    job("bert_finetune", model="bert-large-uncased", seq_len=512),
    llm(lora=True, lora_r=16),
    job("diffusion_train", model="sd15-unet", image_size=512),
    job("inference", model="vit_b_16", image_size=224),
    job("llm_eval", model="mistral-7b", seq_len=1024, gen_tokens=256),
])
def test_memory_grows_with_batch_size(case: JobSpec) -> None:
    peaks = [peak_mem_mib(case._replace(params={**case.params, "batch_size": b}), "H200", 1) for b in (1, 2, 8, 32)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    # linear in batch size: equal steps for equal increments
    assert peaks[3] - peaks[2] == pytest.approx(4 * (peaks[2] - peaks[1]))


def test_memory_falls_with_lora_zero_and_checkpointing() -> None:
    full = llm(model="llama-2-7b", batch_size=2, nproc=4)
    base = peak_mem_mib(full, "H200", 4)
    for change in ({"lora": True, "lora_r": 16}, {"zero": 1}, {"grad_ckpt": True}):
        assert peak_mem_mib(full._replace(params={**full.params, **change}), "H200", 4) < base, change
    by_stage = [peak_mem_mib(full._replace(params={**full.params, "zero": z}), "H200", 4) for z in (0, 1, 2, 3)]
    assert by_stage == sorted(by_stage, reverse=True) and len(set(by_stage)) == 4
    cnn = job("cnn_train", model="resnet152", batch_size=128, image_size=224)
    assert peak_mem_mib(cnn._replace(params={**cnn.params, "grad_ckpt": True}), "A100-80", 1) < \
        peak_mem_mib(cnn, "A100-80", 1)


def test_13b_full_finetune_fits_no_small_card_but_lora_fits_an_a100_40() -> None:
    full = llm(seq_len=512)
    for gpu in ("T4", "V100-16", "V100-32", "A100-80", "H100"):
        assert not fits(full, gpu, 1), gpu
    assert peak_mem_mib(full, "T4", 1) > 13e9 * 16 / 2**20  # at least ZeRO's 16 bytes per parameter
    assert fits(llm(lora=True, lora_r=16), "A100-40", 1)
    assert fits(llm(lora=True, lora_r=16, grad_ckpt=True), "A100-40", 1)
    assert not fits(llm(lora=True, lora_r=16), "V100-32", 1)
    # ZeRO-3 over 8 GPUs with checkpointing brings the full fine-tune onto 80 GB cards
    assert fits(llm(seq_len=512, zero=3, nproc=8, grad_ckpt=True), "A100-80", 8)


# ---- time model ----------------------------------------------------------------------------------

def test_throughput_ordering() -> None:
    compute = job("cnn_train", model="resnet50", batch_size=256, image_size=224)
    order = ["T4", "V100-32", "A100-80", "H100"]
    times = [runtime_s(compute, g, 1) for g in order]
    assert times == sorted(times, reverse=True)
    bandwidth = job("llm_eval", model="llama-2-7b", batch_size=1, seq_len=256, gen_tokens=256)
    gain_compute = runtime_s(compute, "T4", 1) / runtime_s(compute, "H100", 1)
    gain_bandwidth = runtime_s(bandwidth, "T4", 1) / runtime_s(bandwidth, "H100", 1)
    assert gain_compute > 8 and 1 < gain_bandwidth < gain_compute / 2
    assert runtime_s(bandwidth, "A100-80", 1) / runtime_s(bandwidth, "H100", 1) < 1.5
    # the simulator-bound RL job runs about as fast on a T4 as on an H100
    rl = job("rl", model="nature-cnn", batch_size=512, precision="fp32")
    assert runtime_s(rl, "T4", 1) < 1.3 * runtime_s(rl, "H100", 1)


def test_fp32_uses_tf32_for_convolutions_only_and_bf16_needs_ampere() -> None:
    conv = job("cnn_train", model="resnet50", batch_size=256, image_size=224, precision="fp32")
    assert runtime_s(conv, "A100-80", 1) < runtime_s(conv, "A10", 1)  # TF32 156 vs 62.5 TFLOPS
    matmul = job("bert_finetune", model="bert-large-uncased", batch_size=32, seq_len=128, precision="fp32")
    assert runtime_s(matmul, "A10", 1) < runtime_s(matmul, "A100-80", 1)  # FP32 31.2 vs 19.5 TFLOPS
    bf16 = llm(model="llama-2-7b", lora=True, lora_r=8, batch_size=4, grad_ckpt=True)
    fp16 = bf16._replace(params={**bf16.params, "precision": "fp16"})
    assert runtime_s(bf16, "V100-32", 1) > 5 * runtime_s(fp16, "V100-32", 1)
    assert runtime_s(bf16, "A100-80", 1) == runtime_s(fp16, "A100-80", 1)


def test_data_parallel_scaling_and_idle_extra_gpus() -> None:
    multi = job("cnn_train", model="resnet50", batch_size=128, image_size=224, nproc=4, launcher="torchrun")
    one, four = run_model(multi, "V100-32", 1), run_model(multi, "V100-32", 4)
    assert four.steps * four.step_s == pytest.approx(one.steps * one.step_s / (4 * 0.9**2))
    single = job("cnn_train", model="resnet50", batch_size=128, image_size=224)
    assert runtime_s(single, "V100-32", 4) == runtime_s(single, "V100-32", 1)


# ---- generator -----------------------------------------------------------------------------------

def test_generate_is_reproducible_and_fast() -> None:
    began = time.perf_counter()
    jobs = generate(DEFAULT_CLUSTER, START, 30, seed=3)
    assert time.perf_counter() - began < 5
    assert jobs == generate(DEFAULT_CLUSTER, START, 30, seed=3)
    assert jobs != generate(DEFAULT_CLUSTER, START, 30, seed=4)
    assert 0.6 * 30 * DEFAULT_CLUSTER.jobs_per_day < len(jobs) < 1.5 * 30 * DEFAULT_CLUSTER.jobs_per_day
    assert len(generate(DEFAULT_CLUSTER, START, 10, seed=3, jobs_per_day=30)) == pytest.approx(300, rel=0.3)


def test_jobs_are_consistent_and_scripts_say_what_the_jobs_ask() -> None:
    for cluster in (DEFAULT_CLUSTER, LARGE_CLUSTER):
        jobs = generate(cluster, START, 2, seed=5)
        assert len({j.job_id for j in jobs}) == len(jobs) == len({j.job_id_raw for j in jobs})
        assert [j.submit_time for j in jobs] == sorted(j.submit_time for j in jobs)
        assert all(START <= j.submit_time < START + timedelta(days=2) for j in jobs)
        for j in jobs:
            assert cluster.partition_for(j.req_gpu_type, j.partition).name == j.partition
            assert j.params["nproc"] <= j.req_gpus <= cluster.pool(j.req_gpu_type).gpus_per_node
            request = build_request(parse_script(j.script.encode(), f"{j.job_id}.sh"))
            main = request.main
            assert (request.gpu_type, request.gpus_total, main.partition or j.partition, main.time_limit_s,
                    main.array, main.job_name) == (cluster.gres_name(j.req_gpu_type), j.req_gpus, j.partition,
                                                   j.time_limit_s, j.array, j.job_name), j.script
            assert f"--batch-size {j.params['batch_size']}" in j.script
            assert ("--gradient-checkpointing" in j.script) == j.params["grad_ckpt"]
            assert ("--lora" in j.script) == j.params["lora"]
            if j.params["nproc"] > 1:
                assert re.search(rf"(--nproc_per_node|--num_gpus|--num_processes)={j.params['nproc']} "
                                 r"|--ntasks-per-node=", j.script)
        arrays = collections.defaultdict(list)
        for j in jobs:
            if j.array:
                arrays[j.job_id.split("_")[0]].append(j)
        assert arrays
        for tasks in arrays.values():
            assert len({t.script for t in tasks}) == 1 and [t.array_task for t in tasks] == list(range(len(tasks)))
            assert tasks[-1].job_id_raw == int(tasks[-1].job_id.split("_")[0])  # the last task keeps the array id


def test_habits_match_the_documented_assumptions() -> None:
    a = CAT.value
    runs = [generate(LARGE_CLUSTER, START, 10, seed=seed) for seed in (11, 12, 13)]
    jobs = [j for run in runs for j in run]
    n = len(jobs)
    # programs that drive one GPU: the families' nproc tables weighted by the observed family mix
    # (single jobs: a sweep repeats one draw many times)
    singles = [j for j in jobs if j.array is None]
    share = {f: sum(1 for j in singles if j.family == f) / len(singles) for f in CAT.families}
    expected_single = sum(share[f] * CAT.families[f].nproc.get(1, 0) for f in CAT.families)
    assert sum(j.params["nproc"] == 1 for j in singles) / len(singles) == pytest.approx(expected_single, abs=0.06)
    assert sum(j.req_gpus == 1 for j in jobs) / n > 0.5  # most jobs use one GPU
    over = sum(j.req_gpus > j.params["nproc"] for j in jobs) / n
    assert 0.4 * a("over_ask") < over < 1.6 * a("over_ask")
    flagship = sum(j.req_gpu_type == "A100-80" for j in jobs) / n
    assert flagship > 0.6 * a("asks_biggest")
    per_user = sorted(collections.Counter(j.user for j in runs[0]).values(), reverse=True)
    assert sum(per_user[: len(per_user) // 10]) / len(runs[0]) > 0.35  # heavy-tailed activity
    assert 0.1 < sum(j.array is not None for j in jobs) / n < 0.5
    assert sum(j.fails for j in jobs) / n == pytest.approx(a("fail_rate"), abs=0.015)
    assert sum(j.cancels for j in jobs) / n == pytest.approx(a("cancel_rate") * (1 - a("fail_rate")), abs=0.02)
    oom = sum(not fits(j, j.req_gpu_type, j.req_gpus) for j in jobs) / n
    assert 0 < oom < 0.05
    # reruns: a handful of configurations per user
    configs = collections.Counter((j.user, j.family, j.params["model"]) for j in jobs)
    assert statistics.mean(configs.values()) > 5
    runtimes = sorted(runtime_s(j, j.req_gpu_type, j.req_gpus) for j in jobs)
    median, p90 = runtimes[n // 2], runtimes[9 * n // 10]
    assert 10 * 60 < median < 4 * 3600 and p90 / median > 4  # log-normal: heavy right tail
    timeouts = sum(runtime_s(j, j.req_gpu_type, j.req_gpus) > j.time_limit_s for j in jobs) / n
    assert 0 < timeouts < 0.05


# ---- emitted history -----------------------------------------------------------------------------

def _fields(line: str) -> dict[str, str]:
    parts = sacct.split_fields(line, len(sacct.FIELDS), "|")
    assert parts is not None, line
    return dict(zip(sacct.FIELDS, parts, strict=True))


def _shape(row: dict[str, str]) -> tuple[str, ...]:
    return tuple(f for f in sacct.FIELDS if row[f])


@pytest.fixture(scope="module")
def history() -> tuple[list[JobSpec], dict[str, Outcome]]:
    """~300 jobs on the large cluster, some moved to cards too small or too slow for them."""
    jobs = generate(LARGE_CLUSTER, START, 1, seed=2, jobs_per_day=300)
    outcomes = {}
    for j in jobs:
        if j.family == "llm_finetune" and not j.params["lora"] and len(outcomes) < 3:
            outcomes[j.job_id] = Outcome("T4", 1)  # out of GPU memory
        elif (j.family == "cnn_train" and fits(j, "K80", 1) and runtime_s(j, "K80", 1) > j.time_limit_s
              and not (j.fails or j.cancels) and len(outcomes) < 6):
            outcomes[j.job_id] = Outcome("K80", 1)  # far slower than asked for
    assert len(outcomes) == 6
    return jobs, outcomes


def test_sacct_text_mimics_real_sacct_and_parses_back(history, zone) -> None:
    jobs, outcomes = history
    runs = simulate(jobs, LARGE_CLUSTER, outcomes)
    lines = list(sacct_lines(runs, LARGE_CLUSTER))
    real = [_fields(line) for line in FIXTURE.read_text().splitlines()]
    real_job = _shape(next(r for r in real if r["JobID"] == "1083"))  # finished GPU job
    real_batch = _shape(next(r for r in real if r["JobID"] == "1079.batch"))  # batch step with usage
    kinds = collections.Counter()
    for line in lines:
        row = _fields(line)
        kind = row["JobID"].rpartition(".")[2] if "." in row["JobID"] else "job"
        kinds[kind] += 1
        if kind == "job":
            assert _shape(row) == real_job
            assert re.fullmatch(r"billing=\d+,cpu=\d+,gres/gpu:\w+=\d,gres/gpu=\d,mem=\d+[MG],node=1", row["ReqTRES"])
        elif kind == "batch":
            assert _shape(row) == real_batch
        for f in ("Submit", "Eligible", "Start", "End"):
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", row[f])
        assert re.fullmatch(r"(\d+-)?\d\d:\d\d:\d\d", row["Elapsed"])
    assert kinds["job"] == kinds["batch"] == kinds["extern"] == len(jobs)

    parsed = list(sacct.parse_lines(lines))
    assert not [r for r in parsed if isinstance(r, sacct.RowError)]
    got = {r.values["job_id"]: r.values for r in parsed}
    assert len(got) == len(jobs)
    states = collections.Counter()
    for run in runs:
        v = got[run.job.job_id]
        states[run.state] += 1
        assert (v["state"], v["gpu_type"], v["gpu_count"], v["partition"], v["user"], v["job_id_raw"]) == (
            run.state, LARGE_CLUSTER.gres_name(run.gpu_type), run.gpus, run.partition, run.job.user,
            run.job.job_id_raw)
        assert (v["submit_time"], v["start_time"], v["end_time"], v["elapsed_s"]) == (
            run.job.submit_time, run.start, run.end, run.elapsed_s)
        tasks = run.job.params["nproc"] if run.job.params["launcher"] == "srun" else 1  # MaxRSS: the largest task
        assert v["time_limit_s"] == run.job.time_limit_s
        assert v["max_rss_mb"] == pytest.approx(run.rss_mib / tasks, abs=1)
        if run.state == "CANCELLED":
            assert v["state_detail"] == f"CANCELLED by {run.job.uid}"
        assert (v["exit_code"], v["exit_signal"]) == {"FAILED": (1, 0), "OUT_OF_MEMORY": (0, 125)}.get(
            run.state, (0, 0))
    assert set(states) == {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"}
    for job_id, outcome in outcomes.items():
        run = next(r for r in runs if r.job.job_id == job_id)
        assert run.state == ("FAILED" if outcome.gpu_type == "T4" else "TIMEOUT"), job_id
        if run.state == "TIMEOUT":
            assert run.job.time_limit_s <= run.elapsed_s <= run.job.time_limit_s + 60


def test_spool_records_pass_the_collector_validator(history, tmp_path: Path) -> None:
    jobs, outcomes = history
    runs = simulate(jobs, LARGE_CLUSTER, outcomes)
    for run in runs:
        rec = read_record(write_record(spool_record(run, LARGE_CLUSTER), str(tmp_path)))
        assert (rec.job_id, rec.hostname, rec.source, len(rec.gpus)) == (run.job.job_id, run.host, "synthetic",
                                                                          run.gpus)
        assert rec.start.replace(tzinfo=None) == run.start and rec.end.replace(tzinfo=None) == run.end
        assert [g.index for g in rec.gpus] == list(run.gpu_indices)
        assert rec.peak_gpu_mem_mib == pytest.approx(run.peak_mem_mib)
        busy = [g for g in rec.gpus if g.peak_mem_mib > 0]
        assert len(busy) == run.used_gpus and all(g.peak_mem_mib <= g.memory_total_mib for g in rec.gpus)
        if not fits(run.job, run.gpu_type, run.gpus):  # out of GPU memory: the card was full
            assert run.state == "FAILED" and rec.peak_gpu_mem_mib == CAT.gpu_types[run.gpu_type].memory_mib


def test_emit_is_byte_identical_for_the_same_seed(tmp_path: Path) -> None:
    for out in ("a", "b"):
        emit(str(tmp_path / out), generate(DEFAULT_CLUSTER, START, 3, seed=9), DEFAULT_CLUSTER)
    cmp = filecmp.dircmp(tmp_path / "a", tmp_path / "b")
    assert sorted(cmp.common) == ["sacct.txt", "scripts", "spool"] and not cmp.diff_files
    for sub in ("scripts", "spool"):
        names = sorted(os.listdir(tmp_path / "a" / sub))
        assert names and names == sorted(os.listdir(tmp_path / "b" / sub))
        match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a" / sub, tmp_path / "b" / sub, names, shallow=False)
        assert not mismatch and not errors


def test_end_to_end_through_the_real_ingest(db_url: str, tmp_path: Path, zone) -> None:
    jobs = generate(DEFAULT_CLUSTER, START, 10, seed=4, jobs_per_day=30)
    assert 200 < len(jobs) < 400
    out = emit(str(tmp_path / "wl"), jobs, DEFAULT_CLUSTER)
    engine = db.make_engine(db_url)
    with open(out.sacct_path, encoding="utf-8") as f:
        report = ingest.load_jobs(engine, sacct.parse_lines(f))
    ingest.load_gpu_records(engine, out.spool_dir, report)
    assert (report.inserted, report.errors, report.files_loaded, report.files_rejected) == (
        len(jobs), [], len(jobs), [])
    rows = {r["job_id"]: r for r in job_rows(engine, limit=10_000)}
    assert len(rows) == len(jobs)
    for run in out.runs:
        r = rows[run.job.job_id]
        assert (r["state"], r["gpu_count"], r["gpu_type"], r["elapsed_s"]) == (
            run.state, run.gpus, DEFAULT_CLUSTER.gres_name(run.gpu_type), run.elapsed_s)
        assert r["peak_gpu_mem_mib"] == pytest.approx(run.peak_mem_mib, rel=1e-5)  # MariaDB FLOAT is 32-bit
    again = ingest.load_jobs(engine, sacct.parse_lines(Path(out.sacct_path).read_text().splitlines()))
    assert (again.inserted, again.updated) == (0, 0)


def test_cli_generate(tmp_path: Path) -> None:
    out = tmp_path / "wl"
    result = CliRunner().invoke(workload_group, ["generate", "--out", str(out), "--days", "2", "--seed", "2"])
    assert result.exit_code == 0, result.output
    n = len(os.listdir(out / "scripts"))
    assert n and len(os.listdir(out / "spool")) == n and f"{n} jobs on cluster slurmgpu" in result.output
    assert [line.split("|")[0] for line in (out / "sacct.txt").read_text().splitlines()].count(f"{1000}.batch") == 1
    assert sum(line.split("|")[0].endswith(".batch") for line in (out / "sacct.txt").read_text().splitlines()) == n
    result = CliRunner().invoke(workload_group, ["generate", "--out", str(out), "--days", "2"])
    assert result.exit_code == 1 and "not empty" in result.stderr


# ---- a history a real cluster could produce ---------------------------------------------------------

def _waits_h(runs: list) -> list[float]:
    return sorted((r.start - r.job.submit_time).total_seconds() / 3600 for r in runs)


def _no_gpu_runs_two_jobs(runs: list) -> None:
    """No GPU (host, index) holds two jobs at once."""
    by_gpu: dict[tuple[str, int], list[tuple[datetime, datetime]]] = collections.defaultdict(list)
    for r in runs:
        for index in r.gpu_indices:
            by_gpu[(r.host, index)].append((r.start, r.end))
    for spans in by_gpu.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))


def test_demo_history_is_plausible(tmp_path: Path) -> None:
    """The month `make demo` ingests: nothing ends after the moment it is ingested, queue waits of
    hours (not weeks), runtimes within their limits, no GPU running two jobs at once."""
    from slurmgpu.apps import demo

    hist = demo.generate_history(tmp_path / "history")
    runs = hist.emitted.runs
    assert len(runs) > 0.9 * len(hist.submitted) > 1000
    assert all(j.submit_time < hist.cut <= h.submit_time for j in hist.submitted for h in hist.held_back[:1])
    for r in runs:
        assert r.job.submit_time <= r.start <= r.end <= hist.cut, r.job.job_id
        assert r.elapsed_s <= r.job.time_limit_s + 2 * CAT.value("timeout_overrun_s")
    with open(hist.emitted.sacct_path, encoding="utf-8") as f:
        parsed = [row for row in sacct.parse_lines(f, sacct.FIELDS)]
    assert all(isinstance(row, sacct.JobRecord) for row in parsed) and len(parsed) == len(runs)
    assert max(row.values["end_time"] for row in parsed if isinstance(row, sacct.JobRecord)) <= hist.cut
    assert len(os.listdir(hist.emitted.spool_dir)) == len(runs)  # a collector record per ended job
    waits = _waits_h(runs)
    patience = CAT.value("queue_patience_h")
    assert waits[len(waits) // 2] < patience / 2  # median: hours
    assert waits[int(0.99 * len(waits))] <= 2 * patience and waits[-1] <= 3 * patience  # p99: about a day
    _no_gpu_runs_two_jobs(runs)
    gpus = sum(len(p.hosts) * p.gpus_per_node for part in DEFAULT_CLUSTER.partitions for p in part.pools)
    span_h = (hist.cut - min(j.submit_time for j in hist.submitted)).total_seconds() / 3600
    assert 0.2 < sum(r.gpus * r.elapsed_s for r in runs) / 3600 / (gpus * span_h) < 1.0  # busy, not over capacity


def test_users_hold_back_on_an_overloaded_cluster() -> None:
    """Asked for 25 jobs per GPU a day, users do not queue for weeks: no single job waits longer than
    their patience, fewer jobs are submitted, and GPUs are busy most of the time."""
    days, per_day = 14, 300
    jobs = generate(DEFAULT_CLUSTER, START, days, seed=6, jobs_per_day=per_day)
    assert 0.2 * days * per_day < len(jobs) < 0.9 * days * per_day
    runs = simulate(jobs, DEFAULT_CLUSTER)
    singles = [r for r in runs if r.job.array is None]
    assert max(_waits_h(singles)) <= CAT.value("queue_patience_h") + 1 / 3600  # + the 1 s start latency
    assert _waits_h(runs)[-1] <= 3 * CAT.value("queue_patience_h")  # sweeps are sized to the pool
    _no_gpu_runs_two_jobs(runs)
    a100 = [r for r in runs if r.gpu_type == "A100-80"]
    assert sum(r.gpus * r.elapsed_s for r in a100) / (4 * days * 86400) > 0.6
