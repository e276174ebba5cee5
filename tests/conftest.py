"""Shared fixtures. Tests marked ``slurm`` need the real local cluster: without it they are
skipped with a one-line reason, except under CI=true, where they must run and so fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_CONFIG = ROOT / "contrib" / "slurmgpu.toml"


def _cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm tools not installed"
    try:
        res = subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], capture_output=True, text=True,
                             timeout=15, check=False)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if res.returncode != 0:
        return res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "sinfo failed"
    if not res.stdout.strip() or any(s in res.stdout for s in ("down", "drain", "inval")):
        return f"node localhost not usable ({res.stdout.strip() or 'absent'})"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    why = _cluster_up()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"Slurm cluster not usable under CI=true: {why}")
    pytest.skip(f"no local Slurm cluster ({why}); run `make cluster-up`")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slurm"):
            item.fixturenames.insert(0, "slurm_cluster")  # type: ignore[attr-defined]


@pytest.fixture
def sample_config() -> Path:
    return SAMPLE_CONFIG
