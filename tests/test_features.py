"""Job identity: what drives memory and time stays in the family key; sizes come from names."""

from __future__ import annotations

import math

import pytest

from slurmgpu.pipeline.features import (
    HELD,
    RATE,
    SITE_LINE_MIN,
    CountsLine,
    HistoryStats,
    counts_line,
    family_key,
    keys_at,
    model_size_b,
    script_features,
)

RESNET = "python train.py --arch {arch} --batch-size {batch} --lr {lr} --data /scratch/{user}/imagenet"
LLAMA = "torchrun --nproc_per_node={n} sft.py --model_name_or_path {path} --per_device_train_batch_size {b}"


@pytest.mark.parametrize(("a", "b"), [
    (RESNET.format(arch="resnet18", batch=32, lr=0.1, user="ann"), RESNET.format(arch="resnet152", batch=32, lr=0.1,
                                                                                  user="ann")),
    (LLAMA.format(n=4, path="meta-llama/Llama-2-7b-hf", b=4), LLAMA.format(n=4, path="meta-llama/Llama-2-70b-hf", b=4)),
    ("python gen.py --model=facebook/opt-1.3b", "python gen.py --model=facebook/opt-350m"),
    ("python finetune.py --model bert-base-uncased", "python finetune.py --model bert-large-uncased"),
])
def test_model_and_size_make_different_families(a: str, b: str) -> None:
    assert family_key(a) != family_key(b)


@pytest.mark.parametrize(("a", "b"), [
    # another batch size, learning rate, data path or user: the same family
    (RESNET.format(arch="resnet50", batch=32, lr=0.1, user="ann"), RESNET.format(arch="resnet50", batch=256, lr=0.4,
                                                                                  user="bob")),
    # the same model from the hub or a local copy, another GPU count
    (LLAMA.format(n=4, path="meta-llama/Llama-2-7b-hf", b=4),
     LLAMA.format(n=8, path="/scratch/ann/Llama-2-7b-hf", b=8)),
    ("python gen.py --model=facebook/opt-1.3b --seed 1", "python gen.py --model=OPT-1.3B --seed 2"),
])
def test_runs_of_one_model_stay_one_family(a: str, b: str) -> None:
    assert family_key(a) == family_key(b)


@pytest.mark.parametrize(("name", "billions"), [
    # sizes written in names, as on the model cards
    ("meta-llama/Llama-2-70b-hf", 70.0), ("meta-llama/Meta-Llama-3-8B", 8.0), ("facebook/opt-1.3b", 1.3),
    ("bigscience/bloom-560m", 0.56), ("EleutherAI/pythia-160m", 0.16), ("Qwen/Qwen2.5-0.5B-Instruct", 0.5),
    # known names: torchvision's ResNet table (11.7M, 21.8M, 25.6M, 44.5M, 60.2M parameters), BERT, GPT-2
    ("resnet18", 0.0117), ("resnet34", 0.0218), ("resnet50", 0.0256), ("resnet101", 0.0445), ("resnet152", 0.0602),
    ("bert-large-uncased", 0.34), ("gpt2", 0.124), ("gpt2-xl", 1.558),
])
def test_parameter_counts_from_names(name: str, billions: float) -> None:
    assert model_size_b(name, "") == pytest.approx(billions)


def test_deeper_model_reads_larger_in_the_script() -> None:
    small = script_features("#!/bin/bash\n" + RESNET.format(arch="resnet18", batch=64, lr=0.1, user="a") + "\n")
    large = script_features("#!/bin/bash\n" + RESNET.format(arch="resnet152", batch=64, lr=0.1, user="a") + "\n")
    assert large["params_b"] > 5 * small["params_b"] and large["family"] != small["family"]


def test_a_command_with_a_byte_that_is_not_utf8_has_a_family() -> None:
    script = b"#!/bin/bash\npython train.py --data /scratch/caf\xe9 --batch-size 8\n".decode("utf-8", "surrogateescape")
    assert len(script_features(script)["family"]) == 12


def test_a_familys_keys_by_shape_are_the_keys_a_scan_finds() -> None:
    """A decision reads a family's speeds shape by shape from its grouped keys (``keys_at``): the same
    keys and values, in the same order, as a scan of every key, for any prefix (one holding an "@"
    before its end, or none, included); and the outcomes ``held_bound_gib`` reads once are the ones
    it read from the keys."""
    stats = {f"{RATE}1xa100@64": -1.0, "n": 3, f"{RATE}1xa100@128": -2.0, f"{RATE}2xa100@64": -3.0,
             f"{RATE}1xa100": -1.5, f"{RATE}1xa@100@64": -4.0, f"{RATE}1xa100@64@x": -5.0,
             f"{HELD}40:1": 8.0, f"{HELD}80:2": 9.0, f"{HELD}24:1": 7.0}
    history = HistoryStats({"f": stats})
    fam = history.family("f")
    for prefix in (f"{RATE}1xa100@", f"{RATE}2xa100@", f"{RATE}1xa@", f"{RATE}1xa@100@", f"{RATE}1xv100@", "n@"):
        assert keys_at(fam, prefix) == keys_at(dict(stats), prefix) == \
            [(k, v) for k, v in stats.items() if k.startswith(prefix)]
    assert keys_at(fam, f"{RATE}1xa100@") == [(f"{RATE}1xa100@64", -1.0), (f"{RATE}1xa100@128", -2.0),
                                            (f"{RATE}1xa100@64@x", -5.0)]
    assert [history.held_bound_gib("f", t, g) for t, g in ((7.5, 1), (7.5, 2), (8.5, 1), (8.5, 2), (9.5, 2))] == \
        [40.0, 40.0, None, 80.0, None]
    assert history.held_bound_gib("other", 1.0, 8) is None and history.family("other") == {}


def test_asking_about_families_the_history_lacks_keeps_nothing() -> None:
    """A daemon is asked about any family users write: no entry is kept for one the history lacks."""
    history = HistoryStats({"known": {"n": 3.0, "held:40:1": 9.0}})
    for i in range(1000):
        assert history.family(f"unknown{i}") == {}
        assert history.held_bound_gib(f"unknown{i}", 1.0, 1) is None
    assert history.held_bound_gib("known", 1.0, 1) == 40.0
    assert set(history._family) == {"known"} and set(history._held) == {"known"}


@pytest.mark.parametrize(("args", "steps", "shown"), [
    ("--max-steps 5000", 5000, 1),
    ("--train-iters 5000", 5000, 1),  # Megatron
    ("--num_train_steps 5000", 5000, 1),
    ("--max_epochs 3", 3000, 1),  # Lightning: epochs, a thousand steps each as for --epochs
    ("--num_train_epochs 3", 3000, 1),
    ("--train-samples 160000", 5000, 1),  # samples over the batch of 32
    ("--max_train_samples 3200 --batch-size 64", 50, 1),
    ("", 1000, 0),  # no work argument: one epoch's default, and the work not shown
])
def test_the_work_a_script_shows(args: str, steps: int, shown: int) -> None:
    """Work arguments in their common spellings give the steps; without any the work is hidden
    (``work_shown`` 0: the learning side then counts timed-out runs in the family's speed)."""
    sf = script_features(f"#!/bin/bash\npython train.py --model resnet50 {args}\n")
    assert sf["log_steps"] == pytest.approx(math.log(steps)) and sf["work_shown"] == shown


def test_the_sites_counts_line_is_read_from_its_whole_history_at_the_jobs_precision() -> None:
    """Families whose fitted lines follow a = 900 + 16 x params, b = 3 x activations (one off by
    100x, a degenerate line) give that line back: the fixed part by least squares, the cost per
    activation by the median (the outlier moves it not at all). Another precision has its own
    (none here); a training row's partial view, and fewer than SITE_LINE_MIN families, have none."""
    fams = {f"m{i}": {"bits": 32.0, "params_m": 5.0 * (i + 1), "acts_m": 2.0 + i, "a": 900.0 + 16 * 5.0 * (i + 1),
                      "b": 3.0 * (2.0 + i) * (100.0 if i == 0 else 1.0)} for i in range(SITE_LINE_MIN + 2)}
    line = HistoryStats(fams, whole=True).counts_line(32.0)
    assert line == pytest.approx(CountsLine(900.0, 16.0, 3.0))
    assert HistoryStats(fams, whole=True).counts_line(16.0) is None
    assert HistoryStats(fams).counts_line(32.0) is None
    few = dict(list(fams.items())[:SITE_LINE_MIN - 1])
    assert counts_line(few.values(), 32.0) is None and counts_line(fams.values(), 32.0) == line
