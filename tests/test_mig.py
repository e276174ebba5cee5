"""MIG slices and shards as GPU types (issue 29 item 3): the config's keys, `config init` from the
cluster's gres, the model decider's move of a light one-GPU job to a slice, `--gpu-mem` met by a
slice, and the live cluster's node of stand-in MIG instances (partition mig) as the oracle."""

from __future__ import annotations

import random
import re
import subprocess
import tomllib
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from test_models import history
from test_modes import scontrol_job

from slurmgpu.apps.config_init import config_text
from slurmgpu.learning import train
from slurmgpu.pipeline.config import load_config, parse_config
from slurmgpu.pipeline.errors import ConfigError
from slurmgpu.pipeline.features import script_features
from slurmgpu.pipeline.gpu_mem import GpuMemAsk, decide_gpu_mem
from slurmgpu.pipeline.hardware import mig_profile
from slurmgpu.pipeline.policy import ModelDecider
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_script
from slurmgpu.slurm.backend import SHARD_ITEM as SHARD
from slurmgpu.slurm.backend import NodeInfo, parse_gres

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = ROOT / ".venv" / "bin"
SLICE, BIG_SLICE = "a100_1g.10gb", "a100_3g.40gb"


def raw_config(**slice_keys: object) -> dict:
    """A small config: an a100 and one slice of it with SLICE_KEYS (None drops a key)."""
    body = {"mig_of": "a100", "compute_fraction": 1 / 7, "memory_gib": 10}
    body.update(slice_keys)
    return {"gpu_types": {"a100": {"memory_gib": 80, "relative_speed": 1.0, "cost": 3.0},
                          SLICE: {k: v for k, v in body.items() if v is not None}},
            "partitions": {"gpu": {"gpu_types": ["a100"], "gpus_per_node": 4},
                           "mig": {"gpu_types": [SLICE], "gpus_per_node": 4}}}


# --- config ---------------------------------------------------------------------------------------

def test_a_slice_takes_its_cards_speed_and_cost_times_its_share() -> None:
    cfg = parse_config(raw_config(shards=2))
    s = cfg.gpu_types[SLICE]
    assert s.is_slice and not cfg.gpu_types["a100"].is_slice and s.shards == 2
    assert s.relative_speed == pytest.approx(1 / 7) and s.cost == pytest.approx(3 / 7)
    own = parse_config(raw_config(relative_speed=0.2, cost=0.5)).gpu_types[SLICE]
    assert (own.relative_speed, own.cost) == (0.2, 0.5)  # the admin's own figures stand


def test_configs_without_mig_keys_load_as_before() -> None:
    cfg = load_config(SAMPLE)
    assert cfg.gpu_types["a100"] == cfg.gpu_types["a100"]._replace(mig_of=None, compute_fraction=1.0, shards=0)
    assert cfg.gpu_types["t4"].relative_speed == 0.15 and cfg.gpu_types["t4"].cost == 0.5
    assert {t.name for t in cfg.gpu_types.values() if t.is_slice} == {SLICE, BIG_SLICE}
    plain = parse_config({"gpu_types": {"x": {"memory_gib": 8}}, "partitions": {}})
    assert (plain.gpu_types["x"].relative_speed, plain.gpu_types["x"].cost) == (1.0, 1.0)


@pytest.mark.parametrize(("keys", "said"), [
    ({"mig_of": "h100"}, f"gpu_types.{SLICE}.mig_of: unknown GPU type 'h100' (not in [gpu_types])"),
    ({"mig_of": SLICE}, f"gpu_types.{SLICE}.mig_of: must name a whole card, but {SLICE} is itself a slice"),
    ({"compute_fraction": None}, f"gpu_types.{SLICE}.compute_fraction: missing"),
    ({"compute_fraction": 1.5}, f"gpu_types.{SLICE}.compute_fraction: must be at most 1, got 1.5"),
    ({"compute_fraction": 0}, f"gpu_types.{SLICE}.compute_fraction: must be > 0, got 0"),
    ({"memory_gib": 96}, f"gpu_types.{SLICE}.memory_gib: 96 GiB is more than the 80 GiB of a100"),
    ({"shards": -1}, f"gpu_types.{SLICE}.shards: must be >= 0, got -1"),
    ({"shards": 1.5}, f"gpu_types.{SLICE}.shards: expected int, got float"),
    ({"mig_of": None}, f"gpu_types.{SLICE}.compute_fraction: only for a MIG slice"),
    ({"relative_speed": 0}, f"gpu_types.{SLICE}.relative_speed: must be > 0, got 0"),
])
def test_each_mig_key_problem_is_one_line_naming_the_key(keys: dict, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw_config(**keys), "site.toml")
    text = str(err.value)
    assert "\n" not in text and said in text and "site.toml" in text, text


def test_config_check_names_the_key_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(SAMPLE.read_text().replace('mig_of = "a100"\ncompute_fraction = 0.143',
                                               'mig_of = "a10"\ncompute_fraction = 0.143', 1))
    res = subprocess.run([str(BIN / "slurmgpu"), "--config", str(path), "config", "check", "--offline"],
                         capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f'gpu_types.{SLICE}.mig_of' in lines[0] and "'a10'" in lines[0], res.stderr


@pytest.mark.parametrize(("name", "card", "share", "gib"), [
    (SLICE, "a100", 1 / 7, 10), ("h100-3g.40gb", "h100", 3 / 7, 40), ("a30_2g.12gb", "a30", 0.5, 12)])
def test_mig_profile_reads_the_name(name: str, card: str, share: float, gib: float) -> None:
    p = mig_profile(name)
    assert p is not None and (p.card, p.memory_gib) == (card, gib) and p.compute_fraction == pytest.approx(share)


@pytest.mark.parametrize("name", ["a100", "a100-80gb", "rtx_a6000", "v100-32gb"])
def test_whole_cards_are_no_slices(name: str) -> None:
    assert mig_profile(name) is None


def test_config_init_writes_slices_and_shards_that_load(tmp_path: Path) -> None:
    nodes = [NodeInfo("g1", ("gpu",), {"a100": 4}, "idle", ("a100-80gb",)),
             NodeInfo("g3", ("mig",), parse_gres("gpu:a100_1g.10gb:4,gpu:h100_3g.40gb:2"), "idle", (),
                      parse_gres("shard:a100_1g.10gb:8,shard:h100_3g.40gb:2", SHARD))]
    text = config_text(nodes, "gpu")
    assert f'[gpu_types."{SLICE}"]' in text and 'mig_of = "a100"' in text and "shards = 2" in text
    assert "# h100: the card the MIG slices below are cut from" in text  # no whole h100 in the cluster
    path = tmp_path / "init.toml"
    path.write_text(text)
    cfg = load_config(path)
    s, h = cfg.gpu_types[SLICE], cfg.gpu_types["h100_3g.40gb"]
    assert s.mig_of == "a100" and s.memory_gib == 10 and s.compute_fraction == pytest.approx(0.143, abs=1e-3)
    assert s.shards == 2 and h.shards == 1 and h.mig_of == "h100" and "h100" in cfg.gpu_types
    assert s.relative_speed == pytest.approx(cfg.gpu_types["a100"].relative_speed * 0.143, abs=2e-3)


# --- the decider ----------------------------------------------------------------------------------

LIGHT = "python infer.py --model bert-base-uncased --batch-size {b} --seq-len 128 --max-steps {s}"


def light_script(gres: str = "gpu:a100:1", extra: str = "") -> str:
    return (f"#!/bin/bash\n#SBATCH --gres={gres}\n#SBATCH -t 2-00:00:00\n{extra}"
            + LIGHT.format(b=8, s=2000) + "\n")


def light_rows(util: float, n: int = 40) -> list[dict]:
    """A light family on one a100 (or v100), with the collector's mean utilisation UTIL."""
    rng = random.Random(3)
    t0 = datetime(2026, 10, 20)
    rows = []
    for i in range(n):
        gtype = "a100" if i % 4 else "v100"
        sf = script_features(light_script(f"gpu:{gtype}:1"))
        rows.append({"job_id": str(9000 + i), "user": "ann", "submit": t0 + timedelta(hours=i), "state": "COMPLETED",
                     "gpu_type": gtype, "gpus": 1, "elapsed": int(1800 * rng.uniform(0.95, 1.05)),
                     "peak": 1400 * rng.uniform(0.97, 1.03), "script": sf,
                     "request": {"gpus_total": 1, "gpu_type": gtype}, "gpu_util": util * rng.uniform(0.6, 1.0)})
    return rows


@pytest.fixture(scope="module")
def config():
    cfg = load_config(SAMPLE)
    return cfg._replace(policy=cfg.policy._replace(decider="model", move_partitions=True))


def _fit(config, util: float):
    rows = sorted(history(500) + light_rows(util), key=lambda r: r["submit"])
    return train.fit(rows, config, iterations=120)[0]


@pytest.fixture(scope="module")
def light(config):
    return _fit(config, 9.0)  # at most 9% busy on an a100: 0.09 of speed 1 fits a 1g slice (0.143)


def decide(bundle, config, text: str):
    request = build_request(parse_script(text.encode(), "job.sh"), [], {}, config.gpu_features())
    return ModelDecider(config, bundle, lambda: {}, "ann", lambda p, c: None).decide(request)


def test_a_light_job_moves_to_the_smallest_slice_with_its_numbers(light, config) -> None:
    d = decide(light, config, light_script())
    assert d.changed, d.reasons
    change = d.changes[0]
    assert (change.gpu_type, change.partition) == (SLICE, "mig"), d.reasons
    why = d.reasons[-1]
    fam = light.history.family(script_features(light_script())["family"])
    util, runs = fam["util:a100"], int(fam["util_runs:a100"])
    row = next(c for c in d.per_type if c.gpu_type == SLICE)
    assert f"1 x {SLICE}" in why and f"peak {row.pred_peak_mem_mib / 1024:.1f} GiB per GPU fits" in why
    assert f"this family's {runs} runs on 1 x a100 (speed 1) kept it at most {util:.0f}% busy" in why, why
    assert f"{SLICE} is a MIG slice (0.143 of a100, speed {config.gpu_types[SLICE].relative_speed:g})" in why
    assert row.pred_runtime_s == next(c for c in d.per_type if c.gpu_type == "a100").pred_runtime_s


def test_a_32_bit_jobs_slice_evidence_shows_the_speeds_of_its_precision(config) -> None:
    """With ``relative_speed_fp32`` given (0.8 for the a100; its slices take their share of it), the
    32-bit light job's reason shows the speeds it was judged by: the fp32 ones."""
    assert script_features(light_script())["precision_bits"] == 32
    fp32 = parse_config(tomllib.loads(SAMPLE.read_text().replace(
        "relative_speed = 1.0\n", "relative_speed = 1.0\nrelative_speed_fp32 = 0.8\n", 1)), "fp32.toml")
    fp32 = fp32._replace(policy=config.policy)
    assert fp32.gpu_types[SLICE].speed(32) == pytest.approx(0.8 / 7, rel=0.01)
    d = decide(_fit(fp32, 9.0), fp32, light_script())
    assert d.changed and d.changes[0].gpu_type == SLICE, d.reasons
    assert f"(0.143 of a100, speed {fp32.gpu_types[SLICE].speed(32):g})" in d.reasons[-1], d.reasons
    assert "on 1 x a100 (speed 0.8)" in d.reasons[-1], d.reasons


@pytest.mark.parametrize(("what", "text"), [
    ("two GPUs", light_script("gpu:a100:2")),
    ("NCCL", light_script(extra="export NCCL_DEBUG=INFO\n")),
    ("torchrun with two processes", light_script().replace("python infer.py", "torchrun --nproc_per_node=2 infer.py")),
])
def test_a_multi_gpu_or_distributed_job_is_never_moved_to_a_slice(light, config, what: str, text: str) -> None:
    d = decide(light, config, text)
    assert not any(c.gpu_type and config.gpu_types[c.gpu_type].is_slice for c in d.changes), (what, d.reasons)
    assert not any(config.gpu_types[c.gpu_type].is_slice for c in d.per_type), what  # never even weighed


def test_fastest_never_moves_to_a_slice(light, config) -> None:
    fastest = config._replace(policy=config.policy._replace(objective="fastest"))
    d = decide(light, fastest, light_script())
    assert not any(config.gpu_types[c.gpu_type].is_slice for c in d.per_type), d.reasons


def test_without_utilisation_evidence_no_slice(config) -> None:
    busy = _fit(config, 60.0)  # 60% busy on an a100: more than a 3g slice's 0.429
    d = decide(busy, config, light_script())
    assert not any(config.gpu_types[c.gpu_type].is_slice for c in d.per_type), d.reasons
    fam = busy.history.family(script_features(light_script())["family"])
    assert fam["util:a100"] > 0.429 * 100  # the evidence was there, and said no


def test_gpu_mem_may_be_met_by_a_slice_but_never_for_several_gpus(config) -> None:
    cfg = config._replace(policy=config.policy._replace(decider="rules"))
    from slurmgpu.pipeline.policy import make_decider

    ask = GpuMemAsk(8.0, "8G", "command line")
    one = build_request(parse_script(b"#!/bin/bash\n#SBATCH -p mig\n#SBATCH --gres=gpu:1\nhostname\n", "j.sh"),
                        [], {}, cfg.gpu_features())
    d = decide_gpu_mem(make_decider(cfg), one, ask)
    assert d.changes and d.changes[0].gpu_type == SLICE, d
    two = build_request(parse_script(b"#!/bin/bash\n#SBATCH -p mig\n#SBATCH --gres=gpu:2\nhostname\n", "j.sh"),
                        [], {}, cfg.gpu_features())
    d = decide_gpu_mem(make_decider(cfg), two, ask)
    assert d.refusal is not None or not cfg.gpu_types[d.changes[0].gpu_type or "a100"].is_slice, d


# --- live: the local cluster's partition mig --------------------------------------------------------

def _slurm_up() -> bool:
    try:
        return "mig" in subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                                       timeout=10, check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def live_site(tmp_path: Path, light) -> dict[str, str]:
    """gsbatch's environment: the sample config with the model decider and moves between partitions."""
    if not _slurm_up():
        pytest.skip("the local Slurm cluster with partition mig is not up (contrib/local-slurm/cluster.sh up)")
    model = tmp_path / "model.json"
    light.save(str(model))
    cfg = tmp_path / "slurmgpu.toml"
    cfg.write_text(SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"')
                   .replace("move_partitions = false", "move_partitions = true"))
    (tmp_path / "spool").mkdir()
    return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SLURMGPU_CONFIG": str(cfg),
            "SLURMGPU_MODEL": str(model), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path),
            "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool"), "SLURMGPU_SOCKET": str(tmp_path / "none.sock")}


def gsbatch(tmp_path: Path, env: dict[str, str], text: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.sh").write_text(text)
    return subprocess.run(["gsbatch", "--hold", "--parsable", "-J", "mig-test", "job.sh"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120, check=False)


@pytest.mark.slurm
def test_live_a_light_job_is_submitted_to_a_slice(tmp_path: Path, live_site, submitted: list[str]) -> None:
    res = gsbatch(tmp_path, live_site, light_script())
    assert res.returncode == 0, res.stderr
    submitted.append(res.stdout.strip().split(";")[0])
    info = scontrol_job(submitted[-1])
    assert re.fullmatch(rf"(?:gres[:/])?gpu:{re.escape(SLICE)}:1", info.get("TresPerNode", "")), info
    assert info["Partition"] == "mig" and SLICE in res.stderr, res.stderr


@pytest.mark.slurm
def test_live_a_two_gpu_job_stays_on_whole_cards(tmp_path: Path, live_site, submitted: list[str]) -> None:
    res = gsbatch(tmp_path, live_site, light_script("gpu:a100:2"))
    assert res.returncode == 0, res.stderr
    submitted.append(res.stdout.strip().split(";")[0])
    info = scontrol_job(submitted[-1])
    assert info["Partition"] != "mig" and "g." not in info.get("TresPerNode", ""), info
