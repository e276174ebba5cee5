"""gsbatch on the real local Slurm: real sbatch, real scontrol, compared with plain sbatch."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_rewrite import edge_script_bytes

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
    # a cluster of short options: the flags before the rewritten one stay (-s once went missing)
    ("cluster.sh", "#SBATCH -sp gpu-small\n#SBATCH --gres=gpu:a100:1",
     {"Partition": "gpu", "OverSubscribe": "YES", "TresPerNode": "gpu:a100:1"}),
    ("cluster_gpus.sh", "#SBATCH -C a100\n#SBATCH -sG1", {"OverSubscribe": "YES", "TresPerJob": "gpu:a100:1"}),
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


@pytest.mark.parametrize(("directive", "opts"), [
    ("#SBATCH -t 5 stray", []),  # Invalid directive: sbatch exits 255
    ("#SBATCH --gpus-per=1", []),  # ambiguous
    ("#SBATCH -J", []),  # no argument
    ("#SBATCH --time=1:00:00:00", []),
    ("#SBATCH --mem=1.5G", []),
    ("#SBATCH -N 1,2", []),
    ("#SBATCH --gres=gpu:1", ["--mem=4G", "--mem-per-cpu=1G"]),  # exits 1
    ("#SBATCH --gpus-per-socket=1", []),
])
def test_refused_input_exits_as_sbatch_does(tmp_path: Path, sample_config: Path, directive: str,
                                            opts: list[str]) -> None:
    p = script(tmp_path, "bad.sh", directive)
    plain = run(["sbatch", "--test-only", *opts, str(p)], tmp_path, sample_config)
    ours = run(["gsbatch", "--test-only", *opts, str(p)], tmp_path, sample_config)
    assert plain.returncode != 0 and ours.returncode == plain.returncode, (plain.stderr, ours.stderr)
    assert ours.stderr.startswith("gsbatch: error: ") and ours.stderr.count("\n") == 1, ours.stderr


def test_refused_request_never_reaches_slurm(tmp_path: Path, sample_config: Path) -> None:
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    res = run(["gsbatch", str(script(tmp_path, "huge.sh", "#SBATCH --gpus-per-node=a100:16"))], tmp_path, sample_config)
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    assert res.returncode == 1 and res.stdout == "" and "at most 4 per node" in res.stderr
    assert before == after


@pytest.mark.parametrize("opts", [
    ["-p", "gpu", "--gres=gpu:6"],  # untyped: 4 A100s and 4 V100s on one node, Slurm mixes them
    ["-p", "gpu", "--gres=gpu:a100:4,gpu:v100:2"],
    ["-p", "gpu,debug", "-G", "6"],  # debug is not in the config: nothing is known of it
    ["-p", "gpu", "--gres=gpu:9"],  # more than the node holds: both refuse
    ["-p", "gpu", "--gpus-per-node=a100:5"],
])
def test_refuses_a_gpu_count_only_where_slurm_does(tmp_path: Path, sample_config: Path, opts: list[str]) -> None:
    """Slurm is the oracle: sbatch --test-only places the job or says it cannot, and gsbatch refuses
    before submission exactly the requests Slurm cannot place."""
    p = script(tmp_path, "count.sh", "")
    plain = run(["sbatch", "--test-only", *opts, str(p)], tmp_path, sample_config)
    ours = run(["gsbatch", "--test-only", *opts, str(p)], tmp_path, sample_config)
    placed = plain.returncode == 0 and "to start at" in plain.stderr
    assert (ours.returncode == 0) == placed, (plain.stderr, ours.stderr)
    assert placed or "gsbatch: error:" in ours.stderr


def test_a_partition_list_with_one_the_config_lacks_is_kept(tmp_path: Path, sample_config: Path,
                                                           submitted: list[str]) -> None:
    """'-p gpu-small,debug' for A100s: debug (not in the config) has them, so the list stands;
    it once became '--partition=gpu', dropping debug."""
    p = script(tmp_path, "list.sh", "#SBATCH -p gpu-small,debug --gres=gpu:a100:2")
    res = run(["gsbatch", "--hold", "--parsable", str(p)], tmp_path, sample_config)
    assert res.returncode == 0, res.stderr
    submitted.append(job_id_of(res.stdout))
    assert job_info(submitted[-1])["Partition"] == "gpu-small,debug"
    assert batch_script(submitted[-1]) == p.read_bytes()


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


def batch_script(job_id: str) -> bytes:
    """The script exactly as slurmctld stored it."""
    return subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True,
                          check=True).stdout


def test_a_script_without_final_newline_is_rewritten_and_accepted(tmp_path: Path, sample_config: Path,
                                                                   submitted: list[str]) -> None:
    """The probe's script: '#!/bin/bash# slurmgpu: ...' once made it a bad interpreter."""
    p = tmp_path / "nonl.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH --gres=gpu:t4:1")
    dry = subprocess.run(["gsbatch", "--dry-run", str(p)], capture_output=True, cwd=tmp_path, check=True,
                         env={"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(sample_config)}).stdout
    res = run(["gsbatch", "--hold", "--parsable", str(p)], tmp_path, sample_config)
    assert res.returncode == 0, res.stderr
    submitted.append(job_id_of(res.stdout))
    assert batch_script(submitted[-1]) == dry
    assert dry.startswith(b"#!/bin/bash\n# slurmgpu: ") and dry.endswith(b"#SBATCH --gres=gpu:t4:1\n"
                                                                         b"#SBATCH --partition=gpu-small")
    info = job_info(submitted[-1])
    assert info["Partition"] == "gpu-small" and "gres/gpu:t4=1" in info["TRES"]


def test_a_script_after_double_dash_is_submitted_and_the_comment_left_to_the_user(tmp_path: Path,
                                                                                   submitted: list[str], capfd) -> None:
    """'gsbatch --hold -- job.sh arg': a tag once went after the '--', where sbatch took it for the script;
    now the job's Comment is the user's (empty here) and the record names the job."""

    class Kept:
        name = "model"  # the model's decisions are tagged

        def decide(self, request) -> Decision:
            return Decision((), ("kept",), decider=self.name)

    p = script(tmp_path, "dd.sh", "#SBATCH --gres=gpu:t4:1 -p gpu-small")
    env = {"PATH": "/usr/bin:/bin", "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path)}
    code = gsbatch.main(["--parsable", "--hold", "--", str(p), "arg1"], env=env, backend=CliBackend(), decider=Kept())
    out, err = capfd.readouterr()
    assert code == 0, err
    submitted.append(job_id_of(out))
    info = job_info(submitted[-1])
    assert info.get("Comment", "(null)") == "(null)" and info["JobName"] == "dd.sh", info


@pytest.mark.parametrize("form", ["pipe", "fifo"])
def test_a_piped_script_path_reaches_slurm_whole(tmp_path: Path, sample_config: Path, submitted: list[str],
                                                 form: str) -> None:
    """'cat job.sh | gsbatch /dev/stdin' or a FIFO: gsbatch reads the stream to decide, so sbatch,
    opening the path after it, would find it empty; it gets what was read, as plain sbatch would."""
    data = b"#!/bin/bash\n#SBATCH --gres=gpu:t4:1 -p gpu-small\nsleep 30\n"
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(sample_config),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path)}
    if form == "pipe":
        res = subprocess.run(["gsbatch", "--hold", "--parsable", "/dev/stdin"], input=data, capture_output=True,
                             cwd=tmp_path, env=env, timeout=60, check=False)
    else:
        fifo = tmp_path / "job.fifo"
        os.mkfifo(fifo)
        proc = subprocess.Popen(["gsbatch", "--hold", "--parsable", str(fifo)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmp_path, env=env)
        fifo.write_bytes(data)  # blocks until gsbatch opens it for reading
        stdout, stderr = proc.communicate(timeout=60)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert res.returncode == 0, res.stderr
    submitted.append(job_id_of(res.stdout.decode()))
    assert batch_script(submitted[-1]) == data  # kept as written, every byte
    assert job_info(submitted[-1])["JobName"] == ("stdin" if form == "pipe" else "job.fifo")


@pytest.mark.parametrize(("data", "accepted"), [
    (b"#!/bin/bash\r\n#SBATCH --gres=gpu:t4:1\r\nsrun x\r\n", False),  # DOS line breaks: sbatch refuses
    (b"#!/bin/bash\n#SBATCH --gres=gpu:t4:1\r# a lone CR\nsrun x\r", True),  # a lone CR is whitespace
])
def test_carriage_returns_are_refused_or_kept_as_sbatch_does(tmp_path: Path, sample_config: Path,
                                                            submitted: list[str], data: bytes,
                                                            accepted: bool) -> None:
    p = tmp_path / "cr.sh"
    p.write_bytes(data)
    plain = subprocess.run(["sbatch", "--hold", "--parsable", str(p)], capture_output=True, text=True, check=False)
    ours = run(["gsbatch", "--hold", "--parsable", str(p)], tmp_path, sample_config)
    for res in (plain, ours):
        if res.returncode == 0:
            submitted.append(job_id_of(res.stdout))
    assert (plain.returncode == 0) == accepted and (ours.returncode == 0) == accepted, (plain.stderr, ours.stderr)
    assert "Traceback" not in ours.stderr
    if not accepted:
        assert ours.stdout == "" and "DOS line breaks" in ours.stderr and "DOS line breaks" in plain.stderr
    else:
        assert job_info(submitted[-1])["Partition"] == "gpu-small"  # the rules moved t4 there


# Edge-case scripts for the live sbatch: the generator of test_rewrite's byte-faithfulness
# property, with options this cluster accepts.
SLURM_GPU_OPTIONS = ["--gres=gpu:a100:1", "-G a100:1", "--gpus-per-node=a100:1", "--gres=gpu:1", "--gpus 1"]
SLURM_OTHER_OPTIONS = ["-t 5", "-J 'a job'", "-c 1", "-N 1", "--comment='{{ not a template }}'", "-p gpu"]


@st.composite
def live_edge_scripts(draw: st.DrawFn) -> tuple[bytes, list[str], bool]:
    opts = draw(st.lists(st.sampled_from(SLURM_OTHER_OPTIONS), max_size=3, unique=True))
    cli: list[str] = []
    if draw(st.booleans()):
        opts.append(draw(st.sampled_from(SLURM_GPU_OPTIONS)))
    else:
        cli = draw(st.sampled_from([["--gres=gpu:1"], ["-G", "a100:1"], ["--gpus-per-node=1"]]))
    return edge_script_bytes(draw, "#!/bin/bash", opts, 2), cli, draw(st.booleans())


class MoveToT4:
    """A decision that changes type, count and partition, whatever the request."""

    name = "fixed"

    def decide(self, request) -> Decision:
        return Decision((ComponentChange(0, "t4", 2, "gpu-small"),), ("edge test",), decider=self.name)


@settings(max_examples=8, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=live_edge_scripts())
def test_sbatch_accepts_rewritten_edge_case_scripts_with_the_decided_tres(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: tuple[bytes, list[str], bool]) -> None:
    data, cli, on_stdin = case
    p = tmp_path / "edge.sh"
    p.write_bytes(data)
    tag = f"edge-{os.urandom(6).hex()}"
    words = ["--hold", f"--comment={tag}", *cli]
    env = {"PATH": "/usr/bin:/bin", "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path), "SLURMGPU_SOCKET": "/nonexistent"}
    expect = gsbatch.plan(gsbatch.parse_invocation([*words, str(p)]), env, MoveToT4()).submission.script_text
    if on_stdin:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    code = gsbatch.main(words if on_stdin else [*words, str(p)], env=env, backend=CliBackend(), decider=MoveToT4())
    out = subprocess.run(["squeue", "-h", "-o", "%i|%k"], capture_output=True, text=True, check=True).stdout
    ids = [line.split("|")[0] for line in out.splitlines() if line.endswith("|" + tag)]
    try:
        assert code == 0 and len(ids) == 1, (code, ids, data)
        assert batch_script(ids[0]) == expect.encode("utf-8", "surrogateescape"), data
        info = job_info(ids[0])
        assert info["Partition"] == "gpu-small" and "gres/gpu:t4=2" in info["TRES"], (info["TRES"], data, cli)
    finally:
        if ids:
            subprocess.run(["scancel", *ids], check=False)
