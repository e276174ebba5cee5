"""The workload model's numbers, read from ``data.toml`` beside this file.

The numbers live in a data file rather than in code so that each one sits next to its source
(a datasheet, a paper) or its named assumption, where a reviewer can check it and change it.
"""

from __future__ import annotations

import math
import tomllib
from functools import lru_cache
from importlib.resources import files
from typing import Any, NamedTuple

PRECISIONS = ("fp32", "fp16", "bf16")
MODES = ("train", "infer", "generate")


class GpuSpec(NamedTuple):
    name: str
    memory_gib: float
    fp32_tflops: float
    fp16_tflops: float  # FP16/BF16 dense tensor peak where there are tensor cores
    mem_bw_gbs: float
    source: str
    tf32_tflops: float = 0.0  # TF32 dense tensor peak; 0 where the card has none
    bf16: bool = True
    sustained: float = 1.0  # share of the compute peak held under sustained load
    nvml_name: str = ""

    @property
    def memory_mib(self) -> float:
        return float(self.memory_gib * 1024)

    def peak_tflops(self, precision: str, conv: bool) -> float:
        """The peak a job in ``precision`` runs at: fp32 convolutions use TF32 where the card has it,
        bf16 without bf16 tensor cores runs at the FP32 rate (assumptions tf32_convs, bf16_fallback)."""
        if precision == "fp32" or (precision == "bf16" and not self.bf16):
            peak = max(self.tf32_tflops, self.fp32_tflops) if conv and precision == "fp32" else self.fp32_tflops
        else:
            peak = self.fp16_tflops
        return peak * self.sustained


class ModelSpec(NamedTuple):
    name: str
    kind: str  # "transformer" or "per_sample"
    params_m: float
    source: str
    hf_name: str = ""
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    flash: bool = False
    conv: bool = False  # convolution-bound (TF32 applies in fp32)
    frozen_params_m: float = 0.0
    lora_params_m: float = 0.0
    gmacs_per_sample: float = 0.0
    act_mb_per_sample: float = 0.0
    ref_size: int = 0

    @property
    def cli_name(self) -> str:
        """What a user writes after ``--model``."""
        return self.hf_name or self.name


class OptimizerSpec(NamedTuple):
    name: str
    mixed: tuple[float, float, float]  # bytes per trained parameter: weights, gradients, state
    fp32: tuple[float, float, float]
    source: str


class Family(NamedTuple):
    name: str
    description: str
    account: str
    share: float
    mode: str
    entry: str
    dataset: str
    models: dict[str, float]
    batch_size: dict[int, float]
    precision: dict[str, float]
    optimizer: str
    lora: float
    grad_ckpt: float
    zero: dict[int, float]
    nproc: dict[int, float]
    lr: tuple[float, ...]
    compute_eff: float
    overhead_ms: float
    host_ms_per_sample: float
    startup_s: float
    host_gib_per_proc: float
    dp_scaling: float
    runtime_median_min: float
    runtime_sigma: float
    why: str
    image_size: dict[int, float] = {}
    seq_len: dict[int, float] = {}
    gen_tokens: dict[int, float] = {}
    lora_r: dict[int, float] = {}
    token_overhead_ms: float = 0.0


class Assumption(NamedTuple):
    name: str
    value: Any  # None for an assumption that explains figures kept elsewhere in the file
    why: str


class Catalog(NamedTuple):
    gpu_types: dict[str, GpuSpec]
    models: dict[str, ModelSpec]
    optimizers: dict[str, OptimizerSpec]
    families: dict[str, Family]
    assumptions: dict[str, Assumption]

    def value(self, name: str) -> Any:
        """A named assumption's value."""
        return self.assumptions[name].value


_INT_KEYED = ("batch_size", "zero", "nproc", "image_size", "seq_len", "gen_tokens", "lora_r")


def _family(name: str, raw: dict[str, Any]) -> Family:
    fields = dict(raw)
    for key in _INT_KEYED:
        if key in fields:
            fields[key] = {int(k): float(w) for k, w in fields[key].items()}
    fields["lr"] = tuple(float(x) for x in fields["lr"])
    family = Family(name=name, **fields)
    if family.mode not in MODES or set(family.precision) - set(PRECISIONS):
        raise ValueError(f"family {name}: unknown mode or precision")
    return family


def parse_catalog(data: dict[str, Any]) -> Catalog:
    gpus = {n: GpuSpec(name=n, **g) for n, g in data["gpus"].items()}
    models = {n: ModelSpec(name=n, **m) for n, m in data["models"].items()}
    optimizers = {n: OptimizerSpec(n, tuple(o["mixed"]), tuple(o["fp32"]), o["source"])
                  for n, o in data["optimizers"].items()}
    families = {n: _family(n, f) for n, f in data["families"].items()}
    assumptions = {n: Assumption(n, a.get("value"), a["why"]) for n, a in data["assumptions"].items()}
    for fam in families.values():
        missing = [m for m in fam.models if m not in models] + [o for o in (fam.optimizer,) if o not in optimizers]
        if missing:
            raise ValueError(f"family {fam.name}: unknown {', '.join(missing)}")
    return Catalog(gpus, models, optimizers, families, assumptions)


@lru_cache(maxsize=1)
def load_catalog() -> Catalog:
    """The packaged catalog (read once per process)."""
    return parse_catalog(tomllib.loads(files("slurmgpu.simulation.workload").joinpath("data.toml").read_text("utf-8")))


REFERENCE_GPU = "A100-80"  # relative speed and cost 1


def relative_speed(spec: GpuSpec, precision: str = "fp16") -> float:
    """Geometric mean of the sustained peak a job in PRECISION runs at and memory bandwidth, relative
    to the reference card's: training steps are bound by one or the other (the workload model's
    roofline). 16-bit: the tensor peak. fp32: the TF32 tensor peak where the card has one (PyTorch's
    default for convolutions), else FP32; for FP32 matrix products it overstates an Ampere or later
    card's lead over an older one, which errs toward keeping a job off the older, slower card."""
    ref = load_catalog().gpu_types[REFERENCE_GPU]
    return math.sqrt(spec.peak_tflops(precision, conv=True) / ref.peak_tflops(precision, conv=True)
                     * spec.mem_bw_gbs / ref.mem_bw_gbs)


def relative_cost(spec: GpuSpec) -> float:
    """Half speed, half memory relative to the reference card: sites weigh a card's GPU-hour
    (TRESBillingWeights) by what it computes and what it holds; this gives the sample config's
    ratios (a100 : v100 : t4 about 1 : 0.4 : 0.2)."""
    ref = load_catalog().gpu_types[REFERENCE_GPU]
    return 0.5 * relative_speed(spec) + 0.5 * spec.memory_gib / ref.memory_gib
