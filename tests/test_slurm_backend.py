"""Backend selection and sinfo parsing (fixture captured from the local cluster, Slurm 22.05)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from slurmgpu.slurm import backend as slurm
from slurmgpu.slurm.pyslurm_backend import PyslurmBackend

FIXTURES = Path(__file__).parent / "fixtures"


def fake_tool(tmp_path: Path, name: str, output: str) -> str:
    p = tmp_path / name
    p.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\n")
    p.chmod(0o755)
    return str(p)


def test_nodes_from_captured_sinfo(tmp_path: Path) -> None:
    out = (FIXTURES / "sinfo_nodes_22.05.txt").read_text()
    backend = slurm.CliBackend(sinfo=fake_tool(tmp_path, "sinfo", out))
    big, small = backend.nodes()
    assert (big.name, big.partitions, dict(big.gpus)) == ("gpu1", ("gpu", "debug"), {"a100": 4, "v100": 4})
    assert big.features == ("a100", "a100-80gb", "v100")
    assert (small.name, small.partitions, dict(small.gpus), small.features) == \
        ("gpu2", ("gpu-small", "debug"), {"t4": 4}, ("t4",))


def test_gres_strings() -> None:
    assert slurm.parse_gres("gpu:a100:4(S:0-1),gpu:2,nvme:1") == {"a100": 4, "": 2}
    assert slurm.parse_gres("(null)") == {}


@pytest.mark.parametrize(("theirs", "expected"), [("22.5.3", "pyslurm"), ("25.11.0", "cli")])
def test_pyslurm_only_when_versions_match(monkeypatch, tmp_path: Path, theirs: str, expected: str) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", types.SimpleNamespace(__version__=theirs))
    monkeypatch.setattr(slurm.CliBackend, "version", lambda self: "22.05.8")
    monkeypatch.setenv("PATH", str(Path(fake_tool(tmp_path, "sinfo", "")).parent))
    assert slurm.select_backend({"SLURMGPU_BACKEND": "auto"}).name == expected
    assert slurm.select_backend({"SLURMGPU_BACKEND": "cli"}).name == "cli"


def test_no_pyslurm_means_cli(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import fails
    assert slurm.select_backend({}).name == "cli"


def test_missing_tool_is_a_clear_error() -> None:
    with pytest.raises(slurm.SlurmError, match="not found on PATH"):
        slurm.CliBackend(sinfo="/nonexistent/sinfo").nodes()


def test_pyslurm_nodes_use_its_gres_dict() -> None:
    node = types.SimpleNamespace(name="g1", partitions=["gpu"], configured_gres={"gpu:a100": 4, "gpu": 2},
                                 state="IDLE", available_features=["a100"])
    fake = types.SimpleNamespace(Nodes=types.SimpleNamespace(load=lambda: {"g1": node}))
    [info] = PyslurmBackend(fake).nodes()
    assert info.partitions == ("gpu",) and dict(info.gpus) == {"a100": 4, "": 2} and info.features == ("a100",)


@pytest.mark.slurm
def test_expected_wait_from_the_live_queue(tmp_path: Path) -> None:
    """A running job holding every A100 for up to 30 min: the A100 wait is about its time left,
    while V100s are free; read through gsbatch's cached queue view."""
    import subprocess
    import time

    from slurmgpu.apps.site import cached_queue

    name = f"sg-queue-{time.time_ns()}"
    subprocess.run(["sbatch", "-J", name, "-o", "/dev/null", "--gres=gpu:a100:4", "-t", "30", "--wrap", "sleep 120"],
                   check=True, capture_output=True)
    try:
        deadline = time.monotonic() + 20
        while "R" not in subprocess.run(["squeue", "-h", "-n", name, "-o", "%t"], capture_output=True,
                                        text=True).stdout.split():
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        wait, capacity = cached_queue(slurm.CliBackend(), {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)})
        assert wait is not None and capacity is not None
        assert 1700 <= wait("a100", 1) <= 1800
        assert wait("v100", 4) == 0.0
        again, cached = cached_queue(slurm.CliBackend(sinfo="/nonexistent"), {"XDG_CACHE_HOME": str(tmp_path)})
        assert again is not None and abs(again("a100", 1) - wait("a100", 1)) < 15  # from the cache, aged
        assert cached is not None and cached.nodes == capacity.nodes  # the node view is cached with it
    finally:
        subprocess.run(["scancel", "-n", name], check=False)


def test_which_searches_path_as_the_child_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``which`` reads PATH as os.get_exec_path does (what subprocess and posix_spawnp search): no
    PATH is os.defpath, an empty entry is the working directory; a directory of the name, or a
    file that is not executable, is passed over."""
    first, second, here = tmp_path / "a", tmp_path / "b", tmp_path / "cwd"
    for d in (first, second, here):
        d.mkdir()
    (first / "tool").mkdir()
    (second / "tool").write_text("#!/bin/sh\n")
    (second / "tool").chmod(0o755)
    (here / "tool").write_text("#!/bin/sh\n")
    monkeypatch.chdir(here)

    def by_exec_path(name: str, env: dict[str, str]) -> str | None:
        found = (os.path.join(d, name) for d in os.get_exec_path(env))
        return next((p for p in found if os.access(p, os.X_OK) and not os.path.isdir(p)), None)

    for mode, expected in ((0o644, str(second / "tool")), (0o755, "tool")):
        (here / "tool").chmod(mode)  # executable: the empty entry (the working directory) finds it
        for path in (f"{first}:{second}", f"{first}::{second}", f"::{second}", str(first), "", None):
            env = {} if path is None else {"PATH": path}
            assert slurm.which("tool", env) == by_exec_path("tool", env), path
        assert slurm.which("tool", {"PATH": f"{first}::{second}"}) == expected
    assert slurm.which("sh", {}) == by_exec_path("sh", {}) is not None  # os.defpath
