"""Options read as the running Slurm's sbatch reads them: a long option's prefix resolves against
that version's table (22.05 and 24.11 differ by ten options), and the version is learnt once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgpu.apps.site import cached_slurm_version
from slurmgpu.pipeline import sbatch_options
from slurmgpu.pipeline.sbatch_options import OptionError, lookup_long, release_of, table_for, use_slurm_version


@pytest.fixture(autouse=True)
def union_after() -> Iterator[None]:
    yield
    use_slurm_version(None)


@pytest.mark.parametrize(("version", "word", "want"), [
    ((22, 5), "ext", "extra-node-info"), ((22, 5), "res", "reservation"), ((22, 5), "extra", "extra-node-info"),
    ((22, 5), "tres-p", None), ((22, 5), "po", "power"),
    ((24, 11), "ext", OptionError), ((24, 11), "res", OptionError), ((24, 11), "extra", "extra"),
    ((24, 11), "tres-p", "tres-per-task"), ((24, 11), "po", None), ((24, 11), "stepm", "stepmgr"),
    (None, "res", OptionError), (None, "po", "power"), ((23, 11), "tres-p", "tres-per-task"),
])
def test_a_prefix_resolves_in_the_running_versions_table(version: tuple[int, int] | None, word: str,
                                                         want: str | type[Exception] | None) -> None:
    use_slurm_version(version)
    if want is OptionError:
        with pytest.raises(OptionError, match="ambiguous"):
            lookup_long(word)
        return
    spec = lookup_long(word)
    assert (spec.name if spec else None) == want


def test_the_tables_differ_only_by_the_versions_own_options() -> None:
    old, new = set(table_for((22, 5)).by_name), set(table_for((24, 11)).by_name)
    assert old - new == sbatch_options.ONLY_22_05 and new - old == sbatch_options.ONLY_24_11
    assert set(table_for(None).by_name) == old | new


def test_release_is_read_from_either_tools_version_line() -> None:
    assert release_of("slurm-wlm 22.05.8") == (22, 5)
    assert release_of("slurm 24.11.5\n") == (24, 11)
    assert release_of("sinfo: command not found") is None


def _fake_sinfo(directory: Path, version: str) -> None:
    tool = directory / "sinfo"
    tool.write_text(f"#!/bin/sh\necho call >> {directory}/calls\necho 'slurm {version}'\n")
    tool.chmod(0o755)


def test_the_version_is_asked_once_per_install(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_sinfo(bin_dir, "24.11.5")
    env = {"PATH": str(bin_dir), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert cached_slurm_version(env) == (24, 11)
    assert cached_slurm_version(env) == (24, 11)
    assert (bin_dir / "calls").read_text().count("call") == 1
    cache = tmp_path / "cache" / "slurmgpu" / "slurm-version.txt"
    assert cache.stat().st_mode & 0o077 == 0
    _fake_sinfo(bin_dir, "22.05.8")  # an upgrade (or downgrade) replaces the binary: asked again
    os.utime(bin_dir / "sinfo", ns=(1, 1))
    assert cached_slurm_version(env) == (22, 5)
    assert (bin_dir / "calls").read_text().count("call") == 2


def test_no_sinfo_reads_options_by_the_union(tmp_path: Path) -> None:
    assert cached_slurm_version({"PATH": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)}) is None
