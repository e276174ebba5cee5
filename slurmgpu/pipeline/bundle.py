"""The learned models: CatBoost training, and a small evaluator that applies them without CatBoost.

Training uses CatBoost (quantile regression for peak GPU memory, RMSE on log runtime). The
trained oblivious trees are exported to a compact JSON bundle that ``TreeEnsemble`` applies in
pure Python, so gsbatch predicts in about a millisecond without importing CatBoost (~1 s).
Peak memory grows about linearly with batch x sequence length and trees cannot extrapolate, so
the memory model predicts the log-ratio of the peak to a per-family linear base fitted on the
family's history (an analytic estimate for families never seen); only the residual is learned.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from slurmgpu.pipeline.features import NUMERIC, HistoryStats

BUNDLE_VERSION = 1
MIB = 1024.0


class TreeEnsemble:
    """CatBoost oblivious trees over float features: sum of one leaf per tree, scaled."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.trees = [([(int(f), float(b)) for f, b in t["splits"]], [float(v) for v in t["leaves"]])
                      for t in data["trees"]]
        self.scale, self.bias = float(data["scale"]), float(data["bias"])
        self._arrays: Any = None

    def predict_many(self, rows: Sequence[Sequence[float]]) -> list[float]:
        """Several rows at once: vectorised when numpy is already loaded (the daemon), else a loop
        (gsbatch, which must not pay numpy's import for a handful of rows)."""
        np = sys.modules.get("numpy")
        if np is None or len(rows) < 2:
            return [self.predict(x) for x in rows]
        if self._arrays is None:
            depth = max(len(s) for s, _ in self.trees)
            feats = np.zeros((len(self.trees), depth), dtype=np.int64)
            borders = np.full((len(self.trees), depth), np.inf)
            leaves = np.zeros((len(self.trees), 1 << depth))
            for t, (splits, values) in enumerate(self.trees):
                for b, (f, border) in enumerate(splits):
                    feats[t, b], borders[t, b] = f, border
                leaves[t, :len(values)] = values
            self._arrays = (feats, borders, leaves, 1 << np.arange(depth))
        feats, borders, leaves, bits = self._arrays
        x = np.asarray(rows, dtype=float)
        index = ((x[:, feats] > borders) * bits).sum(axis=2)  # rows x trees
        totals = leaves[np.arange(len(self.trees)), index].sum(axis=1)
        return list(self.scale * totals + self.bias)

    def predict(self, x: Sequence[float]) -> float:
        total = 0.0
        for splits, leaves in self.trees:
            index = 0
            for bit, (feature, border) in enumerate(splits):
                if x[feature] > border:
                    index |= 1 << bit
            total += leaves[index]
        return self.scale * total + self.bias

    @staticmethod
    def from_catboost(model: Any) -> dict[str, Any]:
        """Export a fitted CatBoost model (float features only) to the bundle's tree format."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.json")
            model.save_model(path, format="json")
            with open(path) as fh:
                raw = json.load(fh)
        trees = [{"splits": [[s["float_feature_index"], s["border"]] for s in t["splits"]],
                  "leaves": t["leaf_values"]} for t in raw["oblivious_trees"]]
        scale, bias = raw["scale_and_bias"]
        return {"trees": trees, "scale": scale, "bias": bias[0] if isinstance(bias, list) else bias}


def analytic_base_mib(f: Mapping[str, float]) -> float:
    """A physics-style estimate of per-GPU peak memory for a family with no history.

    Weights, gradients and Adam state by precision (LoRA trains ~1% of the weights; ZeRO shards
    optimizer state and gradients), activations linear in tokens, plus framework overhead.
    """
    params = f["params_b"] * 1e9
    wbytes = 1.0 if f["int8"] else f["precision_bits"] / 8
    trainable = params * (0.01 if f["lora"] else 1.0)
    shards = max(f["gpus"], 1.0) if f["zero"] else 1.0
    state = trainable * (wbytes + 12.0) / (shards if f["zero"] >= 1 else 1.0)
    act_per_token = 2e3 * math.sqrt(max(params, 1e6)) / 1e3 * (0.3 if f["ckpt"] else 1.0)
    activations = act_per_token * math.exp(f["log_tokens"]) * f["precision_bits"] / 8
    return (params * wbytes + state + activations) / 2**20 + 800.0


def family_base_mib(f: Mapping[str, float], fam: Mapping[str, float]) -> float | None:
    """Per-family linear base a + b*tokens (b >= 0) from history; None without history."""
    if not fam or fam.get("n", 0) < 1:
        return None
    tokens = math.exp(f["log_tokens"])
    a, b = fam.get("a", 0.0), fam.get("b", 0.0)
    floor = fam.get("peak_at_tokens_min", 0.0)  # memory never shrinks as tokens grow
    if b > 0:
        return max(a + b * tokens, floor) if tokens >= fam.get("tokens_min", 0.0) else max(floor, 1.0)
    # One batch size seen: scale the peak as if it all grew with tokens (a safe upper bound).
    peak, t0 = math.exp(fam["log_peak_max"]), math.exp(fam["log_tokens_at_max"])
    return peak * max(tokens / t0, 1.0) if t0 > 0 else peak


class Prediction(NamedTuple):
    peak_mem_mib: float  # per GPU, at the model's quantile
    runtime_s: float


class Bundle:
    """A trained model version: trees, feature list, history snapshot, metrics."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        if data.get("version") != BUNDLE_VERSION:
            raise ValueError(f"model bundle version {data.get('version')!r}, this code reads {BUNDLE_VERSION}")
        if list(data.get("features", [])) != list(NUMERIC):
            raise ValueError("model was trained with other features than this code builds (stale model): retrain")
        self.data = dict(data)
        self.memory = TreeEnsemble(data["memory"])
        self.runtime = TreeEnsemble(data["runtime"])
        # Per-family history only: a bundle is world-readable, so it carries nothing per user.
        self.history = HistoryStats(data["history"]["families"])
        self.quantile = float(data["quantile"])

    @classmethod
    def load(cls, path: str) -> Bundle:
        with open(path, encoding="utf-8") as fh:
            return cls(json.load(fh))

    def save(self, path: str) -> None:
        from slurmgpu.pipeline.spool import atomic_write

        atomic_write(path, json.dumps(self.data, separators=(",", ":")).encode(), 0o644)

    def predict(self, f: Mapping[str, float], family: str) -> Prediction:
        return self.predict_many([f], family)[0]

    def predict_many(self, rows: Sequence[Mapping[str, float]], family: str) -> list[Prediction]:
        xs = [[f[name] for name in NUMERIC] for f in rows]
        fam = self.history.family(family)
        bases = [family_base_mib(f, fam) or analytic_base_mib(f) for f in rows]
        return [Prediction(base * math.exp(m), math.exp(r)) for base, m, r in
                zip(bases, self.memory.predict_many(xs), self.runtime.predict_many(xs), strict=True)]
