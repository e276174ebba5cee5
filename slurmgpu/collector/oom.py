"""GPU out-of-memory errors in a job's stderr, where sacct cannot see them.

A GPU OOM usually ends a job FAILED with exit code 1, like any other Python error; Slurm's
OUT_OF_MEMORY state is the host-memory cgroup. The frameworks print recognisable messages, so the
epilog (or the ingest) reads the end of the job's stderr and records the outcome the learner needs:
"needed more GPU memory than the card had".

``ran_out_of_gpu_memory`` is the one definition of a GPU OOM that the learner, the report's
headline and tables, ``seff`` and the admin alerts all use.
"""

from __future__ import annotations

import os
import re
import stat
from typing import NamedTuple

# A failed job whose per-GPU peak reached this share of the card's usable memory ran out of it.
OOM_SHARE = 0.95
HOST_OOM_STATE = "OUT_OF_MEMORY"  # Slurm's host-memory cgroup, never the GPU

# The last part of stderr is read: the fatal error is at the end, and logs can be huge.
TAIL_BYTES = 1 << 20

# One pattern per framework message, tried in order; each names the framework for the record.
_PATTERNS = (
    # PyTorch: RuntimeError (1.x), torch.cuda.OutOfMemoryError (2.0-2.4), torch.OutOfMemoryError (2.5+)
    ("pytorch", re.compile(r"(?:RuntimeError|OutOfMemoryError): CUDA out of memory\. Tried to allocate")),
    # CUDA runtime errors surfaced by any framework (allocator bypassed, cuBLAS/cuDNN workspaces)
    ("cuda", re.compile(r"CUDA error: out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED")),
    # TensorFlow: only allocations on a GPU device (a CPU tensor is host memory)
    ("tensorflow", re.compile(r"OOM when allocating tensor .* on /job:[^ ]*/device:GPU:\d+", re.IGNORECASE)),
    # JAX / XLA: the whole job runs on the GPUs it was given
    ("jax", re.compile(r"RESOURCE_EXHAUSTED: (?:Out of memory while trying to allocate|Out of memory allocating|"
                       r"Failed to allocate request for .* on device ordinal)")),
)


class GpuOom(NamedTuple):
    """A GPU out-of-memory error: which framework said it, and the line that says so."""

    framework: str
    line: str


def find_gpu_oom(text: str) -> GpuOom | None:
    """The last GPU out-of-memory message in TEXT (a job's stderr), if there is one."""
    found: GpuOom | None = None
    for line in text.splitlines():
        for framework, pattern in _PATTERNS:
            if pattern.search(line):
                found = GpuOom(framework, line.strip()[:300])
                break
    return found


def scan_stderr(path: str, tail_bytes: int = TAIL_BYTES, owner: int | None = None) -> GpuOom | None:
    """Read the end of a job's stderr file safely and look for a GPU OOM there.

    The epilog runs as root on a file the user controls: only a regular file is read (no symlink,
    FIFO or device), without blocking, and only its last TAIL_BYTES; with ``owner``, only a file
    that uid owns (the job's user: a path the job names cannot make root read someone else's
    file). Anything unreadable is None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (owner is not None and info.st_uid != owner):
            return None
        os.lseek(fd, max(0, info.st_size - tail_bytes), os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return find_gpu_oom(b"".join(chunks).decode("utf-8", "replace"))
    except OSError:
        return None
    finally:
        os.close(fd)


def ran_out_of_gpu_memory(state: str, framework: str | None, peak_mib: float | None,
                          card_mib: float | None) -> bool:
    """A GPU OOM: the collector found a framework's message in stderr (whatever sacct's state but
    COMPLETED: FAILED, or TIMEOUT when the other ranks hung after one ran out; a job that completed
    caught the error), or the job FAILED with its per-GPU peak at OOM_SHARE of ``card_mib``.

    ``card_mib`` should be the usable memory NVML reports (the collector's ``memory_total_mib``),
    not the nominal size: a T4 sold as 16 GiB offers about 15 GiB, so a share of 16 GiB misses
    every T4 OOM. The nominal size (config ``gpu_types``) is the fallback without a record.
    Slurm's OUT_OF_MEMORY is host memory and is not a GPU OOM by itself."""
    if framework and state != "COMPLETED":
        return True
    return (state == "FAILED" and peak_mib is not None and card_mib is not None and card_mib > 0
            and peak_mib >= OOM_SHARE * card_mib)
