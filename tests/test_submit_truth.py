"""What gsbatch does and says at submit time is true (issue 28): the user's own --gpu-mem is applied
in every mode or refused, a named partition that holds the ask is kept, advice says when the job as
written cannot run, a predicted out-of-memory is said, hints never claim a fit the prediction denies,
typos are said, and errors name where the option was set.

Unit tests run gsbatch.main with a backend that records what sbatch would get; the tests marked
``slurm`` submit held jobs to the local cluster and read ``scontrol show job``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgpu.apps import gsbatch
from slurmgpu.pipeline.policy import RuleDecider
from slurmgpu.slurm.backend import Submitted

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = Path(sys.executable).parent


class Recording:
    """A backend that records sbatch's words and the script it would read, and submits nothing."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str]] = []

    def submit(self, words: list[str], env: object, stdin: object = None) -> Submitted:
        self.calls.append((list(words), Path(words[-1]).read_text()))
        return Submitted(0, "1")


def job(*directives: str, command: str = "srun python train.py") -> str:
    return "#!/bin/bash\n" + "".join(d + "\n" for d in directives) + command + "\n"


def env_for(tmp_path: Path, config: Path | str = SAMPLE) -> dict[str, str]:
    return {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(config), "HOME": str(tmp_path),
            "XDG_CACHE_HOME": str(tmp_path), "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool")}


def run(tmp_path: Path, argv: list[str], text: str, config: Path | str = SAMPLE,
        backend: Recording | None = None) -> tuple[int, list[str], Recording]:
    """gsbatch.main on a script holding TEXT: exit code, stderr lines, the recording backend."""
    script = tmp_path / "job.sh"
    script.write_text(text)
    backend = backend or Recording()
    import io
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = gsbatch.main([*argv, str(script)], env=env_for(tmp_path, config), backend=backend)
    return code, err.getvalue().splitlines(), backend


def config_with(tmp_path: Path, old: str, new: str, extra: str = "") -> Path:
    """The sample config with one line changed (and EXTRA appended)."""
    text = SAMPLE.read_text()
    assert old in text
    path = tmp_path / "slurmgpu.toml"
    path.write_text(text.replace(old, new) + extra)
    return path


# --- item 13: an error names where the option was set ---------------------------------------------


def test_a_bad_time_on_the_command_line_is_not_blamed_on_the_script(tmp_path: Path) -> None:
    code, err, backend = run(tmp_path, ["-t", "abc"], job("#SBATCH -J x", "#SBATCH -t 10", "#SBATCH --gres=gpu:1"))
    assert (code, err) == (255, ["gsbatch: error: command line: --time: invalid time limit 'abc'"])
    assert not backend.calls


def test_a_gpu_mem_refusal_names_the_command_line_or_the_line(tmp_path: Path) -> None:
    text = job("#SBATCH --gres=gpu:1", "#GSBATCH --gpu-mem=100G")
    code, err, _ = run(tmp_path, ["--gpu-mem", "120G"], text)
    assert (code, err) == (1, ["gsbatch: error: command line: --gpu-mem 120 GiB: no configured GPU type has that "
                               "much memory per GPU (largest: a100, 80 GiB)"])
    code, err, _ = run(tmp_path, [], text)
    assert code == 1 and err == [f"gsbatch: error: {tmp_path / 'job.sh'}:3: --gpu-mem 100 GiB: no configured GPU "
                                 "type has that much memory per GPU (largest: a100, 80 GiB)"]
    code, err, _ = run(tmp_path, ["--gpu-mem=12"], text)
    assert code == 1 and err[0].startswith("gsbatch: error: command line: --gpu-mem: cannot read size '12'")
