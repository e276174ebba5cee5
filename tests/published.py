"""Published measurements as a site history: the project's models judged on numbers measured by
others (tests/fixtures/published/, provenance in its README), through the same path a site uses:
a CSV in ``history import``'s schema, ``train``, then the decider's per-type table (what
``slurmgpu predict --json`` prints)."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from slurmgpu.pipeline.model_sizes import published_size

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "published"
COLUMNS = ("job_id", "user", "submit_time", "gpu_type", "gpu_count", "elapsed_s", "state", "peak_gpu_mem_mib",
           "script")


def gavel_config(gpus_per_node: int, cluster: str = "gavel") -> str:
    """The admin config of a cluster of Gavel's three GPU types, one partition holding them all.
    Datasheet FP32 peak (TFLOPS) relative to the V100's 15.7: K80 (one GK210 of the board) 4.4,
    P100 (SXM2) 10.6. Memory per GPU: 12, 16 and 16 GiB."""
    return f"""
[site]
cluster = "{cluster}"
[policy]
decider = "model"
objective = "fastest"
min_history = 3
[gpu_types.k80]
memory_gib = 12
relative_speed = 0.28
cost = 1.0
[gpu_types.p100]
memory_gib = 16
relative_speed = 0.68
cost = 2.0
[gpu_types.v100]
memory_gib = 16
relative_speed = 1.0
cost = 3.0
[partitions.gpu]
gpu_types = ["k80", "p100", "v100"]
gpus_per_node = {gpus_per_node}
nodes = 8
default = true
"""


def memory_rows(source: str = "gpumemnet_timm") -> list[dict[str, str]]:
    """The source's measurements that pass its plausibility checks (``ok``), with an image size.

    An image size the fixture read from a model's name is often no image size: the number names a
    width (levit_512, mobilenetv1_100: trained at 224 px) or a RegNet's GFLOPs (regnety_640,
    regnetx_004). Such a row takes the input size timm publishes for the model (the table
    ``model_sizes`` was built from); where timm publishes none, the name's number is kept from
    160 px up and below it the job script gives no image size."""
    with open(FIXTURES / "memory.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["source"] == source and r["ok"] == "1" and r["image_or_seq"]]
    for r in rows:
        if r["note"] == "img_size_from_model_name":
            size = published_size(r["model"])
            r["image_or_seq"] = (f"{size.img_size:g}" if size else
                                 r["image_or_seq"] if int(r["image_or_seq"]) >= 160 else "")
    return rows


def by_model(rows: Iterable[Mapping[str, str]]) -> dict[str, list[Mapping[str, str]]]:
    out: dict[str, list[Mapping[str, str]]] = defaultdict(list)
    for r in rows:
        out[r["model"]].append(r)
    return out


def train_script(model: str, batch: int, image: str | int, gpu_type: str = "a100") -> str:
    """The job script a user of the measured training would write."""
    size = f" --image-size {image}" if image else ""
    return (f"#!/bin/bash\n#SBATCH --gres=gpu:{gpu_type}:1\n#SBATCH --time=04:00:00\n"
            f"python train.py --model {model} --batch-size {batch}{size}\n")


def history_csv(path: Path, rows: Iterable[Mapping[str, str]], gpu_type: str = "a100") -> int:
    """Write measurements as completed jobs, an hour apart, in the import schema; returns the count."""
    t0 = datetime(2026, 6, 1)
    n = 0
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(COLUMNS)
        for i, r in enumerate(rows):
            text = train_script(r["model"], int(r["batch_size"]), r["image_or_seq"], gpu_type)
            out.writerow([f"{9000 + i}", f"u{i % 7}", (t0 + timedelta(hours=i)).isoformat(), gpu_type, 1,
                          600 + 7 * int(r["batch_size"]),
                          "COMPLETED", r["peak_mib"], text])
            n += 1
    return n


def errors(predicted: Mapping[Any, float], measured: Mapping[Any, float]) -> dict[str, float]:
    """Median absolute percentage error and the share under-predicted, over the keys both have."""
    rel = sorted((predicted[k] - measured[k]) / measured[k] for k in measured if k in predicted)
    ape = sorted(abs(e) for e in rel)
    return {"n": len(rel), "mdape": ape[len(ape) // 2] if ape else math.nan,
            "under": sum(e < 0 for e in rel) / len(rel) if rel else math.nan,
            "worst_under": min(rel, default=math.nan)}
