"""GPU out-of-memory detection on real framework messages (tests/fixtures/oom)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmgpu.collector.oom import find_gpu_oom, scan_stderr

OOM = Path(__file__).resolve().parent / "fixtures" / "oom"
GPU = sorted(OOM.glob("gpu-*.txt"))
NOT_GPU = sorted(OOM.glob("not-gpu-*.txt"))


def _stderr(path: Path) -> str:
    return "".join(ln for ln in path.read_text().splitlines(keepends=True) if not ln.startswith("# source:"))


@pytest.mark.parametrize("path", GPU, ids=[p.stem for p in GPU])
def test_each_framework_message_is_a_gpu_oom(path: Path) -> None:
    found = find_gpu_oom(_stderr(path))
    named = path.stem.split("-")[1]  # gpu-<framework>-...
    assert found is not None and found.framework == {"torch": "pytorch"}.get(named, named)


@pytest.mark.parametrize("path", NOT_GPU, ids=[p.stem for p in NOT_GPU])
def test_host_memory_and_advice_are_not_gpu_ooms(path: Path) -> None:
    assert find_gpu_oom(_stderr(path)) is None


def test_the_fixture_set_covers_every_framework() -> None:
    assert {find_gpu_oom(_stderr(p)).framework for p in GPU} == {"pytorch", "tensorflow", "jax"}  # type: ignore[union-attr]
    assert len(NOT_GPU) >= 2


def test_scan_reads_the_tail_of_a_big_log(tmp_path: Path) -> None:
    log = tmp_path / "slurm-1.err"
    noise = ("step 12 loss 0.5\n" * 200_000).encode()  # ~3.4 MB of training log
    log.write_bytes(noise + _stderr(OOM / "gpu-torch-2.5.txt").encode())
    found = scan_stderr(str(log))
    assert found is not None and found.framework == "pytorch" and "Tried to allocate 29.76 GiB" in found.line
    log.write_bytes(_stderr(OOM / "gpu-torch-2.5.txt").encode() + noise)  # the error is beyond the tail read
    assert scan_stderr(str(log), tail_bytes=1 << 16) is None


def test_scan_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "real.err"
    target.write_text(_stderr(OOM / "gpu-jax.txt"))
    link = tmp_path / "link.err"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.err"
    os.mkfifo(fifo)
    assert scan_stderr(str(target)) is not None
    assert scan_stderr(str(link)) is None  # a user's symlink to a file root may read
    assert scan_stderr(str(fifo)) is None  # and returns at once instead of blocking the epilog
    assert scan_stderr(str(tmp_path / "absent.err")) is None
    assert scan_stderr(str(tmp_path)) is None
