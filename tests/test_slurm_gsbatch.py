"""gsbatch on the real local Slurm: real sbatch, real scontrol, compared with plain sbatch."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgpu.apps import gsbatch
from slurmgpu.pipeline.policy import ComponentChange, Decision
from slurmgpu.slurm.backend import CliBackend

pytestmark = pytest.mark.slurm
BIN = Path(sys.executable).parent


def run(argv: list[str], cwd: Path, config: Path) -> subprocess.CompletedProcess[str]:
    spool = cwd / "spool"
    spool.mkdir(exist_ok=True)
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(config), "SLURMGPU_SUBMISSION_SPOOL": str(spool)}
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=60, check=False)


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                         check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def job_id_of(stdout: str) -> str:
    m = re.fullmatch(r"Submitted batch job (\d+)\n|(\d+)\n", stdout)
    assert m, stdout
    return m.group(1) or m.group(2)


@pytest.fixture
def submitted() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], check=False)


def script(tmp_path: Path, name: str, directives: str) -> Path:
    p = tmp_path / name
    p.write_text(f"#!/bin/bash\n{directives}\nsleep 30\n")
    return p


# One script per GPU syntax, with what scontrol must show afterwards.
SYNTAXES = [
    ("gres_typed.sh", "#SBATCH --gres=gpu:a100:2", {"TresPerNode": "gpu:a100:2", "Partition": "gpu"}),
    ("gres_moved.sh", "#SBATCH -p gpu-small\n#SBATCH --gres=gpu:v100:1",
     {"TresPerNode": "gpu:v100:1", "Partition": "gpu"}),
    ("gpus.sh", "#SBATCH -G v100:2", {"TresPerJob": "gpu:v100:2"}),
    ("gpus_per_node.sh", "#SBATCH --gpus-per-node=t4:1 -p gpu-small",
     {"TresPerNode": "gpu:t4:1", "Partition": "gpu-small"}),
    ("gpus_per_task.sh", "#SBATCH --gpus-per-task=t4:1 --ntasks=2 -p gpu-small", {"TresPerTask": "gpu:t4:1"}),
    ("gpus_per_socket.sh", "#SBATCH --gpus-per-socket=a100:1 --sockets-per-node=1", {"TresPerSocket": "gpu:a100:1"}),
    ("constraint.sh", "#SBATCH --gres=gpu:1 --constraint=v100", {"TresPerNode": "gpu:v100:1", "Features": "v100"}),
]


@pytest.mark.parametrize(("name", "directives", "expect"), SYNTAXES, ids=[s[0] for s in SYNTAXES])
def test_each_gpu_syntax_is_submitted_as_decided(tmp_path: Path, sample_config: Path, submitted: list[str],
                                                 name: str, directives: str, expect: dict[str, str]) -> None:
    res = run(["gsbatch", str(script(tmp_path, name, directives))], tmp_path, sample_config)
    assert res.returncode == 0, res.stderr
    submitted.append(job_id_of(res.stdout))
    info = job_info(submitted[-1])
    for key, value in expect.items():
        assert info[key].replace("gres:", "").replace("gres/", "") == value, (key, info[key])
    assert info["JobName"] == name  # the private copy kept the script's name


def test_decided_type_and_count_reach_the_scheduler(tmp_path: Path, submitted: list[str], capfd) -> None:
    """A decision that changes type and count (what the learned decider will do) lands in Slurm."""

    class Fixed:
        name = "fixed"

        def decide(self, request) -> Decision:
            return Decision((ComponentChange(0, "t4", 3, "gpu-small"),), ("test decision",), decider=self.name)

    p = script(tmp_path, "big.sh", "#SBATCH --gres=gpu:a100:4\n#SBATCH -p gpu")
    env = {"PATH": "/usr/bin:/bin", "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path)}
    code = gsbatch.main(["--parsable", str(p)], env=env, backend=CliBackend(), decider=Fixed())
    out, err = capfd.readouterr()
    assert code == 0, err
    submitted.append(job_id_of(out))
    info = job_info(submitted[-1])
    assert info["TresPerNode"].replace("gres/", "gres:") == "gres:gpu:t4:3" and info["Partition"] == "gpu-small"
    assert "gsbatch: note: GPU request changed: test decision" in err


def _normalise(text: str) -> str:
    text = re.sub(r"\b\d+\b", "N", text)
    return re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", "T", text)


@pytest.mark.parametrize(("case", "opts"), [
    ("success", []),
    ("parsable", ["--parsable"]),
    ("test-only", ["--test-only"]),
    ("rejected", ["-p", "nosuch"]),
    ("bad-option", ["--no-such-option"]),
])
def test_same_output_and_exit_code_as_sbatch(tmp_path: Path, sample_config: Path, submitted: list[str],
                                             case: str, opts: list[str]) -> None:
    p = script(tmp_path, "same.sh", "#SBATCH --gres=gpu:a100:1")
    plain = run(["sbatch", *opts, str(p)], tmp_path, sample_config)
    ours = run(["gsbatch", *opts, str(p)], tmp_path, sample_config)
    for res in (plain, ours):
        if res.returncode == 0 and res.stdout:
            submitted.append(job_id_of(res.stdout))
    assert ours.returncode == plain.returncode
    assert _normalise(ours.stdout) == _normalise(plain.stdout)
    assert _normalise(ours.stderr) == _normalise(plain.stderr)
    if case in ("success", "parsable"):
        assert ours.returncode == 0 and ours.stdout
    if case == "rejected":
        assert ours.returncode == 1 and "invalid partition" in ours.stderr.lower()


def test_refused_request_never_reaches_slurm(tmp_path: Path, sample_config: Path) -> None:
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    res = run(["gsbatch", str(script(tmp_path, "huge.sh", "#SBATCH --gpus-per-node=a100:16"))], tmp_path, sample_config)
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    assert res.returncode == 1 and res.stdout == "" and "at most 4 per node" in res.stderr
    assert before == after


def test_config_check_against_live_cluster(sample_config: Path, tmp_path: Path) -> None:
    res = run(["slurmgpu", "--config", str(sample_config), "config", "check"], tmp_path, sample_config)
    assert res.returncode == 0 and "matches the live cluster" in res.stdout, res.stdout + res.stderr
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(sample_config.read_text().replace('gpu_types = ["t4"]', 'gpu_types = ["t4", "h100"]')
                     + "[gpu_types.h100]\nmemory_gib = 80\n[partitions.big]\ngpu_types = ['h100']\ngpus_per_node = 8\n")
    res = run(["slurmgpu", "--config", str(wrong), "config", "check"], tmp_path, wrong)
    assert res.returncode == 1
    assert "mismatch: partition gpu-small: GPU type h100 is configured but no node offers it" in res.stdout
    assert "mismatch: partition big is configured but does not exist in the cluster" in res.stdout


# Every in-script gsbatch directive README documents; plain sbatch must accept each script.
GSBATCH_FORMS = ["#GSBATCH --no-rewrite", "#GSBATCH   --no-rewrite   # measured on purpose",
                 "#SBATCH -t 1\n#GSBATCH --no-rewrite\n#SBATCH -J pinned"]


@pytest.mark.parametrize("lines", GSBATCH_FORMS)
def test_plain_sbatch_accepts_every_documented_gsbatch_directive(tmp_path: Path, submitted: list[str],
                                                                lines: str) -> None:
    res = subprocess.run(["sbatch", "--hold", "--parsable", str(script(tmp_path, "opt.sh", lines))],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    submitted.append(res.stdout.strip())


def test_plain_sbatch_refuses_the_legacy_keep_line_which_is_why_it_is_deprecated(tmp_path: Path) -> None:
    res = subprocess.run(["sbatch", "--hold", "--parsable", str(script(tmp_path, "old.sh", "#SLURMGPU keep"))],
                         capture_output=True, text=True, check=False)
    assert res.returncode != 0 and "Change from #SLURM to #SBATCH" in res.stderr


def test_config_init_from_the_live_cluster_then_check_matches(tmp_path: Path, sample_config: Path) -> None:
    out = tmp_path / "init.toml"
    res = run(["slurmgpu", "config", "init", "--out", str(out)], tmp_path, sample_config)
    assert res.returncode == 0, res.stderr
    res = run(["slurmgpu", "--config", str(out), "config", "check"], tmp_path, out)
    assert res.returncode == 0 and "matches the live cluster" in res.stdout, res.stdout + res.stderr
    again = run(["slurmgpu", "config", "init", "--out", str(out)], tmp_path, sample_config)
    assert again.returncode == 1 and "--force" in again.stderr
