"""Only candidates the live cluster can start (issue 26, item 4), and no decision shows inf or nan.

A config may name GPU types the cluster's nodes lack, or more GPUs per node than any node holds.
Measured before: ``slurmgpu predict`` moved 8 x v100 jobs elsewhere "predicted to finish in inf min
vs inf min as asked (nan% sooner)". The node view (pipeline/capacity.py) keeps such shapes out of
the candidates, an ask no node set can start is kept saying why, and a row without finite figures
is never compared.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmgpu.pipeline.bundle import Prediction
from slurmgpu.pipeline.capacity import Capacity, Need, NodeGpus, need_of, node_up
from slurmgpu.pipeline.config import Config, GpuType, Partition, load_config
from slurmgpu.pipeline.gpu_mem import GpuMemAsk, decide_gpu_mem
from slurmgpu.pipeline.policy import Decision, ModelDecider, RuleDecider
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_script

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
# The local cluster's layout (contrib/local-slurm/cluster.sh): gpu1 in gpu and debug, gpu2 in gpu-small and debug.
LOCAL = Capacity([NodeGpus(("gpu", "debug"), {"a100": 4, "v100": 4}, True),
                  NodeGpus(("gpu-small", "debug"), {"t4": 4}, True),
                  NodeGpus(("mig",), {"a100_1g.10gb": 4, "a100_3g.40gb": 2}, True)])


def request(text: str, *options: str, config: Config | None = None):
    config = config or load_config(SAMPLE)
    return build_request(parse_script(text.encode(), "job.sh"), list(options), {}, config.gpu_features())


def job(gres: str = "") -> str:
    return "#!/bin/bash\n" + (f"#SBATCH --gres={gres}\n" if gres else "") + "#SBATCH -t 12:00:00\npython x.py\n"


# --- the node view ----------------------------------------------------------------------------


@pytest.mark.parametrize(("partition", "gpu_type", "need", "why"), [
    ("gpu", "v100", Need(4, 4), None),
    ("gpu", "v100", Need(8, 8), "no node in partition gpu has 8 x v100 (most: 4)"),
    ("gpu", "k80", Need(1, 1), "no node in partition gpu has a k80 GPU"),
    ("gpu", None, Need(8, 8), None),  # untyped: Slurm mixes a node's types
    ("gpu", "v100", Need(8, 4, 2), "1 node(s) in partition gpu have 4 x v100, not the 2 asked"),
    ("debug", None, Need(12, None), None),  # a per-job count spreads over nodes
    ("debug", "t4", Need(8, None), "partition debug has 4 x t4 in all, not 8"),
    ("gpu", "v100", Need(8, None, 1, 8), "no node in partition gpu has 8 x v100 (most: 4)"),  # a task's GPUs
    ("nowhere", "v100", Need(1, 1), None),  # no node view of it: left to Slurm
])
def test_what_the_local_layout_can_start(partition: str, gpu_type: str | None, need: Need, why: str | None) -> None:
    assert LOCAL.why_not(partition, gpu_type, need) == why


def test_down_drained_and_silent_nodes_start_nothing() -> None:
    assert [node_up(s) for s in ("idle", "mixed", "allocated", "down", "drained", "draining", "idle*", "fail")] \
        == [True, True, True, False, False, False, False, False]
    down = Capacity([NodeGpus(("gpu",), {"v100": 4}, False)])
    assert down.why_not("gpu", "v100", Need(2, 2)) == \
        "the nodes in partition gpu with 2 x v100 are down, drained or not responding"
    assert down.why_not("gpu", "v100", Need(2, None)) == \
        "partition gpu has 2 x v100 only on nodes that are down, drained or not responding"
    assert Capacity.from_json(json.loads(json.dumps(LOCAL.to_json()))).nodes == LOCAL.nodes
    with pytest.raises((ValueError, TypeError)):
        Capacity.from_json([["gpu", {}, "yes"]])


@pytest.mark.parametrize(("options", "total", "need"), [
    (["--gres=gpu:v100:8"], 8, Need(8, 8)),
    (["--gres=gpu:v100:4"], 2, Need(2, 2)),
    (["-N2", "--gres=gpu:v100:4"], 8, Need(8, 4, 2)),
    (["--gpus=v100:8"], 8, Need(8, None)),
    (["-N2", "--gpus=v100:8"], 8, Need(8, None, 2)),
    (["--ntasks=2", "--gpus-per-task=v100:4"], 8, Need(8, None, 1, 4)),
])
def test_where_slurm_puts_a_count(options: list[str], total: int, need: Need) -> None:
    assert need_of(request(job(), *options).main, total) == need


# --- the deciders -----------------------------------------------------------------------------


def with_k80(config: Config, speed: float = 2.0, per_node: int = 8) -> Config:
    """The sample config with a fast, large, cheap k80 in partition gpu, which the cluster lacks, and
    more GPUs per node there than its node holds."""
    k80 = GpuType("k80", 80, speed, 0.2, ("k80",))
    return config._replace(gpu_types={**config.gpu_types, "k80": k80}, partitions={
        **config.partitions, "gpu": config.partitions["gpu"]._replace(gpu_types=("a100", "v100", "k80"),
                                                                      gpus_per_node=per_node)})


def test_the_rules_keep_an_ask_no_node_can_start_and_say_why() -> None:
    config = with_k80(load_config(SAMPLE))
    eight = request(job("gpu:v100:8"), config=config)
    assert RuleDecider(config).decide(eight).reasons == ("the request fits the partition it asks for",)
    kept = RuleDecider(config, capacity=LOCAL).decide(eight)
    assert not kept.changed and kept.refusal is None
    assert kept.reasons == ("kept as asked: no node in partition gpu has 8 x v100 (most: 4)",)
    # a type the asked partition lacks moves only where a node holds it
    sample = load_config(SAMPLE)
    t4 = request(job("gpu:t4:1"), config=sample)
    assert RuleDecider(sample, capacity=LOCAL).decide(t4).changes[0].partition == "gpu-small"
    down = Capacity([n._replace(up="t4" not in n.gpus) for n in LOCAL.nodes])
    stays = RuleDecider(sample, capacity=down).decide(t4)
    assert not stays.changed and stays.reasons == (
        "GPU type t4 is not in partition gpu, and no partition offering it admits the job and can start it (the "
        "nodes in partition gpu-small with 1 x t4 are down, drained or not responding); request kept",)


def test_gpu_mem_picks_a_type_the_nodes_hold() -> None:
    """--gpu-mem 60 GiB: the config's k80 (80 GiB, cheapest work) wins on paper; no node has one."""
    config = with_k80(load_config(SAMPLE))
    ask = GpuMemAsk(60.0, "60G", "command line")
    one = request(job("gpu:v100:1"), config=config)
    assert decide_gpu_mem(RuleDecider(config), one, ask).changes[0].gpu_type == "k80"
    seen = decide_gpu_mem(RuleDecider(config, capacity=LOCAL), one, ask)
    assert seen.changes[0].gpu_type == "a100" and seen.changes[0].partition is None, seen.reasons
    none = Capacity([n._replace(gpus={"v100": 4}) if "gpu" in n.partitions else n for n in LOCAL.nodes])
    refused = decide_gpu_mem(RuleDecider(config, capacity=none), one, ask)
    assert refused.refusal == ("command line: --gpu-mem 60 GiB: partition gpu has no GPU type with that much "
                               "memory its nodes can start for this request, nor does any other configured partition")


@pytest.fixture(scope="module")
def bundle() -> Any:
    from test_models import history

    from slurmgpu.learning import train

    config = load_config(SAMPLE)
    return train.fit(history(600), config._replace(policy=config.policy._replace(decider="model")),
                     iterations=60)[0]


def model_config(objective: str = "fastest") -> Config:
    config = with_k80(load_config(SAMPLE))
    return config._replace(policy=config.policy._replace(decider="model", objective=objective))


def test_a_type_no_node_holds_is_no_candidate(bundle: Any) -> None:
    """Idle-GPU ranking (no queue view): the config's fast k80 wins on paper; the node view rules it out."""
    from test_models import script_for

    config = model_config()
    text = script_for("resnet", 16, 1000, "v100")
    free = {"a100": 4, "v100": 4, "k80": 8}
    blind = ModelDecider(config, bundle, lambda: free, "ann").decide(request(text, config=config))
    assert blind.changes and blind.changes[0].gpu_type == "k80", blind.reasons  # what the issue saw
    seeing = ModelDecider(config, bundle, lambda: free, "ann", capacity=LOCAL).decide(request(text, config=config))
    assert "k80" not in {c.gpu_type for c in seeing.per_type}
    assert seeing.changes and seeing.changes[0].gpu_type == "a100", seeing.reasons
    eight = ModelDecider(config, bundle, lambda: free, "ann", capacity=LOCAL).decide(
        request(text.replace("gpu:v100:1", "gpu:v100:8"), config=config))
    assert not eight.changed and eight.decider == "model"
    assert eight.reasons == ("kept as asked: no node in partition gpu has 8 x v100 (most: 4)",)
    # unstartable where asked, but the rules move it where a node holds it: the model decides there
    moved = ModelDecider(config, bundle, lambda: free, "ann", capacity=LOCAL).decide(
        request(text.replace("gpu:v100:1", "gpu:a100:1"), "-p", "gpu-small", config=config))
    assert moved.changes[0].partition == "gpu" and moved.per_type, moved.reasons


def test_an_ask_the_queue_sees_no_start_for_is_kept_without_inf(bundle: Any) -> None:
    """The measured failure, without a node view: every wait infinite made every score nan."""
    from test_models import script_for

    config = model_config()
    text = script_for("resnet", 16, 1000, "v100").replace("gpu:v100:1", "gpu:v100:8")
    d = ModelDecider(config, bundle, lambda: {}, "ann", wait=lambda t, n: math.inf).decide(request(text, config=config))
    assert not d.changed and d.per_type == ()
    assert d.reasons[-1] == ("model: the queue view sees no time 8 x v100 starts (no node holds that many, or jobs "
                             "without a time limit hold them); request kept")


# --- no inf, no nan, whatever the figures ---------------------------------------------------------

FIGURE = st.one_of(st.sampled_from([0.0, math.inf, math.nan, 1e300, 1e12, -1.0]),
                   st.floats(min_value=1.0, max_value=1e6))
TOKEN = re.compile(r"(?<![A-Za-z])(inf|infinity|nan)(?![A-Za-z])", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", re.IGNORECASE)


class Scripted:
    """A trained bundle's history with the predictions a test draws, one per row in turn."""

    memory_source = "telemetry"

    def __init__(self, real: Any, figures: list[tuple[float, float, float]], spread: float) -> None:
        self.history, self.figures, self.runtime_spread, self.calls = real.history, figures, spread, 0

    def predict_many(self, rows: list[Any], script: Any) -> list[Prediction]:
        out = []
        for _ in rows:
            peak, runtime, upper = self.figures[self.calls % len(self.figures)]
            self.calls += 1
            out.append(Prediction(peak, runtime, upper))
        return out

    def predict(self, f: Any, script: Any) -> Prediction:
        return self.predict_many([f], script)[0]

    def peak_mib(self, f: Any, script: Any) -> float:
        return self.predict(f, script).peak_mem_mib

    def peak_estimate_mib(self, f: Any, script: Any) -> float:
        """The drawn peak: no margin under it (the rule that reads it may still be reached)."""
        return self.peak_mib(f, script)


def assert_shown_finite(decision: Decision) -> None:
    for line in (*decision.reasons, decision.refusal or "", decision.unrunnable or ""):
        assert not TOKEN.search(line), line
        assert all(math.isfinite(float(n)) for n in NUMBER.findall(line)), line
    json.dumps(decision.to_json(), allow_nan=False)  # per_type too: predict --json prints it


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(figures=st.lists(st.tuples(FIGURE, FIGURE, FIGURE), min_size=1, max_size=6),
       waits=st.lists(FIGURE, min_size=1, max_size=4), spread=st.sampled_from([0.0, 0.3, math.inf]),
       objective=st.sampled_from(["fastest", "cheapest", "balanced"]), min_gain=st.sampled_from([0.0, 0.1, 0.5]),
       speeds=st.lists(st.sampled_from([0.0, 0.15, 0.45, 1.0, 2.0, 1e9]), min_size=3, max_size=3),
       costs=st.lists(st.sampled_from([0.0, 0.5, 3.0, 1e300]), min_size=3, max_size=3),
       per_node=st.integers(1, 8), asked=st.integers(1, 8), asked_type=st.sampled_from(["a100", "v100", "k80"]),
       family=st.sampled_from(["resnet", "llama", "new"]), limit=st.sampled_from(["", "#SBATCH -t 1\n"]),
       with_capacity=st.booleans(), with_queue=st.booleans())
def test_no_decision_shows_inf_or_nan(bundle: Any, figures: list[tuple[float, float, float]], waits: list[float],
                                      spread: float, objective: str, min_gain: float, speeds: list[float],
                                      costs: list[float], per_node: int, asked: int, asked_type: str, family: str,
                                      limit: str, with_capacity: bool, with_queue: bool) -> None:
    from test_models import script_for

    base = model_config(objective)
    types = {n: base.gpu_types[n]._replace(relative_speed=s, cost=c)
             for n, s, c in zip(("a100", "v100", "k80"), speeds, costs, strict=True)}
    config = base._replace(gpu_types={**base.gpu_types, **types},
                           partitions={**base.partitions, "gpu": Partition("gpu", ("a100", "v100", "k80"), per_node,
                                                                           default=True)},
                           policy=base.policy._replace(min_gain=min_gain))
    text = script_for("resnet" if family == "new" else family, 16, 1000, asked_type) \
        .replace("gpu:" + asked_type + ":1", f"gpu:{asked_type}:{asked}").replace("#SBATCH -t 12:00:00\n", limit)
    if family == "new":
        text = text.replace("train.py", "never_seen.py")
    turn = iter(range(10**9))
    wait = (lambda t, n: waits[next(turn) % len(waits)]) if with_queue else None
    decider = ModelDecider(config, Scripted(bundle, figures, spread), lambda: {"a100": 4, "v100": 2}, "ann",
                           wait=wait, capacity=LOCAL if with_capacity else None)
    decision = decider.decide(request(text, config=config))
    assert_shown_finite(decision)
    for change in decision.changes:  # a move is to a row with figures
        shape = (change.gpu_type or asked_type, change.gpus_total or asked)
        assert any((c.gpu_type, c.gpus) == shape for c in decision.per_type)


# --- against the live cluster -----------------------------------------------------------------


def k80_toml(tmp_path: Path) -> Path:
    """The sample config file with a k80 type in partition gpu (its node has none) and 8 GPUs per node
    there (its node holds 4 of each type), the model decider choosing the fastest."""
    text = SAMPLE.read_text().replace('decider = "rules"', 'decider = "model"') \
        .replace('objective = "balanced"', 'objective = "fastest"')
    text = re.sub(r'(\[partitions\.gpu\]\ngpu_types = )\["a100", "v100"\]\ngpus_per_node = 4',
                  r'\1["a100", "v100", "k80"]\ngpus_per_node = 8', text)
    assert '"k80"' in text
    path = tmp_path / "slurmgpu.toml"
    path.write_text(text + '\n[gpu_types.k80]\nmemory_gib = 80\nrelative_speed = 2.0\ncost = 0.2\nfeatures = ["k80"]\n')
    return path


def slurm_places(*options: str) -> subprocess.CompletedProcess[str]:
    """Slurm's own answer on whether it can place the job (nothing is submitted)."""
    return subprocess.run(["sbatch", "--test-only", *options, "--wrap", "true"], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.slurm
def test_live_candidates_are_startable_and_the_unstartable_ask_is_kept(bundle: Any, tmp_path: Path,
                                                                       submitted: list[str]) -> None:
    """Slurm is the oracle: ``sbatch --test-only`` places what predict and gsbatch choose and refuses
    ("Requested node configuration is not available") the k80 the config names and 8 x v100 per
    node; gsbatch submits (held) the chosen shape, and the unstartable ask as written."""
    from test_models import script_for

    model = tmp_path / "model.json"
    bundle.save(str(model))
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(k80_toml(tmp_path)), "SLURMGPU_MODEL": str(model),
           "XDG_CACHE_HOME": str(tmp_path),
           "HOME": str(tmp_path), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool"),
           "SLURMGPU_SOCKET": str(tmp_path / "no.sock"), "USER": os.environ.get("USER", "root")}
    (tmp_path / "spool").mkdir()
    assert "not available" in slurm_places("-p", "gpu", "--gres=gpu:k80:1").stderr
    assert "not available" in slurm_places("-p", "gpu", "--gres=gpu:v100:8").stderr
    for count, reason in ((2, None), (8, "kept as asked: no node in partition gpu has 8 x v100 (most: 4)")):
        script = tmp_path / f"job{count}.sh"
        script.write_text(script_for("resnet", 16, 1000, "v100").replace("gpu:v100:1", f"gpu:v100:{count}")
                          .replace("#SBATCH -t 12:00:00", "#SBATCH -t 60"))
        out = subprocess.run([str(BIN / "slurmgpu"), "predict", str(script)], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        decided = json.loads(out.stdout)["decision"]
        assert "k80" not in {c["gpu_type"] for c in json.loads(out.stdout)["per_type"]}
        assert not any(TOKEN.search(r) for r in decided["reasons"]), decided
        shape = f"gpu:{decided['gpu_type']}:{decided['gpu_count']}"
        if reason is None:
            assert decided["changed"] and decided["gpu_type"] == "a100", decided
            placed = slurm_places("-p", decided["partition"] or "gpu", f"--gres={shape}")
            assert placed.returncode == 0 and "to start at" in placed.stderr, placed.stderr
        else:
            assert not decided["changed"] and decided["reasons"] == [reason] and shape == "gpu:v100:8"
        sub = subprocess.run([str(BIN / "gsbatch"), "--hold", "--parsable", str(script)], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=120, check=False)
        assert sub.returncode == 0, sub.stderr
        job_id = sub.stdout.strip().split(";")[0]
        submitted.append(job_id)
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                               check=True).stdout
        assert f"TresPerNode=gres:{shape}" in shown, shown


def test_how_likely_a_measured_move_finishes_sooner() -> None:
    """A move the family measured 10% faster: likelier the narrower its runs' spread, never where its
    wait alone outlasts the request; a figure that is no measurement says nothing."""
    from slurmgpu.pipeline.candidates import Candidate, sooner_probability

    asked = Candidate("p100", 1, True, 1000.0, 3600.0, 0.0)

    def move(sd: float | None, wait: float = 0.0) -> Candidate:
        return Candidate("v100", 1, True, 1000.0, 3240.0, wait, ratio_sd=sd)

    wide, narrow = sooner_probability(move(0.5), asked), sooner_probability(move(0.02), asked)
    assert wide is not None and narrow is not None
    assert 0.5 < wide < 0.65 and narrow > 0.99
    assert sooner_probability(move(0.02, wait=3600.0), asked) == 0.0
    assert sooner_probability(move(None), asked) is None
    assert sooner_probability(move(0.0), asked) == 1.0
