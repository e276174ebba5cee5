"""How much GPU memory a job needs and how long it runs on a given GPU type and count.

Memory is counted the way the ZeRO paper does (weights, gradients, optimizer state by precision
and optimizer, split over GPUs by ZeRO stage) plus activations linear in batch size (and sequence
length, by Korthikanti et al.'s per-layer formula for transformers) plus a fixed framework
overhead. Time per step is a roofline: the larger of compute time at an achieved share of the
card's peak and memory-traffic time at an achieved share of its bandwidth, plus time per step that
keeps no GPU busy. That last term and the bandwidth bound are why an older or cheaper card is
sometimes nearly as good. Data-parallel GPUs scale by ``dp_scaling`` per doubling. Every constant
comes from ``data.toml``; the frozen parts of a diffusion model (text encoder, VAE) count for
memory but not for time.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from slurmgpu.simulation.workload.catalog import Catalog, Family, GpuSpec, ModelSpec, load_catalog
from slurmgpu.simulation.workload.jobs import JobSpec

MIB = 1024 * 1024


class _Shape(NamedTuple):
    """Per-GPU quantities of one job on k GPUs, independent of the GPU type."""

    family: Family
    model: ModelSpec
    static_bytes: float  # weights, gradients, optimizer state held on each GPU
    act_bytes: float  # activations (or KV cache) for one sample
    fwd_flops: float  # forward FLOPs for one sample
    passes: float  # forward-pass equivalents per training step (1 for inference)


def used_gpus(job: JobSpec, gpus: int) -> int:
    """GPUs the program drives: never more than its process count, and a multi-process launch
    given fewer GPUs than it asks for is assumed to be launched on what it got."""
    return max(1, min(gpus, job.params["nproc"]))


def _area(model: ModelSpec, p: dict[str, Any]) -> float:
    """Input area relative to the model's reference size (1 for fixed-size inputs)."""
    return (p["image_size"] / model.ref_size) ** 2 if model.ref_size else 1.0


def _trained_frozen(model: ModelSpec, p: dict[str, Any]) -> tuple[float, float]:
    """Trained and frozen parameter counts; LoRA trains adapters on q_proj and v_proj (the PEFT default)."""
    total, frozen = model.params_m * 1e6, model.frozen_params_m * 1e6
    if not p.get("lora"):
        return total, frozen
    if model.kind == "transformer":
        adapters = model.layers * 2 * p["lora_r"] * 2 * model.hidden  # A: h x r and B: r x h, per adapted matrix
    else:
        adapters = model.lora_params_m * 1e6
    return adapters, total + frozen


def _activations(model: ModelSpec, family: Family, p: dict[str, Any], cat: Catalog) -> float:
    """Bytes kept per sample: for backward (training), a working set (inference) or KV cache (generation)."""
    width = 2 if p["precision"] == "fp32" else 1  # the formulas below are for 16-bit activations
    lora = cat.value("lora_activation_factor") if p.get("lora") else 1.0
    train = family.mode == "train"
    if model.kind == "transformer":
        s, h = p["seq_len"], model.hidden
        scores = 0 if model.flash else 5 * model.heads * s / h
        layer = s * h * (34 + scores) * lora
        if not train:
            kept, positions = 2 * layer, 1
        elif p.get("grad_ckpt"):
            kept, positions = model.layers * 2 * s * h + layer, s
        else:
            kept, positions = model.layers * layer, s
        act = kept * width + positions * model.vocab * cat.value("logits_bytes")
    else:
        act = model.act_mb_per_sample * 1e6 * _area(model, p) * width * lora
        if p.get("grad_ckpt"):
            act *= cat.value("ckpt_activation_factor")
        if not train:
            act *= cat.value("infer_activation_factor")
    if family.mode == "generate":
        head_dim = model.hidden / model.heads
        act += 2 * model.layers * model.kv_heads * head_dim * (p["seq_len"] + p["gen_tokens"]) * 2 * width
    return act


def _shape(job: JobSpec, k: int, cat: Catalog) -> _Shape:
    p, family = job.params, cat.families[job.family]
    model = cat.models[p["model"]]
    trained, frozen = _trained_frozen(model, p)
    fp32 = p["precision"] == "fp32"
    width = 4 if fp32 else 2
    if family.mode == "train":
        opt = cat.optimizers[family.optimizer]
        w, g, o = opt.fp32 if fp32 else opt.mixed
        zero = p.get("zero", 0)

        def split(stage: int) -> int:
            return k if zero >= stage else 1

        static = trained * (w / split(3) + g / split(2) + o / split(1)) + frozen * width / split(3)
        passes: float = 1 + (1 if p.get("lora") else 2) + (cat.value("recompute_flops") if p.get("grad_ckpt") else 0)
    else:
        static, passes = (trained + frozen) * width, 1.0
    if model.kind == "transformer":
        fwd = 2 * model.params_m * 1e6 * p["seq_len"]  # Kaplan et al., 2020: ~2N FLOPs per token
    else:
        fwd = 2 * model.gmacs_per_sample * 1e9 * _area(model, p)
    return _Shape(family, model, static, _activations(model, family, p, cat), fwd, passes)


def peak_mem_mib(job: JobSpec, gpu_type: str, gpus: int) -> float:
    """Peak memory on each GPU the program uses, as NVML would show it.

    The same program allocates the same tensors on any card, so the type only has to exist.
    """
    cat = load_catalog()
    if gpu_type not in cat.gpu_types:
        raise KeyError(f"unknown GPU type {gpu_type!r}")
    sh = _shape(job, used_gpus(job, gpus), cat)
    tensors = (sh.static_bytes + job.params["batch_size"] * sh.act_bytes) * (1 + cat.value("allocator_slack"))
    return tensors / MIB + cat.value("framework_overhead_gib") * 1024


def fits(job: JobSpec, gpu_type: str, gpus: int) -> bool:
    """Whether the peak fits the card's memory (a job that does not fit fails at its first step)."""
    return peak_mem_mib(job, gpu_type, gpus) <= load_catalog().gpu_types[gpu_type].memory_mib


class StepTime(NamedTuple):
    step_s: float  # one step of one process, batch_size samples
    busy_s: float  # of which the GPU runs kernels


def step_time(job: JobSpec, gpu: GpuSpec, k: int, cat: Catalog) -> StepTime:
    """One step (a batch per GPU; one batch of prompts for generation) on ``gpu``, before scaling losses."""
    sh = _shape(job, k, cat)
    p, fam = job.params, sh.family
    b = p["batch_size"]
    flops_rate = gpu.peak_tflops(p["precision"], sh.model.conv) * 1e12 * fam.compute_eff
    bytes_rate = gpu.mem_bw_gbs * 1e9 * cat.value("bw_eff")
    idle = (fam.overhead_ms + fam.host_ms_per_sample * b) / 1000
    if fam.mode == "generate":
        token_flops = 2 * sh.model.params_m * 1e6 * b
        prefill = max(b * sh.fwd_flops / flops_rate, sh.static_bytes / bytes_rate)
        token = max(token_flops / flops_rate, (sh.static_bytes + b * sh.act_bytes) / bytes_rate)
        busy = prefill + p["gen_tokens"] * token
        idle += p["gen_tokens"] * fam.token_overhead_ms / 1000
    else:
        traffic = (cat.value("param_traffic") * sh.static_bytes + cat.value("act_traffic") * b * sh.act_bytes
                   if fam.mode == "train" else sh.static_bytes + 2 * b * sh.act_bytes)
        busy = max(sh.passes * b * sh.fwd_flops / flops_rate, traffic / bytes_rate)
    return StepTime(busy + idle, busy)


def _dp_efficiency(job: JobSpec, k: int, cat: Catalog) -> float:
    """Throughput kept on k data-parallel GPUs: scaling ** log2(k)."""
    scaling = cat.families[job.family].dp_scaling
    if job.params.get("zero", 0) >= 3:
        scaling = min(scaling, cat.value("zero3_scaling"))
    return scaling ** math.log2(k)


class RunModel(NamedTuple):
    startup_s: float  # loading code, data and checkpoints; the GPUs idle
    step_s: float  # one step on the GPUs used, communication included
    steps: float  # steps on the GPUs used
    busy: float  # share of a step the GPUs run kernels (NCCL communication counts, as for NVML)

    @property
    def runtime_s(self) -> float:
        return self.startup_s + self.steps * self.step_s

    def util(self, elapsed_s: float) -> float:
        """Mean utilisation (percent) over the first ``elapsed_s`` seconds of the run."""
        return 100 * self.busy * max(0.0, elapsed_s - self.startup_s) / elapsed_s if elapsed_s > 0 else 0.0


def run_model(job: JobSpec, gpu_type: str, gpus: int) -> RunModel:
    """The job's fixed amount of work (steps x nproc micro-batches) spread over the GPUs it uses."""
    cat = load_catalog()
    k = used_gpus(job, gpus)
    st = step_time(job, cat.gpu_types[gpu_type], k, cat)
    per_step = st.step_s / _dp_efficiency(job, k, cat)
    return RunModel(cat.families[job.family].startup_s, per_step, job.params["steps"] * job.params["nproc"] / k,
                    (st.busy_s + per_step - st.step_s) / per_step)


def runtime_s(job: JobSpec, gpu_type: str, gpus: int) -> float:
    return run_model(job, gpu_type, gpus).runtime_s


def host_rss_mib(job: JobSpec, gpus: int) -> float:
    """Host memory the job's processes use together."""
    return load_catalog().families[job.family].host_gib_per_proc * 1024 * used_gpus(job, gpus)
