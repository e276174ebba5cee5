"""Published sizes of common models: parameters and activations per sample.

Activation memory in training grows with the activations a model keeps for its backward pass, and
between sizes of one architecture that count does not follow the depth in its name (ResNet-18 and
-34 use basic blocks, -50 and deeper bottlenecks). timm publishes both counts for over a thousand
image models (``contrib/published-models/extract.py`` builds ``model_sizes.csv`` from its benchmark
table), so a model size never run is placed among its siblings by what it computes, not its name.
"""

from __future__ import annotations

import csv
import functools
from pathlib import Path
from typing import NamedTuple


class ModelSize(NamedTuple):
    params_m: float  # parameters, millions
    acts_m: float  # activations per sample in a forward pass at IMG_SIZE, millions
    img_size: float  # the image side (pixels) the counts were taken at


@functools.cache
def _table() -> dict[str, ModelSize]:
    with open(Path(__file__).with_name("model_sizes.csv"), newline="") as fh:
        return {row["model"]: ModelSize(float(row["params_m"]), float(row["acts_m"]), float(row["img_size"]))
                for row in csv.DictReader(fh)}


def published_size(model: str | None) -> ModelSize | None:
    """The published size of MODEL (a name as a script passes it: ``resnet152``, ``timm/resnet152.a1_in1k``),
    None for a model the table does not know. Read from disk on first use only: most submissions never ask."""
    if not model:
        return None
    name = model.rsplit("/", 1)[-1].lower()
    table = _table()
    return table.get(name) or table.get(name.split(".", 1)[0])


def acts_per_token(size: ModelSize, image_size: float) -> float:
    """Activations (millions) per token of the features' ``log_tokens``: batch x image side where
    the script gives an image side (a sample's activations grow with its pixels, the side squared),
    else batch alone, each sample at the published side."""
    if image_size <= 1:
        return size.acts_m
    return size.acts_m * (image_size / size.img_size) ** 2 / image_size
