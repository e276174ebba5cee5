"""Scenario evaluation: the small scenario runs all four policies; the oracle is safe and no slower
than the users' requests; the static rule keeps to its own estimate; the report files are well-formed;
the decider falls back to the rules when it cannot be trained; the command line."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmgpu.pipeline.features import script_features
from slurmgpu.pipeline.queue import GpuLedger
from slurmgpu.simulation import scenario, scenario_report
from slurmgpu.simulation.simulator import SimJob
from slurmgpu.simulation.workload import LARGE_CLUSTER, fits, load_catalog

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def evaluation() -> scenario.Evaluation:
    return scenario.evaluate(scenario.SCENARIOS["small"])


@pytest.fixture(scope="module")
def report_dir(evaluation: scenario.Evaluation, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    scenario_report.write_report(evaluation, str(out))
    return out


def test_small_scenario_runs_every_policy(evaluation: scenario.Evaluation) -> None:
    assert [p.name for p in evaluation.policies] == list(scenario.POLICIES)
    assert 1500 <= evaluation.generated <= 2500
    assert evaluation.decider == "model"
    for p in evaluation.policies:
        assert p.summary.jobs == evaluation.evaluated == len(p.placed)
        assert p.summary.gpu_hours > 0 and 0 < p.efficiency.mem_used_share <= 1
    request = evaluation.policies[0]
    jobs = evaluation.jobs
    assert all(request.placed[j.job_id] == (j.req_gpu_type, j.req_gpus) for j in jobs)


def test_the_decider_decides_each_submission_once(evaluation: scenario.Evaluation) -> None:
    """gsbatch decides once per sbatch: an array's tasks share the placement."""
    placed = next(p for p in evaluation.policies if p.name == "slurmgpu").placed
    arrays: dict[str, set] = {}
    for j in evaluation.jobs:
        if "_" in j.job_id:
            arrays.setdefault(j.job_id.partition("_")[0], set()).add(placed[j.job_id])
    assert len(arrays) > 10 and all(len(p) == 1 for p in arrays.values())


def test_oracle_never_runs_out_of_memory_and_is_no_slower(evaluation: scenario.Evaluation) -> None:
    by_name = {p.name: p for p in evaluation.policies}
    oracle, request = by_name["oracle"], by_name["request"]
    jobs = evaluation.jobs
    fittable = [j for j in jobs if scenario.fits_somewhere(j, LARGE_CLUSTER)]
    assert all(fits(j, *oracle.placed[j.job_id]) for j in fittable)
    assert oracle.summary.oom == evaluation.unfittable == len(jobs) - len(fittable)
    assert oracle.summary.mean_jct_s <= request.summary.mean_jct_s


def test_no_policy_gives_a_job_fewer_gpus_than_its_launcher_starts(evaluation: scenario.Evaluation) -> None:
    """torchrun --nproc_per_node=4 on 3 GPUs starts 4 processes on 3 cards: the oracle, which knows
    how many GPUs a job truly uses, is bound by a count the script writes as the decider is."""
    from slurmgpu.pipeline.launch import launch_need

    written = {j.job_id: launch_need(j.script).min_gpus for j in evaluation.jobs}
    assert sum((n or 0) > 1 for n in written.values()) > 50  # the small scenario has such launches
    for p in evaluation.policies:
        assert all(p.placed[j].gpus >= n for j, n in written.items() if n), p.name
    oracle = next(p for p in evaluation.policies if p.name == "oracle")
    fewer = [j for j in evaluation.jobs if oracle.placed[j.job_id].gpus < j.req_gpus]
    assert fewer and any(written[j.job_id] is None for j in fewer)  # it still trims what truly goes unused


def test_static_rule_never_picks_a_card_below_its_estimate(evaluation: scenario.Evaluation) -> None:
    rule = next(p for p in evaluation.policies if p.name == "rule")
    cat = load_catalog()
    biggest = max(cat.gpu_types[t].memory_mib for t in LARGE_CLUSTER.gpu_types())
    for job in evaluation.jobs:
        need = scenario.rule_estimate_mib(job, script_features(job.script))
        gpu_type, gpus = rule.placed[job.job_id]
        assert gpus == job.req_gpus
        if cat.gpu_types[gpu_type].memory_mib < need:  # only when no card holds the estimate: kept as asked
            assert need > biggest and gpu_type == job.req_gpu_type


def test_report_files_are_well_formed(evaluation: scenario.Evaluation, report_dir: Path) -> None:
    data = json.loads((report_dir / "results.json").read_text())
    assert list(data["policies"]) == list(scenario.POLICIES)
    assert data["jobs"]["evaluated"] == evaluation.evaluated and data["decider"] == "model"
    for p in data["policies"].values():
        assert {"mean_jct_s", "p99_wait_s", "makespan_s", "gpu_hours", "mem_used_share", "idle_gpu_hours",
                "oom", "failed"} <= p.keys()
    assert data["gpu_types"]["a100_80g"]["relative_speed"] == 1.0
    md = (report_dir / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(scenario.POLICIES) and all(label in md for label in scenario.POLICIES.values())
    for name in ("jct_cdf.svg", "allocated_gpus.svg"):
        root = ET.parse(report_dir / name).getroot()
        assert root.tag == f"{SVG}svg"
        lines = root.findall(f"{SVG}polyline")
        assert len(lines) == len(scenario.POLICIES)
        for line in lines:
            points = [tuple(map(float, p.split(","))) for p in line.get("points", "").split()]
            assert len(points) > 100 and all(0 <= x <= 760 and 0 <= y <= 420 for x, y in points)
        labels = {t.text for t in root.iter(f"{SVG}text")}
        assert set(scenario.POLICIES.values()) <= labels


def test_decider_falls_back_to_the_rules_without_history() -> None:
    sc = scenario.SCENARIOS["small"]
    from slurmgpu.pipeline.request import build_request
    from slurmgpu.pipeline.script import parse_script
    from slurmgpu.simulation.workload import generate

    jobs = generate(sc.cluster, sc.start, 0.2, 3)
    config = scenario.scenario_config(sc.cluster)
    features = {j.script: script_features(j.script) for j in jobs}
    requests = {j.script: build_request(parse_script(j.script.encode())) for j in jobs}
    messages: list[str] = []
    sim = scenario.Simulation(scenario.sim_cluster(sc.cluster))
    placed, used, note = scenario.model_decisions(jobs[:5], jobs, sc.cluster, config, features, requests, 10,
                                                  messages.append, sim)
    assert used.startswith("rules (fallback: too little history") and note.startswith(used)
    assert any("falling back to the rule decider" in m for m in messages)
    assert all(placed[j.job_id] == (j.req_gpu_type, j.req_gpus) for j in jobs)  # the requests are consistent


def test_scenario_config_derives_speed_and_cost_from_the_catalog() -> None:
    config = scenario.scenario_config(LARGE_CLUSTER)
    types = config.gpu_types
    assert set(types) == {pool.gres for part in LARGE_CLUSTER.partitions for pool in part.pools}
    assert types["a100_80g"].memory_gib == 80 and types["a100_80g"].relative_speed == types["a100_80g"].cost == 1
    assert types["t4"].relative_speed < types["v100_16g"].relative_speed < types["a100_40g"].relative_speed
    assert types["h200"].cost > types["a100_80g"].cost > types["v100_32g"].cost > types["t4"].cost
    assert config.default_partition == "gpu" and config.partitions["gpu-legacy"].gpus_per_node == 8
    assert config.policy.decider == "model"


def test_cli(tmp_path: Path) -> None:
    from slurmgpu.cli.scenario import scenario_cmd

    choices = next(p for p in scenario_cmd.params if p.name == "name").type.choices  # type: ignore[attr-defined]
    assert sorted(choices) == sorted(scenario.SCENARIOS)
    res = CliRunner().invoke(scenario_cmd, ["--scenario", "small", "--jobs", "800", "--seed", "2",
                                            "--report-dir", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("| policy |") and res.stdout.count("\n") == 2 + len(scenario.POLICIES)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "allocated_gpus.svg", "jct_cdf.svg", "results.json", "results.md"]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["scenario"]["seed"] == 2


def test_the_decider_reads_the_simulated_queue_as_squeue() -> None:
    """The scenario's decider waits on the ledger the daemon builds from squeue, here from the
    simulated queue: H100 nodes held by running jobs free at their limits, and pending jobs queue
    behind them; other types stay free."""
    cluster = LARGE_CLUSTER
    h100 = next(p for part in cluster.partitions for p in part.pools if p.gres == "h100")
    sim = scenario.Simulation(scenario.sim_cluster(cluster))
    jobs = [SimJob(f"r{k}", 0.0, "H100", 8, 1000.0, 3600.0, partition="gpu-large") for k in range(len(h100.hosts))]
    jobs += [SimJob(f"p{k}", 50.0, "H100", 8, 1000.0, 7200.0, partition="gpu-large") for k in range(len(h100.hosts))]
    for j in jobs:
        sim.submit(j)
    queue = scenario.squeue(cluster, sim.queue(100.0))
    assert [(q.job_id, q.running, q.seconds) for q in queue][:1] == [("r0", True, 3500.0)]
    assert {n for q in queue if q.running for n in q.nodes} == set(h100.hosts)
    ledger = GpuLedger.from_queue(cluster.slurm_nodes(), queue)
    assert ledger.wait("h100", 8) == 3500.0 + 7200.0 and ledger.wait("h100", 1) == 3500.0 + 7200.0
    assert ledger.wait("h200", 8) == 0.0
