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

import functools
import re
from typing import NamedTuple

# Longest fragments first, so "a100" is not read as "a10" and "rtx_a6000" not as "a6000"'s cousins.
_BF16 = {
    "h200": True, "h100": True, "gh200": True, "b200": True, "l40s": True, "l40": True, "l4": True,
    "a100": True, "a800": True, "a40": True, "a30": True, "a16": True, "a10": True, "a6000": True, "a5000": True,
    "a4500": True, "a4000": True, "rtx_30": True, "rtx30": True, "rtx_40": True, "rtx40": True, "3090": True,
    "4090": True, "v100": False, "t4": False, "titan_v": False, "titanv": False, "rtx_20": False, "rtx20": False,
    "2080": False, "p100": False, "p40": False, "p4": False, "k80": False, "k40": False, "m60": False,
}
_ORDER = sorted(_BF16, key=len, reverse=True)


@functools.lru_cache(maxsize=1024)  # the daemon asks per candidate type and request: 36 searches each time
def supports_bf16(gpu_type: str) -> bool | None:
    """True or False for a known NVIDIA architecture in the type's name; None when unknown."""
    name = gpu_type.lower()
    for fragment in _ORDER:
        if re.search(rf"(?<![a-z0-9]){re.escape(fragment)}(?![0-9])", name):
            return _BF16[fragment]
    return None


# A MIG instance as gres.conf types are usually written from nvidia-smi's profile names: the card,
# then "<compute slices>g.<memory>gb" (``a100_1g.10gb``, ``h100-3g.40gb``). An A30 has 4 compute
# slices; A100, H100, H200 and B200 have 7.
_MIG = re.compile(r"^(?P<card>[a-z0-9][a-z0-9_.-]*?)[_-](?P<g>[1-7])g\.(?P<gb>\d+)gb$")
_SLICES = {"a30": 4}


class MigProfile(NamedTuple):
    card: str  # the gres type of the whole card, as the name says it
    compute_fraction: float
    memory_gib: float  # the profile's size in GB, taken as GiB (the instances hold slightly less)


def mig_profile(gpu_type: str) -> MigProfile | None:
    """What a MIG type's name says of it; None for a name that does not follow the profile form."""
    m = _MIG.match(gpu_type.lower())
    if m is None:
        return None
    card = gpu_type[: m.end("card")]
    slices = next((n for frag, n in _SLICES.items() if card.lower().startswith(frag)), 7)
    return MigProfile(card, min(int(m["g"]) / slices, 1.0), float(m["gb"]))
