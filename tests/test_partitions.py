"""Slurm's partition rules from ``scontrol show partition -o``: the parser on this cluster's real
output (captured from Slurm 22.05) and on variants of it, and whether a partition admits a job."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from slurmgpu.slurm.partitions import (
    JobAccess,
    expand_hostlist,
    parse_partitions,
    parse_time_min,
    read_partitions,
)

CAPTURED = (Path(__file__).parent / "fixtures" / "scontrol_partition_22.05.txt").read_text()
ANYONE = JobAccess(uid=1001, groups=frozenset({"users"}), account="ml", qos="normal", time_limit_min=60)


def variant(partition: str, **fields: str) -> dict:
    """The captured output with some fields of one partition changed (the way scontrol prints them)."""
    lines = []
    for line in CAPTURED.splitlines():
        if line.startswith(f"PartitionName={partition} "):
            words = line.split()
            for key, value in fields.items():
                words = [w for w in words if not w.startswith(f"{key}=")] + [f"{key}={value}"]
            line = " ".join(words)
        lines.append(line)
    return parse_partitions("\n".join(lines))


def test_the_captured_output_of_this_cluster() -> None:
    rules = parse_partitions(CAPTURED)
    assert list(rules) == ["gpu", "gpu-small", "debug"]
    debug = rules["debug"]
    assert debug.state == "UP" and debug.allow_groups is None and debug.allow_accounts is None
    assert debug.allow_qos is None and debug.max_time_min is None and debug.nodes == {"gpu1", "gpu2"}
    assert rules["gpu"].nodes == {"gpu1"} and rules["gpu-small"].nodes == {"gpu2"}
    assert all(r.admits(ANYONE) for r in rules.values())
    assert all(r.given_time_min is None for r in rules.values())  # DefaultTime=NONE, MaxTime=UNLIMITED


def test_the_limit_a_job_writing_none_gets() -> None:
    """Slurm gives a job without --time the partition's DefaultTime, else its MaxTime."""
    assert variant("gpu", DefaultTime="01:00:00", MaxTime="1-00:00:00")["gpu"].given_time_min == 60
    assert variant("gpu", MaxTime="2:00:00")["gpu"].given_time_min == 120
    assert variant("gpu", DefaultTime="2-00:00:00")["gpu"].given_time_min == 2880


@pytest.mark.parametrize(("fields", "job", "why"), [
    ({"State": "DOWN"}, ANYONE, "is DOWN"),
    ({"State": "INACTIVE"}, ANYONE, "is INACTIVE"),
    ({"AllowGroups": "physics,chem"}, ANYONE, "AllowGroups"),
    ({"AllowGroups": "physics"}, ANYONE._replace(groups=None), "user's are unknown"),
    ({"AllowAccounts": "physics"}, ANYONE, "not in AllowAccounts"),
    ({"AllowAccounts": "ml"}, ANYONE._replace(account=None), "names none"),
    ({"DenyAccounts": "ml,bio"}, ANYONE, "in DenyAccounts"),
    ({"AllowQos": "high"}, ANYONE, "not in AllowQos"),
    ({"DenyQos": "normal"}, ANYONE, "in DenyQos"),
    ({"AllowQos": "normal"}, ANYONE._replace(qos=None), "names none"),
    ({"MaxTime": "00:30:00"}, ANYONE, "exceeds MaxTime 30"),
    ({"MaxTime": "1-00:00:00"}, ANYONE._replace(time_limit_min=1441), "exceeds MaxTime 1440"),
    ({"MaxNodes": "1"}, ANYONE._replace(min_nodes=2), "MaxNodes"),
    ({"RootOnly": "YES"}, ANYONE, "RootOnly"),
    ({"DisableRootJobs": "YES"}, ANYONE._replace(uid=0), "root jobs"),
    ({}, ANYONE._replace(nodelist=("gpu3",)), "node gpu3 is not in"),
])
def test_rules_that_refuse_a_job(fields: dict, job: JobAccess, why: str) -> None:
    rules = variant("debug", **fields)
    refusal = rules["debug"].refusal(job)
    assert refusal is not None and why in refusal, refusal
    assert rules["gpu"].admits(job) or job.nodelist  # the other partitions are untouched


@pytest.mark.parametrize(("fields", "job"), [
    ({"AllowGroups": "physics,users"}, ANYONE),
    ({"AllowAccounts": "physics,ml"}, ANYONE),
    ({"DenyAccounts": "physics"}, ANYONE),
    ({"AllowQos": "normal,high"}, ANYONE),
    ({"MaxTime": "01:00:00"}, ANYONE),  # exactly the limit
    ({"MaxTime": "30:00"}, ANYONE._replace(time_limit_min=None)),  # no limit asked: Slurm applies its own
    ({}, ANYONE._replace(nodelist=("gpu1", "gpu2"))),
])
def test_rules_that_admit_a_job(fields: dict, job: JobAccess) -> None:
    assert variant("debug", **fields)["debug"].refusal(job) is None


def test_times_and_hostlists() -> None:
    assert [parse_time_min(t) for t in ("UNLIMITED", "INFINITE", "1-00:00:00", "02:00:00", "30:00", "45", "1-2",
                                        "00:00:30")] == [None, None, 1440, 120, 30, 45, 1560, 1]
    with pytest.raises(ValueError):
        parse_time_min("soon")
    assert expand_hostlist("gpu[01-03,7],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu1"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    for bad in ("gpu[1-", "gpu[a-b]", "gpu[3-1]"):
        with pytest.raises(ValueError):
            expand_hostlist(bad)
    assert variant("debug", Nodes="gpu[1-")["debug"].nodes is None  # unreadable: a node list is never admitted


@pytest.mark.slurm
def test_read_from_the_live_cluster() -> None:
    rules = read_partitions()
    names = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, check=True).stdout.split()
    assert set(rules) == set(names)
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout
    assert set().union(*(r.nodes or set() for r in rules.values())) == set(nodes.split())
    assert all(r.state == "UP" for r in rules.values())


def test_gsbatch_asks_scontrol_once_a_minute_at_most(tmp_path: Path) -> None:
    """gsbatch reads the partition rules from a private per-user cache of scontrol's answer (0600),
    asks again once it is a minute old, and keeps no answer it cannot parse."""
    import os
    import stat

    from slurmgpu.apps.site import cached_partitions

    calls, answer = tmp_path / "calls", tmp_path / "answer.txt"
    answer.write_text(CAPTURED)
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho x >> {calls}\ncat {answer}\n")
    fake.chmod(0o755)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = cached_partitions(env, scontrol=str(fake))
    assert first == parse_partitions(CAPTURED) and cached_partitions(env, scontrol=str(fake)) == first
    assert calls.read_text().count("x") == 1
    kept = tmp_path / "cache" / "slurmgpu" / "partitions.txt"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    os.utime(kept, (kept.stat().st_atime - 61, kept.stat().st_mtime - 61))  # a minute old
    assert cached_partitions(env, scontrol=str(fake)) == first and calls.read_text().count("x") == 2
    answer.write_text("slurm_load_partitions: Unable to contact slurm controller\n")
    os.utime(kept, (kept.stat().st_atime - 61, kept.stat().st_mtime - 61))
    with pytest.raises(ValueError):
        cached_partitions(env, scontrol=str(fake))
    assert kept.read_text() == CAPTURED  # the last good answer stays
