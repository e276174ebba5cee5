"""The pyslurm backend answers as the CLI backend on the live cluster (skipped where pyslurm is not importable)."""

from __future__ import annotations

import pytest

from slurmgpu.slurm.backend import CliBackend, select_backend
from slurmgpu.slurm.partitions import read_partitions

pyslurm = pytest.importorskip("pyslurm", reason="pyslurm is not importable here (make pyslurm installs it)")
pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def both() -> tuple[CliBackend, CliBackend]:
    backend = select_backend({"SLURMGPU_BACKEND": "auto"})
    if backend.name != "pyslurm":
        pytest.skip("the installed pyslurm does not match the running Slurm")
    assert isinstance(backend, CliBackend)
    return backend, CliBackend()


def test_same_nodes_gres_and_features(both) -> None:
    py, cli = both
    def view(b: CliBackend) -> list[tuple]:
        return sorted((n.name, set(n.partitions), dict(n.gpus), n.state, n.features) for n in b.nodes())
    assert view(py) == view(cli) and view(cli)
    assert py.free_gpus() == cli.free_gpus()


def test_same_partitions_and_rules(both) -> None:
    py, cli = both
    assert py.default_partition() == cli.default_partition()
    assert py.partitions() == read_partitions()  # type: ignore[attr-defined]
    assert py.cluster_name() == cli.cluster_name()


def test_same_queue(both) -> None:
    py, cli = both
    assert [(q.job_id, q.running, q.nodes, dict(q.gpus), q.partition) for q in py.queue()] == \
        [(q.job_id, q.running, q.nodes, dict(q.gpus), q.partition) for q in cli.queue()]
