"""A ZeRO family's per-GPU peak at another GPU count: its gradients and optimizer state shard."""

from __future__ import annotations

import pytest

from slurmgpu.learning.train import _Running
from slurmgpu.pipeline.bundle import family_base_mib, zero_shift_mib
from slurmgpu.pipeline.features import job_features, script_features

GB = 1e9 / 2**20  # MiB in the paper's GB


def test_shift_matches_the_zero_papers_model_state_figures() -> None:
    """Rajbhandari et al., ZeRO (SC'20), Figure 1: a 7.5B-parameter model trained in mixed precision
    with Adam (K = 12) on 64 GPUs holds 120 GB of model states per GPU without ZeRO and 16.6 GB with
    optimizer state and gradients partitioned (stage 2)."""
    f = {"zero": 2.0, "params_b": 7.5, "precision_bits": 16.0, "int8": 0.0, "lora": 0.0}
    assert 120 * GB - zero_shift_mib(f, 64) == pytest.approx(16.6 * GB, rel=0.01)
    assert zero_shift_mib(f, 1) == 0.0 and zero_shift_mib({**f, "zero": 0.0}, 64) == 0.0


def script(gpus: int, zero: int) -> str:
    stage = f" --zero_stage {zero}" if zero else ""
    return (f"#!/bin/bash\n#SBATCH --gres=gpu:h200:{gpus}\ndeepspeed train.py --model_name_or_path "
            f"meta-llama/Llama-2-13b-hf{stage} --bf16 --per_device_train_batch_size 4 --max_seq_length 2048\n")


def truth_mib(gpus: int, zero: int) -> float:
    """Weights, then gradients and Adam state (sharded under ZeRO-2), then 9 GiB of activations."""
    params = 13e9
    return (2 * params + 14 * params / (gpus if zero else 1)) / 2**20 + 9 * 1024


@pytest.mark.parametrize("zero", [0, 2])
def test_a_family_measured_on_two_gpus_is_estimated_at_eight(zero: int) -> None:
    running = _Running()
    for _ in range(3):  # its runs so far: 2 GPUs each
        feats = script_features(script(2, zero))
        running.add({"script": feats, "gpus": 2, "gpu_type": "h200", "state": "COMPLETED", "elapsed": 3600,
                     "peak": truth_mib(2, zero), "card_gib": 141.0})
    history = running.snapshot()
    feats = script_features(script(8, zero))
    fam = history.family(feats["family"])
    at = {g: family_base_mib(job_features(feats, {}, {"memory_gib": 141.0, "relative_speed": 1.0}, g, history),
                             fam) for g in (2, 8)}
    assert at[2] == pytest.approx(truth_mib(2, zero), rel=0.001)
    # ZeRO: 8 GPUs hold a quarter of the state each (the 2-GPU peak would keep the job off 80 GiB cards)
    assert at[8] == pytest.approx(truth_mib(8, zero), rel=0.001)
    assert (at[8] < 80 * 1024) == bool(zero)
