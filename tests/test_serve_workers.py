"""`slurmgpu serve --workers N`: the faster tree evaluator the workers answer with."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_serve import sock  # noqa: F401 - fixture

from slurmgpu.pipeline.bundle import TreeEnsemble
from slurmgpu.pipeline.features import NUMERIC

SAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml"
JOB = {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small",
       "user_name": "ann"}


def reference(trees: TreeEnsemble, x: list[float]) -> float:
    """The evaluator predict replaced: a test per split, leaves summed in tree order."""
    total = 0.0
    for splits, leaves in trees.trees:
        index = 0
        for bit, (feature, border) in enumerate(splits):
            if x[feature] > border:
                index |= 1 << bit
        total += leaves[index]
    return trees.scale * total + trees.bias


@pytest.mark.parametrize("depth", [3, 6, 10])
def test_fast_tree_evaluation_is_bit_identical(depth: int) -> None:
    rnd = random.Random(depth)
    borders = [rnd.uniform(-3, 3) for _ in range(40)]
    data = {"trees": [{"splits": [[rnd.randrange(len(NUMERIC)), rnd.choice(borders)]
                                  for _ in range(rnd.randint(1, depth))]} for _ in range(300)],
            "scale": rnd.uniform(0.5, 2), "bias": rnd.uniform(-1, 1)}
    for tree in data["trees"]:
        tree["leaves"] = [rnd.uniform(-1, 1) for _ in range(1 << len(tree["splits"]))]
    trees = TreeEnsemble(data)
    for _ in range(500):  # values on the borders, between them, and NaN
        x = [rnd.choice([rnd.choice(borders), rnd.uniform(-4, 4), float("nan")]) for _ in NUMERIC]
        assert trees.predict(x) == reference(trees, x)
