"""The model registry: versioned bundle files next to the active one, and their DB records."""

from __future__ import annotations

import os
import shutil
from typing import Any, cast

from sqlalchemy import Table, func, select, update
from sqlalchemy.engine import Engine

from slurmgpu.history.db import ModelVersion
from slurmgpu.pipeline.bundle import Bundle
from slurmgpu.pipeline.config import Config

NAME = "slurmgpu"


def register(engine: Engine, bundle: Bundle, active_path: str, active: bool) -> int:
    """Write ``<model>-vN.json`` beside the active path, record it, and (if active) install it."""
    from datetime import datetime

    os.makedirs(os.path.dirname(os.path.abspath(active_path)) or ".", exist_ok=True)
    with engine.begin() as conn:
        version = (conn.execute(select(func.max(ModelVersion.version)).where(ModelVersion.name == NAME)).scalar()
                   or 0) + 1
        stem, ext = os.path.splitext(active_path)
        path = f"{stem}-v{version}{ext or '.json'}"
        bundle.save(path)
        if active:
            conn.execute(update(ModelVersion).where(ModelVersion.name == NAME).values(active=False))
        start, end = bundle.data.get("window", [None, None])
        conn.execute(cast(Table, ModelVersion.__table__).insert(), [{
            "name": NAME, "version": version, "path": path, "features": bundle.data["features"],
            "metrics": bundle.data.get("metrics", {}), "active": active,
            "train_start": datetime.fromisoformat(start) if start else None,
            "train_end": datetime.fromisoformat(end) if end else None,
            "digest": bundle.digest,  # of the bytes just saved: what decisions made with it record
        }])
    if active:
        tmp = active_path + ".tmp"
        shutil.copyfile(path, tmp)
        os.replace(tmp, active_path)
    return version


def version_path(engine: Engine, version: int) -> str | None:
    """The bundle file of registered version VERSION (None when there is no such version)."""
    with engine.connect() as conn:
        return conn.execute(select(ModelVersion.path).where(ModelVersion.name == NAME,
                                                            ModelVersion.version == version)).scalar()


def version_of(engine: Engine, digest: str) -> dict[str, Any] | None:
    """The registered version a decision's model digest names (``submissions.model_version``):
    its number, bundle path, training window and metrics; None when no registered version has it."""
    table = cast(Table, ModelVersion.__table__)
    with engine.connect() as conn:
        row = conn.execute(select(table.c.version, table.c.path, table.c.train_start, table.c.train_end,
                                  table.c.metrics, table.c.active, table.c.digest)
                           .where(table.c.name == NAME, table.c.digest == digest)
                           .order_by(table.c.version.desc())).first()
    return dict(row._mapping) if row else None


def installed(engine: Engine) -> dict[str, Any] | None:
    """The active (installed) version: its number, digest, when it was made, its training window and
    the figures it was installed with on the jobs held out then; None before any was installed."""
    table = cast(Table, ModelVersion.__table__)
    with engine.connect() as conn:
        row = conn.execute(select(table.c.version, table.c.digest, table.c.created_at, table.c.train_start,
                                  table.c.train_end, table.c.metrics)
                           .where(table.c.name == NAME, table.c.active.is_(True))
                           .order_by(table.c.version.desc())).first()
    return dict(row._mapping) if row else None


def metrics(bundle: Bundle, train_rows: list[dict[str, Any]], test_rows: list[dict[str, Any]],
            config: Config) -> dict[str, Any]:
    """A model's figures on held-out jobs: its numbers (``train.evaluate``) and its deployed decisions
    replayed (``evaluation.replay``: placed where it does not fit, OOMs)."""
    from slurmgpu.learning.evaluation import replay
    from slurmgpu.learning.train import evaluate

    decided = replay(bundle, config, train_rows, test_rows)
    return {**evaluate(bundle, train_rows, test_rows, config),
            "decider": {k: v for k, v in decided.items() if k != "moves"}}


def current_metrics(path: str, train_rows: list[dict[str, Any]], test_rows: list[dict[str, Any]],
                    config: Config) -> dict[str, Any] | None:
    """The installed model's metrics on the same held-out jobs; None when there is none usable."""
    try:
        old = Bundle.load(path)
    except (OSError, ValueError, KeyError):
        return None
    return metrics(old, train_rows, test_rows, config)


def worse(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """The deployed decision first (more jobs placed where they do not fit, or more OOMs, on the same
    held-out jobs is worse; so is a type pick within 5% of the best measured throughput for fewer of
    them, the new share's whole 95% interval below the old share), then memory safety (more
    under-predictions), then runtime error."""
    n_dec, o_dec = new.get("decider") or {}, old.get("decider") or {}
    for key in ("placed_no_fit", "oom_decided"):
        if n_dec.get(key) is not None and o_dec.get(key) is not None and n_dec[key] > o_dec[key]:
            return True
    n_pick, o_pick = n_dec.get("throughput_model_within_5pct_ci"), o_dec.get("throughput_model_within_5pct")
    if n_pick is not None and o_pick is not None and n_pick[1] < o_pick:
        return True
    n_mem, o_mem = new.get("memory_under_prediction_rate"), old.get("memory_under_prediction_rate")
    if n_mem is not None and o_mem is not None and n_mem > o_mem + 0.002:
        return True
    n_rt, o_rt = new.get("runtime_mdape"), old.get("runtime_mdape")
    return n_rt is not None and o_rt is not None and n_rt > o_rt * 1.10
