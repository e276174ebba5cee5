"""Shared fixtures. Tests marked ``slurm`` need the real local cluster: without it they are
skipped with a one-line reason, except under CI=true, where they must run and so fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_CONFIG = ROOT / "contrib" / "slurmgpu.toml"


def _cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm tools not installed"
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                             timeout=15, check=False)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if res.returncode != 0:
        return res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "sinfo failed"
    if not res.stdout.strip() or any(s in res.stdout for s in ("down", "drain", "inval")):
        return f"nodes not usable ({' '.join(res.stdout.split()) or 'none'})"
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
def submitted() -> Iterator[list[str]]:
    """Job ids a live test submits (usually held); cancelled when the test ends, pass or fail."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], check=False)


@pytest.fixture
def sample_config() -> Path:
    return SAMPLE_CONFIG


def _require(condition_missing: str | None) -> None:
    if condition_missing is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{condition_missing} (CI=true: these tests must run)")
    pytest.skip(condition_missing)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A freshly migrated, empty database on each backend slurmgpu supports."""
    from slurmgpu.history import db

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'history.db'}"
    else:
        var = "SLURMGPU_TEST_PG_URL" if request.param == "postgresql" else "SLURMGPU_TEST_MYSQL_URL"
        url = os.environ.get(var, "")
        _require(None if url else f"{var} not set: run `make db-up`, then eval its `env` output")
        db.downgrade(url, "base")
    db.upgrade(url)
    return url
