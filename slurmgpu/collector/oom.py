"""GPU out-of-memory errors in a job's stderr, where sacct cannot see them.

A GPU OOM usually ends a job FAILED with exit code 1, like any other Python error; Slurm's
OUT_OF_MEMORY state is the host-memory cgroup. The frameworks print recognisable messages, so the
epilog (or the ingest) reads the end of the job's stderr and records the outcome the learner needs:
"needed more GPU memory than the card had".
"""

from __future__ import annotations

import os
import re
import stat
from typing import NamedTuple

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
