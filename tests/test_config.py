"""The admin config: strict validation, and comparison with the live cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmgpu.apps.doctor import compare_with_cluster
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.errors import ConfigError
from slurmgpu.slurm.backend import NodeInfo, parse_gres

BASE = """
[gpu_types.a100]
memory_gib = 80
[partitions.gpu]
gpu_types = ["a100"]
gpus_per_node = 4
"""


@pytest.mark.parametrize(("extra", "fragment"), [
    ("[policy]\ndecider = 'magic'\n", "policy.decider: must be one of keep, rules"),
    ("[policy]\nmin_gain = -1\n", "policy.min_gain: must be >= 0"),
    ("[partitions.small]\ngpu_types = ['h100']\ngpus_per_node = 1\n",
     "partitions.small.gpu_types: unknown GPU type 'h100'"),
    ("[partitions.small]\ngpu_types = ['a100']\ngpus_per_node = 0\n",
     "partitions.small.gpus_per_node: must be at least 1"),
    ("[gpu_types.t4]\nmemory_gib = 16\ncolour = 'red'\n", "gpu_types.t4.colour: unknown key"),
    ("[gpu_types.t4]\nmemory_gib = true\n", "gpu_types.t4.memory_gib: expected"),
    ("[gpu_types.t4]\nmemory_gib = nan\n", "gpu_types.t4.memory_gib: must be a finite number, got nan"),
    ("[policy]\nmin_gain = inf\n", "policy.min_gain: must be a finite number, got inf"),
    ("[policy]\nconfidence = 1\n", "policy.confidence: must be < 1, got 1"),
    ("[policy]\nconfidence = 0.5\n", "policy.confidence: must be > 0.5, got 0.5"),
    ("[gpu_types.t4]\nmemory_gib = 16\nrelative_speed_fp32 = -0.1\n",
     "gpu_types.t4.relative_speed_fp32: must be > 0, got -0.1"),
    ("oops = [\n", "invalid TOML"),
])
def test_errors_name_the_key(tmp_path: Path, extra: str, fragment: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(BASE + extra)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(err.value).startswith(str(p))
    assert fragment in str(err.value)


def test_compare_with_cluster(sample_config: Path) -> None:
    cfg = load_config(sample_config)
    nodes = [NodeInfo("n1", ("gpu", "debug"), parse_gres("gpu:a100:4(S:0),gpu:v100:4,nvme:1"), "idle",
                      ("a100", "v100")),
             NodeInfo("n2", ("gpu-small", "debug"), parse_gres("gpu:t4:4(S:0)"), "idle", ("t4", "T4")), MIG_NODE]
    assert compare_with_cluster(cfg, nodes) == []
    nodes = [NodeInfo("n1", ("gpu",), parse_gres("gpu:a100:4,gpu:h100:8"))]
    problems = compare_with_cluster(cfg, nodes)
    assert any(p.startswith("partition gpu: GPU type v100 is configured but no node offers it") for p in problems)
    assert any(p.startswith("partition gpu-small is configured but does not exist") for p in problems)
    assert any(p.startswith("partition gpu: the cluster offers GPU type h100, unknown") for p in problems)


# The local cluster's node of stand-in MIG instances (contrib/local-slurm/cluster.sh, node gpu3).
MIG_NODE = NodeInfo("n3", ("mig",), parse_gres("gpu:a100_1g.10gb:4,gpu:a100_3g.40gb:2,shard:a100_1g.10gb:4"), "idle",
                    ("mig", "a100_1g.10gb", "a100_3g.40gb"))


def layout(gpu: dict[str, int], small: dict[str, int], *, big_parts: tuple[str, ...] = ("gpu",),
           big_features: tuple[str, ...] = ("a100", "v100"), extra: tuple[NodeInfo, ...] = ()) -> list[NodeInfo]:
    """The local cluster's nodes (contrib/local-slurm/cluster.sh), with one thing changed."""
    return [NodeInfo("n1", big_parts, gpu, "idle", big_features),
            NodeInfo("n2", ("gpu-small",), small, "idle", ("t4",)), MIG_NODE, *extra]


@pytest.mark.parametrize("nodes, expect", [
    # each planted mismatch, alone, against the sample config (gpu: a100+v100, 4 per node, 1 node; gpu-small: t4)
    (layout({"a100": 2, "v100": 2}, {"t4": 4}),
     "partition gpu: gpus_per_node = 4 but its nodes hold at most 2 a100, 2 v100 per node: set gpus_per_node = 2"),
    (layout({"a100": 8, "v100": 4}, {"t4": 4}),
     "partition gpu: gpus_per_node = 4 but its nodes hold at most 8 a100, 4 v100 per node: set gpus_per_node = 8"),
    (layout({"a100": 4, "v100": 4}, {"t4": 4}, extra=(NodeInfo("n3", ("gpu",), {"a100": 4}),)),
     "partition gpu: nodes = 1 but it has 2 GPU node(s): set nodes = 2"),
    # partition membership: a node of gpu also in gpu-small brings a100 and v100 there
    (layout({"a100": 4, "v100": 4}, {"t4": 4}, big_parts=("gpu", "gpu-small")),
     ["partition gpu-small: its nodes hold a100 GPUs, which the config does not list for it: "
      "add 'a100' to [partitions.gpu-small].gpu_types",
      "partition gpu-small: its nodes hold v100 GPUs, which the config does not list for it: "
      "add 'v100' to [partitions.gpu-small].gpu_types",
      "partition gpu-small: nodes = 1 but it has 2 GPU node(s): set nodes = 2"]),
    (layout({"a100": 4, "v100": 4, "t4": 2}, {"t4": 4}),
     "partition gpu: its nodes hold t4 GPUs, which the config does not list for it: "
     "add 't4' to [partitions.gpu].gpu_types"),
    # node features: a100-80gb means a100 in the config; a node without a100 must not carry it
    (layout({"v100": 4, "a100": 4}, {"t4": 4}, extra=(NodeInfo("n3", ("debug",), {"v100": 4}, "idle",
                                                               ("v100", "a100-80gb")),)),
     "node n3: feature a100-80gb means GPU type a100 in the config, but the node holds no a100: "
     "remove 'a100-80gb' from [gpu_types.a100].features or from the node's Features"),
    (layout({"a100": 4, "v100": 4}, {"t4": 4, "l4": 2}),
     "partition gpu-small: the cluster offers GPU type l4, unknown to the config: add [gpu_types.l4]"),
    (layout({"a100": 4}, {"t4": 4}, big_features=("a100",)),
     "partition gpu: GPU type v100 is configured but no node offers it: remove it from [partitions.gpu].gpu_types"),
])
def test_config_check_catches_each_planted_mismatch(sample_config: Path, nodes: list[NodeInfo],
                                                    expect: str | list[str]) -> None:
    assert compare_with_cluster(load_config(sample_config), nodes) == ([expect] if isinstance(expect, str) else expect)


def test_cached_config_follows_the_file(tmp_path: Path) -> None:
    """gsbatch's parsed-config cache: a hit gives the same config, an edit is seen at once,
    and a cache written for another file version is never used."""
    path, cache = tmp_path / "slurmgpu.toml", tmp_path / "cache"
    path.write_text(BASE)
    first = load_config(path, str(cache))
    [stored] = cache.iterdir()
    assert stored.stat().st_mode & 0o777 == 0o600
    assert load_config(path, str(cache)) == first
    path.write_text(BASE.replace("memory_gib = 80", "memory_gib = 40"))
    assert load_config(path, str(cache)).gpu_types["a100"].memory_gib == 40
    text = stored.read_text()
    stored.write_text(text.replace('"memory_gib": 40', '"memory_gib": 24'))  # same key, other content:
    assert load_config(path, str(cache)).gpu_types["a100"].memory_gib == 24  # the cache is what is read
    path.write_text(BASE.replace("memory_gib = 80", "memory_gib = 41"))
    assert load_config(path, str(cache)).gpu_types["a100"].memory_gib == 41  # new mtime/size: stale cache ignored


def test_a_cache_hit_skips_the_toml_parser(tmp_path: Path, sample_config: Path) -> None:
    import subprocess
    import sys

    program = ("import sys; from slurmgpu.pipeline.config import load_config; "
               f"load_config({str(sample_config)!r}, {str(tmp_path)!r}); print('tomllib' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]
    assert runs == ["True", "False"]


def test_bad_toml_is_reported_with_the_cache_too(tmp_path: Path) -> None:
    path = tmp_path / "slurmgpu.toml"
    path.write_text(BASE + "oops = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, str(tmp_path / "cache"))


def test_config_init_writes_what_slurm_says_and_flags_what_it_does_not(tmp_path: Path) -> None:
    import tomllib

    from slurmgpu.apps.config_init import config_text
    from slurmgpu.pipeline.config import parse_config

    nodes = [NodeInfo("g1", ("gpu", "all"), {"a100_80gb": 8}), NodeInfo("g2", ("gpu", "all"), {"a100_80gb": 4}),
             NodeInfo("s1", ("small", "all"), {"t4": 2, "v100": 1}), NodeInfo("c1", ("cpu", "all"), {}),
             NodeInfo("u1", ("all",), {"": 2})]
    text = config_text(nodes, "gpu", "hpc")
    cfg = parse_config(tomllib.loads(text), "init.toml")
    assert cfg.site.cluster == "hpc" and cfg.default_partition == "gpu"
    assert {p.name: (p.gpu_types, p.gpus_per_node, p.nodes) for p in cfg.partitions.values()} == {
        "gpu": (("a100_80gb",), 8, 2), "small": (("t4", "v100"), 2, 1), "all": (("a100_80gb", "t4", "v100"), 8, 4)}
    assert cfg.gpu_types["a100_80gb"].memory_gib == 80 and cfg.gpu_types["t4"].memory_gib == 16
    # the 32-bit column: TF32 on the A100, FP32 on the T4 (8.1 of 65 16-bit TFLOPS): half the T4's 16-bit speed
    a100, t4 = cfg.gpu_types["a100_80gb"], cfg.gpu_types["t4"]
    assert a100.speed(32) == a100.relative_speed and t4.speed(32) < t4.relative_speed * 0.6
    assert t4.speed(16) == t4.relative_speed
    assert "# partition cpu: no typed GPUs" in text and "Nodes u1 offer GPUs without a type" in text
    assert "smallest variant (V100-16) is assumed" in text  # v100 alone does not say 16 or 32 GB
    unknown = config_text([NodeInfo("x1", ("gpu",), {"xpu9": 4})], None)
    with pytest.raises(ConfigError, match=r"gpu_types\.xpu9\.memory_gib.*must be > 0"):
        parse_config(tomllib.loads(unknown), "init.toml")  # no guessed memory: the admin must fill it in


def test_a_32_bit_job_sees_each_cards_fp32_speed_where_the_admin_gives_one(tmp_path: Path) -> None:
    """``relative_speed_fp32``: read for a job in 32-bit floats, ``relative_speed`` for any other and
    where the key is absent; a MIG slice takes its card's times its share, like ``relative_speed``."""
    p = tmp_path / "c.toml"
    p.write_text(BASE.replace("memory_gib = 80", "memory_gib = 80\nrelative_speed_fp32 = 0.8")
                 + "[gpu_types.v100]\nmemory_gib = 32\nrelative_speed = 0.45\n"
                 + '[gpu_types.slice]\nmig_of = "a100"\ncompute_fraction = 0.5\nmemory_gib = 40\n')
    cfg = load_config(p)
    a100, v100, part = (cfg.gpu_types[n] for n in ("a100", "v100", "slice"))
    assert (a100.speed(32), a100.speed(16), a100.speed(None)) == (0.8, 1.0, 1.0)
    assert v100.speed(32) == v100.speed(16) == 0.45
    assert part.speed(32) == pytest.approx(0.4) and part.speed(16) == pytest.approx(0.5)
    assert cfg.at_precision(16) is cfg
    assert {n: t.relative_speed for n, t in cfg.at_precision(32).gpu_types.items()} == pytest.approx(
        {"a100": 0.8, "v100": 0.45, "slice": 0.4})
