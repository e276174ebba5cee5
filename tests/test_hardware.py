"""bf16 needs NVIDIA Ampere or newer: the decider keeps bf16 jobs on cards that run it."""

from __future__ import annotations

import pytest

from slurmgpu.pipeline.features import script_features
from slurmgpu.pipeline.hardware import supports_bf16


@pytest.mark.parametrize(("name", "bf16"), [
    ("a100", True), ("a100_80g", True), ("A100-SXM4-40GB", True), ("a10", True), ("a40", True), ("l4", True),
    ("l40s", True), ("h100", True), ("h200", True), ("rtx_a6000", True), ("rtx_3090", True),
    ("v100", False), ("v100_32g", False), ("v100-16gb", False), ("t4", False), ("p100", False), ("k80", False),
    ("rtx_2080ti", False), ("mi250", None), ("gpu", None),
])
def test_bf16_by_architecture(name: str, bf16: bool | None) -> None:
    assert supports_bf16(name) is bf16


@pytest.mark.parametrize(("command", "bf16"), [
    ("torchrun --nproc_per_node=4 train.py --bf16", 1),
    ("accelerate launch --mixed_precision bf16 train.py", 1),
    ("python train.py --torch_dtype bfloat16", 1),
    ("python train.py --fp16", 0),
    ("python train.py", 0),
])
def test_scripts_say_when_they_run_bf16(command: str, bf16: int) -> None:
    assert script_features(f"#!/bin/bash\n{command}\n")["bf16"] == bf16
