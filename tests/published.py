"""Published measurements as a site history: the project's models judged on numbers measured by
others (tests/fixtures/published/, provenance in its README), through the same path a site uses:
a CSV in ``history import``'s schema, ``train``, then the decider's per-type table (what
``slurmgpu predict --json`` prints)."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from slurmgpu.history import db
from slurmgpu.history.imports import import_history
from slurmgpu.learning import train
from slurmgpu.pipeline.bundle import Bundle, memory_base_mib
from slurmgpu.pipeline.config import Config, load_config
from slurmgpu.pipeline.features import arch_key, card_features, job_features, script_features
from slurmgpu.pipeline.model_sizes import published_size
from slurmgpu.pipeline.policy import ModelDecider
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_script

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


# The site config the timm sweep's histories are trained and asked under (its A100s).
TIMM_CONFIG = load_config(Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml")
TIMM_CONFIG = TIMM_CONFIG._replace(policy=TIMM_CONFIG.policy._replace(decider="model"))


def trained_bundle(tmp_path: Path, rows: Iterable[Mapping[str, str]]) -> Bundle:
    """A bundle trained (train's default quantile) on the timm rows as a site history, in random order."""
    rows = list(rows)
    random.Random(0).shuffle(rows)
    tmp_path.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    history_csv(tmp_path / "h.csv", rows)
    assert import_history(engine, str(tmp_path / "h.csv"), "pub").jobs.inserted == len(rows)
    return train.fit(train.history_rows(engine), TIMM_CONFIG, iterations=300)[0]


def shown_peak(bundle: Bundle, model: str, batch: int, image: str) -> float:
    """The per-GPU peak ``predict --json`` shows for the job on one A100 (the card it was measured on)."""
    request = build_request(parse_script(train_script(model, batch, image).encode(), "job.sh"), [], {},
                            TIMM_CONFIG.gpu_features())
    table = ModelDecider(TIMM_CONFIG, bundle, lambda: {}).decide(request).per_type
    return next(c.pred_peak_mem_mib for c in table if (c.gpu_type, c.gpus) == ("a100", 1))


def estimate_mib(bundle: Bundle, model: str, batch: int, image: str) -> float:
    """The estimate before its learned ratio and margin (bundle.memory_base_mib)."""
    sf = script_features(train_script(model, batch, image))
    f = job_features(sf, {"gpus_total": 1}, {"memory_gib": 80.0, "relative_speed": 1.0}, 1, bundle.history)
    return memory_base_mib(f, sf, bundle.history)


def architectures_left_out(models: Iterable[str], draw: int) -> set[str]:
    """Every size of a fifth of the models' architectures (``arch_key``), drawn at random (DRAW)."""
    archs: dict[str | None, list[str]] = defaultdict(list)
    for model in models:
        archs[arch_key(model)].append(model)
    keys = sorted(archs, key=str)
    return {m for a in random.Random(100 + draw).sample(keys, len(keys) // 5) for m in archs[a]}


# DLInfBench's six cards (memory_by_gpu.csv), GiB: GTX 1080, 1080 Ti, Titan X Pascal, Titan V, V100-PCIE
# 16 GB, RTX 2080 Ti.
CARDS = {"gtx_1080": 8, "gtx_1080_ti": 11, "titan_x_pascal": 12, "titan_v": 12, "tesla_v100": 16, "rtx2080ti": 11}
Peaks = dict[tuple[str, int, str], tuple[float, str]]  # (model, batch, card) -> (MiB, image side)


def inference_script(model: str, batch: int, image: str, card: str) -> str:
    return (f"#!/bin/bash\n#SBATCH --gres=gpu:{card}:1\n#SBATCH --time=01:00:00\n"
            f"python infer.py --model {model} --batch-size {batch} --image-size {image}\n")


def generations_history(tmp_path: Path, seed: int, cards_a_batch: int) -> tuple[Config, Peaks, Engine]:
    """The config of DLInfBench's cards, its measurements, and a history of them: each CNN at batch
    1-32, each batch on CARDS_A_BATCH cards drawn at random (SEED), in random order."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "c.toml").write_text('[site]\ncluster = "gen"\n[policy]\ndecider = "model"\n' + "".join(
        f"[gpu_types.{c}]\nmemory_gib = {m}\nrelative_speed = 1.0\n" for c, m in CARDS.items())
        + f"[partitions.gpu]\ngpu_types = {json.dumps(list(CARDS))}\ngpus_per_node = 4\nnodes = 6\ndefault = true\n")
    config = load_config(tmp_path / "c.toml")
    with open(FIXTURES / "memory_by_gpu.csv", newline="") as fh:
        peaks = {(r["model"], int(r["batch_size"]), r["gpu_dir"]): (float(r["peak_mib"]), r["image_size"])
                 for r in csv.DictReader(fh)}
    rnd = random.Random(seed)
    jobs = [(m, b, c) for m in sorted({m for m, _, _ in peaks}) for b in (1, 2, 4, 8, 16, 32)
            for c in rnd.sample(sorted(CARDS), cards_a_batch)]
    rnd.shuffle(jobs)
    with open(tmp_path / "h.csv", "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(COLUMNS)
        for i, (m, b, c) in enumerate(jobs):
            peak, image = peaks[(m, b, c)]
            out.writerow([9000 + i, f"u{i % 5}", (datetime(2026, 6, 1) + timedelta(hours=i)).isoformat(), c, 1, 600,
                          "COMPLETED", peak, inference_script(m, b, image, c)])
    url = f"sqlite:///{tmp_path / 'h.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    assert import_history(engine, str(tmp_path / "h.csv"), "gen").jobs.inserted == len(jobs)
    return config, peaks, engine


def generations_judged(bundle: Bundle, config: Config, peaks: Peaks) -> tuple[dict[str, float], dict[str, float]]:
    """The errors of the estimate and of the figure shown, at batch 64 and 128 on every card."""
    estimate, shown, measured = {}, {}, {}
    for (model, batch, card), (peak, image) in peaks.items():
        if batch in (64, 128):
            sf = script_features(inference_script(model, batch, image, card))
            gt = config.gpu_types[card]
            f = job_features(sf, {"gpus_total": 1, "gpu_type": card, "req_gpu_mem_gib": gt.memory_gib},
                             card_features(gt, 32.0), 1, bundle.history, card)
            key = f"{model}@{batch}@{card}"
            estimate[key], shown[key] = bundle.peak_estimate_mib(f, sf), bundle.peak_mib(f, sf)
            measured[key] = peak
    return errors(estimate, measured), errors(shown, measured)
