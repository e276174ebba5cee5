"""What a GPU type can run, from its name: bfloat16 needs NVIDIA Ampere or newer.

A job written for bf16 (``--bf16``, ``--mixed_precision bf16``) on a Volta, Turing, Pascal or
Kepler card either fails (no bf16 kernels) or runs emulated many times slower; the datasheets'
tensor throughput, which ``relative_speed`` comes from, is for the precisions a card does support.
So the decider never moves a bf16 job to such a card. The architectures are NVIDIA's: bf16 tensor
cores from compute capability 8.0 (A100; 8.6 A10/A40/RTX 30xx; 8.9 L4/L40/RTX 40xx; 9.0 H100/H200),
none on 7.0 (V100), 7.5 (T4, RTX 20xx), 6.x (P100, P40) and 3.7 (K80) — the same rule as PyTorch's
``torch.cuda.is_bf16_supported()``. Names are matched as gres.conf types are written (``a100``,
``a100_80g``, ``v100-32gb``, ``rtx_a6000``); a name this table does not know says nothing.
"""

from __future__ import annotations

import re

# Longest fragments first, so "a100" is not read as "a10" and "rtx_a6000" not as "a6000"'s cousins.
_BF16 = {
    "h200": True, "h100": True, "gh200": True, "b200": True, "l40s": True, "l40": True, "l4": True,
    "a100": True, "a800": True, "a40": True, "a30": True, "a16": True, "a10": True, "a6000": True, "a5000": True,
    "a4500": True, "a4000": True, "rtx_30": True, "rtx30": True, "rtx_40": True, "rtx40": True, "3090": True,
    "4090": True, "v100": False, "t4": False, "titan_v": False, "titanv": False, "rtx_20": False, "rtx20": False,
    "2080": False, "p100": False, "p40": False, "p4": False, "k80": False, "k40": False, "m60": False,
}
_ORDER = sorted(_BF16, key=len, reverse=True)


def supports_bf16(gpu_type: str) -> bool | None:
    """True or False for a known NVIDIA architecture in the type's name; None when unknown."""
    name = gpu_type.lower()
    for fragment in _ORDER:
        if re.search(rf"(?<![a-z0-9]){re.escape(fragment)}(?![0-9])", name):
            return _BF16[fragment]
    return None
