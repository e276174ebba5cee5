"""The learned models: CatBoost training, and a small evaluator that applies them without CatBoost.

Training uses CatBoost (quantile regression for peak GPU memory, RMSE on log runtime). The
trained oblivious trees are exported to a compact JSON bundle that ``TreeEnsemble`` applies in
pure Python, so gsbatch predicts in about a millisecond without importing CatBoost (~1 s).
Peak memory grows about linearly with batch x sequence length and trees cannot extrapolate, so
the memory model predicts the log-ratio of the peak to a per-family linear base fitted on the
family's history (an analytic estimate for families never seen); only the residual is learned.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import operator
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from slurmgpu.pipeline.features import (
    NUMERIC,
    RATE,
    SITE_KIND,
    TYPE_OFFSET,
    CountsLine,
    HistoryStats,
    hexdigest,
    linear_fits,
    measured,
    placed_by_size,
    published_counts,
    size_scale,
    sized_fits,
    slope,
)
from slurmgpu.pipeline.files import read_regular

BUNDLE_VERSION = 2
# The largest card offset a bundle may carry (MiB): a context and workspace, not a card.
MAX_TYPE_OFFSET_MIB = 65536.0
MIB = 1024.0
MAX_BUNDLE_BYTES = 256 << 20  # a trained bundle is about 1 MiB; a file past this is not read


MAX_DEPTH = 16  # CatBoost's own limit for oblivious trees


class ModelFileError(ValueError):
    """The model file is not a bundle this code can apply; the request is kept as written."""


def _number(value: Any, where: str) -> float:
    """A finite JSON number (not a boolean, string or NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFileError(f"{where}: expected a finite number, got {json.dumps(value)[:40]}")
    return float(value)


def _numbers(values: list[Any], where: str) -> list[float]:
    """``_number`` over a list, checked in C (a bundle holds some 80,000 leaves, read on every
    in-process submission): finite ints and floats only, never a boolean or a string."""
    if not set(map(type, values)) <= {int, float}:
        bad = next(v for v in values if type(v) not in (int, float))
        raise ModelFileError(f"{where}: expected a finite number, got {json.dumps(bad)[:40]}")
    out = list(map(float, values))
    if not all(map(math.isfinite, out)):
        bad = next(v for v in out if not math.isfinite(v))
        raise ModelFileError(f"{where}: expected a finite number, got {json.dumps(bad)[:40]}")
    return out


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ModelFileError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _items(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ModelFileError(f"{where}: expected a list, got {type(value).__name__}")
    return value


class TreeEnsemble:
    """CatBoost oblivious trees over float features: sum of one leaf per tree, scaled.

    The trees are checked as they are read, so a file that would fail (or predict NaN) on some
    job is refused when it is loaded: a feature index this code does not build, a leaf count
    that is not 2 ** depth, a non-finite number.
    """

    def __init__(self, data: Any, where: str = "model") -> None:
        data = _table(data, where)
        self.trees: list[tuple[list[tuple[int, float]], list[float]]] = []
        for i, t in enumerate(_items(data.get("trees"), f"{where}.trees")):
            here = f"{where}.trees[{i}]"
            t = _table(t, here)
            splits = []
            for split in _items(t.get("splits"), f"{here}.splits"):
                if not isinstance(split, list) or len(split) != 2:
                    raise ModelFileError(f"{here}.splits: expected [feature, border] pairs")
                f = split[0]
                if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < len(NUMERIC):
                    raise ModelFileError(f"{here}: feature {json.dumps(f)[:40]} is not one of the "
                                         f"{len(NUMERIC)} this code builds")
                splits.append((f, _number(split[1], f"{here}.splits")))
            leaves = _numbers(_items(t.get("leaves"), f"{here}.leaves"), f"{here}.leaves")
            if len(splits) > MAX_DEPTH or len(leaves) != 1 << len(splits):
                raise ModelFileError(f"{here}: {len(leaves)} leaves for depth {len(splits)} "
                                     f"(an oblivious tree has 2 ** depth, depth at most {MAX_DEPTH})")
            self.trees.append((splits, leaves))
        if not self.trees:
            raise ModelFileError(f"{where}.trees: no trees")
        self.scale, self.bias = _number(data.get("scale"), f"{where}.scale"), _number(data.get("bias"), f"{where}.bias")
        self._arrays: StackedTrees | None = None
        self._packed: tuple[list[tuple[int, list[float], list[int]]], int, list[float], list[int]] | None = None

    def _pack(self) -> tuple[list[tuple[int, list[float], list[int]]], int, list[float], list[int]]:
        """The trees as bit masks, so ``predict`` does per feature what it did per split.

        Every tree gets a field of ``width`` bits (8, or 16 past depth 8) in one big integer: split b of
        tree t is bit ``t * width + b``. For each feature, its distinct borders sorted, and for the
        k smallest the OR of the bits of every split on them: a value above exactly those k borders
        sets exactly those bits. The fields, read back as bytes, are each tree's leaf index."""
        width = 8 if max(len(s) for s, _ in self.trees) <= 8 else 16
        masks: dict[int, dict[float, int]] = {}
        for t, (splits, _) in enumerate(self.trees):
            for b, (feature, border) in enumerate(splits):
                by_border = masks.setdefault(feature, {})
                by_border[border] = by_border.get(border, 0) | 1 << (t * width + b)
        features = []
        for feature, by_border in sorted(masks.items()):
            borders, cumulative, acc = sorted(by_border), [0], 0
            for border in borders:
                acc |= by_border[border]
                cumulative.append(acc)
            features.append((feature, borders, cumulative))
        leaves = [v for _, values in self.trees for v in values + [0.0] * ((1 << width) - len(values))]
        return features, width, leaves, [t << width for t in range(len(self.trees))]

    def predict_many(self, rows: Sequence[Sequence[float]]) -> list[float]:
        """Several rows at once: vectorised when numpy is already loaded (the daemon), else a loop
        (gsbatch, which must not pay numpy's import for a handful of rows)."""
        if sys.modules.get("numpy") is None or len(rows) < 2:
            return [self.predict(x) for x in rows]
        if self._arrays is None:
            self._arrays = StackedTrees([self])
        return self._arrays.predict_many(rows)[0]

    def predict(self, x: Sequence[float]) -> float:
        """One row: the leaves summed in tree order (the same float as a loop over the splits, which a
        test keeps as the reference), with one bisection per feature instead of a test per split."""
        if self._packed is None:
            self._packed = self._pack()
        features, width, leaves, offsets = self._packed
        bits = 0
        for feature, borders, cumulative in features:  # x > border for the k smallest borders
            bits |= cumulative[bisect.bisect_left(borders, x[feature])]
        raw = bits.to_bytes(len(offsets) * width // 8, "little")
        index = raw if width == 8 else memoryview(raw).cast("H")
        total = functools.reduce(operator.add, map(leaves.__getitem__, map(operator.add, offsets, index)), 0.0)
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


class StackedTrees:
    """Several ensembles evaluated in one numpy pass (the daemon: peak memory, runtime and its upper
    quantile of a job on every candidate shape). At a few rows the pass costs what numpy's calls
    cost, not the arithmetic: one gather, comparison and leaf lookup for all the trees at once
    took a third of one pass per ensemble. Each ensemble's leaves are still added tree by tree,
    in order, so every value is the float ``TreeEnsemble.predict`` gives (tests/test_bundle.py)."""

    def __init__(self, ensembles: Sequence[TreeEnsemble]) -> None:
        """Only where numpy is loaded already (pipeline/ imports nothing outside the standard library)."""
        np = sys.modules["numpy"]
        trees = [tree for e in ensembles for tree in e.trees]
        depth = max(len(splits) for splits, _ in trees)
        feats = np.zeros((len(trees), depth), dtype=np.intp)
        borders = np.full((len(trees), depth), np.inf)  # a shallower tree's missing splits: never above
        leaves = np.zeros((len(trees), 1 << depth))
        for t, (splits, values) in enumerate(trees):
            for b, (feature, border) in enumerate(splits):
                feats[t, b], borders[t, b] = feature, border
            leaves[t, :len(values)] = values
        self.shape, self.feats, self.borders = (len(trees), depth), feats.ravel(), borders.ravel()
        self.bits, self.leaves = 1 << np.arange(depth), leaves.ravel()
        self.offsets = (np.arange(len(trees)) << depth)[:, None]  # each tree's first leaf in ``leaves``
        ends = list(itertools.accumulate(len(e.trees) for e in ensembles))
        self.parts = [(e.scale, e.bias, end - len(e.trees), end) for e, end in zip(ensembles, ends, strict=True)]

    def predict_many(self, rows: Sequence[Sequence[float]]) -> list[list[float]]:
        """Each ensemble's predictions for the rows, in the order the ensembles were given."""
        x = sys.modules["numpy"].asarray(rows, dtype=float)
        above = (x.take(self.feats, axis=1) > self.borders).reshape(len(rows), *self.shape)
        values = self.leaves.take(above.dot(self.bits).T + self.offsets)  # trees x rows
        # cumsum adds in order whatever the shape: sum over one row's contiguous column adds pairwise
        return [list(scale * values[start:end].cumsum(axis=0)[-1] + bias) for scale, bias, start, end in self.parts]


def analytic_base_mib(f: Mapping[str, float]) -> float:
    """A physics-style estimate of per-GPU peak memory for a family with no history.

    Weights, gradients and Adam state by precision (LoRA trains ~1% of the weights; ZeRO shards
    optimizer state and gradients), activations linear in tokens, plus framework overhead.
    """
    params = f["params_b"] * 1e9
    wbytes, state = _weight_bytes(f), _state_bytes(f)
    if f["zero"] >= 1:
        state /= max(f["gpus"], 1.0)
    act_per_token = 2e3 * math.sqrt(max(params, 1e6)) / 1e3 * (0.3 if f["ckpt"] else 1.0)
    activations = act_per_token * math.exp(f["log_tokens"]) * f["precision_bits"] / 8
    return (params * wbytes + state + activations) / 2**20 + 800.0


def zero_shift_mib(f: Mapping[str, float], gpus: float) -> float:
    """What a ZeRO job's per-GPU peak sheds against one GPU's: its gradients and optimizer state
    (``analytic_base_mib``'s state term) split over GPUS rather than held whole; 0 without ZeRO.
    A family's peaks are kept as one GPU's (training adds this to each measured peak), so runs on
    2 and on 8 GPUs fit one line: a 13B ZeRO-2 family measured on 2 GPUs was predicted 124 GiB
    per GPU on 8, where it peaks at 52-63 GiB, and its jobs were moved off 80 GiB cards."""
    if not f.get("zero") or gpus <= 1:
        return 0.0
    return _state_bytes(f) / 2**20 * (1.0 - 1.0 / gpus)


def _weight_bytes(f: Mapping[str, float]) -> float:
    """Bytes per weight: int8, else by precision."""
    return 1.0 if f.get("int8") else f.get("precision_bits", 32.0) / 8


def _state_bytes(f: Mapping[str, float]) -> float:
    """Gradients and Adam state of the trainable weights (LoRA trains ~1% of them), held whole: what
    ZeRO shards over the GPUs."""
    return f.get("params_b", 0.0) * 1e9 * (0.01 if f.get("lora") else 1.0) * (_weight_bytes(f) + 12.0)


def family_base_mib(f: Mapping[str, float], fam: Mapping[str, float]) -> float | None:
    """Per-family linear base a + b*tokens (b >= 0) from history, at the job's GPU count
    (``zero_shift_mib``, where the family's peaks were kept as one GPU's); None without a measured
    peak (a history of outcomes alone: the analytic base then stands)."""
    if not measured(fam):
        return None
    one = one_gpu_base(f, fam)
    if not fam.get("zero_one_gpu"):
        return one
    return max(one - zero_shift_mib(f, f.get("gpus", 1.0)), 1.0)


def one_gpu_base(f: Mapping[str, float], fam: Mapping[str, float]) -> float:
    tokens = math.exp(f["log_tokens"])
    a, b = fam.get("a", 0.0), fam.get("b", 0.0)
    floor = fam.get("peak_at_tokens_min", 0.0)  # memory never shrinks as tokens grow
    if b > 0:
        return max(a + b * tokens, floor) if tokens >= fam.get("tokens_min", 0.0) else max(floor, 1.0)
    # One batch size seen: scale the peak as if it all grew with tokens (a safe upper bound).
    peak, t0 = math.exp(fam["log_peak_max"]), math.exp(fam["log_tokens_at_max"])
    return peak * max(tokens / t0, 1.0) if t0 > 0 else peak


def _along(points: Mapping[float, float], x: float, upper: bool = False, linear: bool = False) -> float:
    """A positive quantity at size X from its values at other sizes, on log-log axes: between the
    nearest sizes when X lies among them, else from the nearest end along the least-squares slope,
    never below the largest size's value beyond it. With UPPER, never below the nearest sizes'
    values: among them the larger of the two, beyond either end that end's (a per-activation cost,
    which zigzags between sizes and is highest in the smallest models). With LINEAR, on
    linear axes (a constant plus so much per parameter, which log axes bend), and below the smallest
    size never below its value scaled down in proportion."""
    xs = sorted(points)
    axis = (lambda v: v) if linear else math.log
    lx, ly = [axis(v) for v in xs], [axis(points[v]) for v in xs]
    at = axis(x)
    if lx[0] <= at <= lx[-1]:
        i = max(j for j in range(len(lx) - 1) if lx[j] <= at)
        step = (at - lx[i]) / (lx[i + 1] - lx[i])
        y = max(ly[i], ly[i + 1]) if upper and step > 0 else ly[i] + step * (ly[i + 1] - ly[i])
    else:
        fitted = slope(zip(lx, ly, strict=True))
        end = -1 if at > lx[-1] else 0
        rise = max(fitted, 0.0) if end == -1 or not upper else min(fitted, 0.0)
        y = ly[end] + rise * (at - lx[end])
        if linear and end == 0:
            return max(y, points[xs[0]] * x / xs[0])
    return y if linear else math.exp(min(y, 700.0))


def arch_base_mib(f: Mapping[str, float], siblings: Sequence[Mapping[str, Any]],
                  script: Mapping[str, Any]) -> float | None:
    """A model size never run, from the measured peaks of other sizes of the same architecture.

    Where the model and two or more fitted sizes have published sizes (``model_sizes``), the fixed
    part a is carried along the parameter count on linear axes (a constant plus so many bytes per
    parameter), and the per-token part b as a cost per activation along the activation count, the
    larger of the two nearest sizes' (it zigzags between sizes: an interpolated cost made the 95%
    margin of a size among others 1.8x as wide, 0.088 against 0.048 on the log, over the timm sweep
    with each size left out in turn). Else sizes are placed by ``scale`` (features.name_scale:
    the depth a CNN's name gives, else the parameter count): with two or more sizes fitted as
    a + b*tokens, a and b are each carried to the job's size (``_along``); else the sizes' peaks at
    this job's tokens are; one size alone is scaled as the analytic estimate scales between the two
    parameter counts. None when no sibling has a measured peak."""
    tokens = math.exp(f["log_tokens"])
    own = published_counts(script)
    if own is not None and placed_by_size(siblings, script) is not None:
        (params, acts), fits = own, sized_fits(siblings)
        return (_along({p: a for p, _, a, _ in fits}, params, linear=True)
                + _along({x: b / x for _, x, _, b in fits}, acts, upper=True) * acts * tokens)
    scale = size_scale(script)
    linear = linear_fits(siblings)
    if len(linear) >= 2 and scale > 0:
        return _along({k: a for k, (a, _) in linear.items()}, scale) + \
            _along({k: b for k, (_, b) in linear.items()}, scale) * tokens
    points: dict[float, float] = {}
    sizes: dict[float, float] = {}
    for fam in siblings:
        base, at = family_base_mib(f, fam), fam.get("scale", 0.0)
        if base and base > 0 and at > 0:
            points[at] = max(points.get(at, 0.0), base)
            sizes[at] = fam.get("params_b", f["params_b"])
    if not points or scale <= 0:
        return None
    if len(points) == 1:
        (at, peak), = points.items()
        return peak * analytic_base_mib(f) / analytic_base_mib({**f, "params_b": sizes[at]})
    return _along(points, scale)


_BASE_KIND, _FAM_N, _LOG_TOKENS = NUMERIC.index("base_kind"), NUMERIC.index("fam_n"), NUMERIC.index("log_tokens")


# A family whose own line has foretold each of its recent peaks within this (log) is calibrated apart:
# most families' peaks follow their line exactly (the same program at another batch), and one margin
# wide enough for those whose peaks do not (hidden arguments, data-dependent shapes) put every bound
# about 20% over (the demo: 0.0% of 347 held-out peaks under, the bound's median error 19.7%).
TIGHT_LINE = 0.005
TIGHT_AFTER = 3  # its last so many peaks, each foretold so: a line once wrong (a batch size never seen) may settle


def memory_stratum(x: Sequence[float], fam: Mapping[str, float] | None = None) -> str:
    """What a memory estimate rests on, for its calibrated margin: the base kind (features'
    ``base_kind``) and, for the family's own peaks, how many earlier jobs (1, 2, 3 or more) and,
    after 3, ``:tight`` where its line has foretold its last TIGHT_AFTER peaks within TIGHT_LINE and the
    job's tokens are within those it ran (``fam``: the family's history as the estimate read it; a
    larger batch is extrapolated along the line, below the smallest the peak there bounds it)."""
    kind = int(x[_BASE_KIND])
    if kind != 3:
        return f"{kind}"
    stratum = f"{kind}:{min(int(x[_FAM_N]), 3)}"
    if stratum == "3:3" and fam is not None and fam.get("line_n", 0.0) >= TIGHT_AFTER \
            and fam.get("line_err", math.inf) <= TIGHT_LINE \
            and x[_LOG_TOKENS] <= fam.get("log_tokens_at_max", -math.inf) + 1e-9:
        return f"{stratum}:tight"
    return stratum


def site_base_mib(f: Mapping[str, float], script: Mapping[str, Any], line: CountsLine | None) -> float | None:
    """A model whose architecture never ran, by its published counts along the site's line
    (``features.counts_line``); None without the line or the counts."""
    counts = published_counts(script)
    if line is None or counts is None:
        return None
    params, acts = counts
    return line.fixed + line.per_param * params + line.per_act * acts * math.exp(f["log_tokens"])


def memory_base_mib(f: Mapping[str, float], script: Mapping[str, Any], history: HistoryStats) -> float:
    """The estimate the memory model's learned ratio multiplies (``base_kind`` in the features says
    which): the family's own peaks, else its architecture's other sizes, else the site's models by
    their published counts, else the analytic prior."""
    if f["base_kind"] == SITE_KIND:  # neither the family nor its architecture has measured peaks
        measured_base = site_base_mib(f, script, history.counts_line(f["precision_bits"]))
    else:
        measured_base = (family_base_mib(f, history.family(script["family"]))
                         or arch_base_mib(f, history.siblings(script), script))
    return on_card(measured_base, f.get(TYPE_OFFSET, 0.0)) if measured_base else analytic_base_mib(f)


def on_card(base: float, offset_mib: float) -> float:
    """An estimate made of measured peaks (kept without their cards' offsets) on the job's card:
    plus its offset (``features.TYPE_OFFSET``), never below 1 MiB."""
    return max(base + offset_mib, 1.0)


def _offset(value: Any, where: str) -> float:
    """A calibrated margin (log): never negative (training never lowers an estimate), at most 20."""
    v = _number(value, where)
    if not 0.0 <= v <= 20.0:
        raise ModelFileError(f"{where}: {v:g} is not a margin (0 to 20)")
    return v


def _no_constant(name: str) -> float:
    raise ModelFileError(f"{name} in the model file: every number must be finite")


# Family numbers that are exponentiated (math.exp overflows past ~709) or required by family_base_mib.
_LOG_FIELDS = ("log_peak_max", "log_tokens_at_max", "log_peak_mean")
# Sizes and counts: a negative one would make an estimate zero or negative ("fits" everywhere).
_NON_NEGATIVE = ("n", "params_b", "params_m", "acts_m", "scale", "tokens_min", "peak_at_tokens_min", "b", "line_n",
                 "line_err")


def _stats(value: Any, where: str) -> dict[str, Mapping[str, Any]]:
    """Per-family statistics: numbers, and the "shapes" the family ran on (a list of str)."""
    out: dict[str, Mapping[str, Any]] = {}
    for key, stats in _table(value, where).items():
        here = f"{where}[{json.dumps(key)[:40]}]"
        for name, v in _table(stats, here).items():
            if name == "shapes":
                if not all(isinstance(s, str) for s in _items(v, f"{here}.shapes")):
                    raise ModelFileError(f"{here}.shapes: expected a list of strings")
            elif (name in _LOG_FIELDS or name.startswith(RATE)) and abs(_number(v, f"{here}.{name}")) > 700:
                raise ModelFileError(f"{here}.{name}: {v:g} is not a logarithm of any real size")
            elif name in _NON_NEGATIVE and _number(v, f"{here}.{name}") < 0:
                raise ModelFileError(f"{here}.{name}: {v:g} is negative")
            else:
                _number(v, f"{here}.{name}")
        if stats.get("n", 0) >= 1 and stats.get("b", 0.0) <= 0:
            missing = [k for k in _LOG_FIELDS[:2] if k not in stats]
            if missing:
                raise ModelFileError(f"{here}: {', '.join(missing)} missing")
        out[key] = stats
    return out


def _digest(data: bytes) -> str:
    """A bundle file's version name: the first 12 hex digits of its bytes' sha256."""
    return hexdigest("sha256", data)[:12]


class Prediction(NamedTuple):
    peak_mem_mib: float  # per GPU, at the model's quantile
    runtime_s: float  # the median
    runtime_upper_s: float = 0.0  # the 95th percentile (0: a bundle without that model)


class Bundle:
    """A trained model version: trees, feature list, history snapshot, metrics."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        """Check the whole bundle; every way it can be wrong is a ModelFileError (a ValueError)."""
        data = _table(data, "model file")
        if data.get("version") != BUNDLE_VERSION:
            raise ModelFileError(f"model bundle version {json.dumps(data.get('version'))[:40]}, "
                                 f"this code reads {BUNDLE_VERSION}")
        if data.get("features") != list(NUMERIC):
            raise ModelFileError("model was trained with other features than this code builds (stale model): retrain")
        self.data = dict(data)
        self._digest: str | None = None
        self._stacked: StackedTrees | None = None  # the three ensembles in one numpy pass, once needed
        self.memory = TreeEnsemble(data.get("memory"), "memory")
        memory = _table(data.get("memory"), "memory")
        self.memory_offsets = {str(k): _offset(v, f"memory.offsets[{k[:20]}]")
                               for k, v in _table(memory.get("offsets", {}), "memory.offsets").items()}
        self.memory_default_offset = _offset(memory.get("default_offset", 0.0), "memory.default_offset")
        self.memory_tree_strata = frozenset(str(k) for k in _items(memory.get("tree_strata", []), "memory.tree_strata"))
        self.runtime = TreeEnsemble(data.get("runtime"), "runtime")
        history = _table(data.get("history"), "history")
        # Per-family history only: a bundle is world-readable, so it carries nothing per user.
        families = _stats(history.get("families"), "history.families")
        archs = {}
        for arch, members in _table(history.get("archs", {}), "history.archs").items():
            if not all(isinstance(m, str) and m in families for m in _items(members, f"history.archs[{arch[:40]}]")):
                raise ModelFileError(f"history.archs[{json.dumps(arch)[:40]}]: expected a list of family keys")
            archs[arch] = list(members)
        offsets = {str(k): _number(v, f"history.type_offsets[{str(k)[:20]}]")
                   for k, v in _table(history.get("type_offsets", {}), "history.type_offsets").items()}
        if any(abs(v) > MAX_TYPE_OFFSET_MIB for v in offsets.values()):
            raise ModelFileError(f"history.type_offsets: an offset beyond {MAX_TYPE_OFFSET_MIB:g} MiB")
        self.history = HistoryStats(families, archs, whole=True, type_offsets=offsets)
        # How far above its prediction a runtime ran on newer jobs (log, 95th percentile): the margin
        # a changed request keeps to its time limit. Older bundles have none.
        self.runtime_spread = max(_number(data.get("runtime_spread", 0.0), "runtime_spread"), 0.0)
        # The 95th-percentile run time over the median (quantile trees, log): the time-limit test's
        # margin per job. A bundle without it: the single runtime_spread margin stands.
        self.runtime_upper = TreeEnsemble(data["runtime_upper"], "runtime_upper") if "runtime_upper" in data else None
        # "telemetry": a memory model of measured peaks; "outcomes": none measured, the decider moves
        # a job only to cards its family's outcomes show it holds on (HistoryStats.held_bound_gib).
        self.memory_source = data.get("memory_source", "telemetry")
        if self.memory_source not in ("telemetry", "outcomes"):
            raise ModelFileError(f"memory_source: {json.dumps(self.memory_source)[:40]} is not telemetry or outcomes")
        self.quantile = _number(data.get("quantile"), "quantile")
        if not 0.0 < self.quantile < 1.0:
            raise ModelFileError(f"quantile: must be between 0 and 1, got {self.quantile:g}")

    @property
    def digest(self) -> str:
        """Which model made a decision (lineage): the first 12 hex digits of the sha256 of the
        bundle file's bytes (what ``save`` writes), so a version is named the same everywhere."""
        if self._digest is None:
            self._digest = _digest(self._bytes())
        return self._digest

    def _bytes(self) -> bytes:
        return json.dumps(self.data, separators=(",", ":")).encode()

    @classmethod
    def load(cls, path: str) -> Bundle:
        """Read and check a model file; any unreadable or malformed file raises OSError or ValueError
        (a FIFO, a device or a file over MAX_BUNDLE_BYTES too, unread: gsbatch never hangs on one)."""
        data = read_regular(path, MAX_BUNDLE_BYTES)
        try:
            bundle = cls(json.loads(data.decode("utf-8"), parse_constant=_no_constant))
            bundle._digest = _digest(data)
            return bundle
        except UnicodeDecodeError as exc:
            raise ModelFileError(f"not UTF-8 text at byte {exc.start}") from None
        except json.JSONDecodeError as exc:
            raise ModelFileError(f"not JSON ({'truncated' if exc.pos >= len(exc.doc) else exc.msg}, "
                                 f"line {exc.lineno} column {exc.colno})") from None
        except RecursionError:
            raise ModelFileError("not a model bundle: nested too deeply") from None

    def save(self, path: str) -> None:
        from slurmgpu.pipeline.spool import atomic_write

        data = self._bytes()
        atomic_write(path, data, 0o644)
        self._digest = _digest(data)  # data may have changed since the last digest

    def predict(self, f: Mapping[str, float], script: Mapping[str, Any]) -> Prediction:
        return self.predict_many([f], script)[0]

    def predict_many(self, rows: Sequence[Mapping[str, float]], script: Mapping[str, Any]) -> list[Prediction]:
        """Per-GPU peak and runtime of one job (``script``: its script_features) on several shapes."""
        xs = [[f[name] for name in NUMERIC] for f in rows]
        bases = [memory_base_mib(f, script, self.history) for f in rows]
        ensembles = [self.memory, self.runtime] + ([self.runtime_upper] if self.runtime_upper is not None else [])
        if sys.modules.get("numpy") is None:  # gsbatch: numpy's import costs more than a loop
            predicted = [e.predict_many(xs) for e in ensembles]
        else:
            if self._stacked is None:
                self._stacked = StackedTrees(ensembles)
            predicted = self._stacked.predict_many(xs)
        memory, runtime, *upper = predicted
        uppers = upper[0] if upper else [-math.inf] * len(xs)
        return [Prediction(self._peak(x, base, m, script), math.exp(r), math.exp(min(r + u, 700.0)))
                for x, base, m, r, u in zip(xs, bases, memory, runtime, uppers, strict=True)]

    def peak_mib(self, f: Mapping[str, float], script: Mapping[str, Any]) -> float:
        """``predict(f, script).peak_mem_mib`` from the memory trees alone: a search over batch sizes
        needs no runtimes."""
        x = [f[name] for name in NUMERIC]
        return self._peak(x, memory_base_mib(f, script, self.history), self.memory.predict(x), script)

    def peak_estimate_mib(self, f: Mapping[str, float], script: Mapping[str, Any]) -> float:
        """The peak before the margin its stratum was calibrated to (``memory_parts``): the estimate
        itself, which ``peak_mib`` bounds from above (a stratum's margin covers its worst misses)."""
        x = [f[name] for name in NUMERIC]
        return self._peak(x, memory_base_mib(f, script, self.history), self.memory.predict(x), script, margin=False)

    def _peak(self, x: Sequence[float], base: float, trees: float, script: Mapping[str, Any],
              margin: bool = True) -> float:
        """The bound (``margin``: with the stratum's calibrated margin), else the estimate under it."""
        used, added = self.memory_parts(x, trees, script.get("arch"), self.history.family(script["family"]))
        return base * math.exp(used + added if margin else used)

    def memory_ratio(self, x: Sequence[float], trees: float, arch: str | None = None,
                     fam: Mapping[str, float] | None = None) -> float:
        """Log of peak / estimate for the job's stratum (``memory_stratum``; ``fam``: the family's
        history): the trees' ratio where calibration chose them, plus the stratum's calibrated margin
        (its architecture's own, where training measured one). A tight family's job takes the smaller
        of its stratum's ratio and that of its family's jobs at large (``fam`` None), so that a batch
        past the tight range never needs less (the trees are monotone, the margins constant)."""
        used, margin = self.memory_parts(x, trees, arch, fam)
        return used + margin

    def memory_parts(self, x: Sequence[float], trees: float, arch: str | None = None,
                     fam: Mapping[str, float] | None = None) -> tuple[float, float]:
        """``memory_ratio`` in its two parts: the trees' ratio as used (0 where calibration chose
        none) and the calibrated margin added to it."""
        stratum = memory_stratum(x, fam)
        tight = stratum.endswith(":tight")
        if f"{stratum}@{arch}" in self.memory_offsets:
            return 0.0, self.memory_offsets[f"{stratum}@{arch}"]
        if stratum not in self.memory_offsets:  # the trees never saw the site's line (features.SITE_KIND)
            return self.memory_parts(x, trees, arch) if tight else (
                0.0 if x[_BASE_KIND] == SITE_KIND else trees, self.memory_default_offset)
        parts = (trees if stratum in self.memory_tree_strata else 0.0, self.memory_offsets[stratum])
        return min(parts, self.memory_parts(x, trees, arch), key=sum) if tight else parts
