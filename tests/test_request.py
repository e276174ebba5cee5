"""Normalising every GPU syntax into one request, with sbatch's precedence."""

from __future__ import annotations

import pytest

from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.request import JobRequest, build_request, parse_time
from slurmgpu.pipeline.script import parse_script


def req(body: str, cli: list[str] | None = None, env: dict[str, str] | None = None):
    script = parse_script(("#!/bin/bash\n" + body + "srun true\n").encode(), "job.sh")
    return build_request(script, cli or [], env or {})


@pytest.mark.parametrize(("body", "gtype", "total", "per_node"), [
    ("#SBATCH --gres=gpu:a100:2\n", "a100", 2, 2),
    ("#SBATCH --gres=gpu:2 -N 3\n", None, 6, 2),
    ("#SBATCH --gres=gpu\n", None, 1, 1),
    ("#SBATCH --gres=nvme:1,gpu:v100:4\n", "v100", 4, 4),
    ("#SBATCH -G t4:3\n", "t4", 3, 3),
    ("#SBATCH --gpus-per-node=a100:4 --nodes=2-4\n", "a100", 8, 4),
    ("#SBATCH --gpus-per-task=1 --ntasks=8\n", None, 8, 8),
    ("#SBATCH --gpus-per-task=1 --ntasks-per-node=4 -N 2\n", None, 8, 4),
    ("#SBATCH --gpus-per-socket=2 --sockets-per-node=2\n", None, 4, 4),
    ("#SBATCH --gres=gpu:1 --constraint=a100&ib\n", "a100", 1, 1),
    ("#SBATCH -c 8\n", None, 0, 0),
])
def test_gpu_syntaxes(body: str, gtype: str | None, total: int, per_node: int) -> None:
    r = req(body)
    assert (r.gpu_type, r.gpus_total, r.main.gpus_per_node) == (gtype, total, per_node)


def test_precedence_cli_over_env_over_script() -> None:
    body = "#SBATCH -p gpu --gres=gpu:a100:1 -t 10\n"
    assert req(body).main.partition == "gpu"
    assert req(body, env={"SBATCH_PARTITION": "gpu-small"}).main.partition == "gpu-small"
    r = req(body, cli=["-p", "debug"], env={"SBATCH_PARTITION": "gpu-small", "SBATCH_GRES": "gpu:t4:2"})
    assert r.main.partition == "debug"
    assert (r.gpu_type, r.gpus_total) == ("t4", 2)
    assert r.main.options["partition"].origin.source == "cli"
    assert r.main.options["gres"].origin.variable == "SBATCH_GRES"


def test_hetjob_sums_components_and_cli_applies_to_each() -> None:
    r = req("#SBATCH -c 4\n#SBATCH hetjob\n#SBATCH --gpus=v100:2\n", cli=["-t", "5"])
    assert r.is_hetjob and r.gpus_total == 2 and r.gpu_type == "v100"
    assert [c.time_limit_s for c in r.components] == [300, 300]


# Each row was submitted held with plain sbatch 22.05 on the local cluster; the expected total and
# per-type counts are the job's TRES in `scontrol show job` (gres/gpu=N, gres/gpu:TYPE=N).
@pytest.mark.parametrize(("body", "total", "by_type", "gtype"), [
    ("#SBATCH -G 4 --gpus-per-node=4\n", 4, {"": 4}, None),  # counts Slurm combines are not summed
    ("#SBATCH --gres=gpu:1 --gpus-per-task=1 -n 1\n", 1, {"": 1}, None),
    ("#SBATCH --gpus-per-task=2 --gpus-per-node=2 -n 1\n", 2, {"": 2}, None),
    ("#SBATCH -G 256 --gpus-per-node=4 -N 64\n", 256, {"": 256}, None),
    ("#SBATCH --gres=gpu:a100:2 -n 2 --gpus-per-task=t4:1\n", 4, {"a100": 2, "t4": 2}, None),  # per type
    ("#SBATCH --gres=gpu:a100:1 --gpus=v100:1\n", 2, {"a100": 1, "v100": 1}, None),
    ("#SBATCH --gres=gpu --gpus-per-node=2\n", 2, {"": 2}, None),  # both per node: accepted
    ("#SBATCH --gres=gpu:2,gpu:1\n", 2, {"": 2}, None),  # one type twice: the larger count
    ("#SBATCH --gres=gpu:a100:0,gpu:1\n", 1, {"": 1}, None),  # a zero count is skipped
    ("#SBATCH -G a100\n", 1, {"a100": 1}, "a100"),  # a type alone is one GPU
    ("#SBATCH -G 4 --gres=gpu:1\n", 4, {"": 4}, None),  # one per node on 4 nodes
    ("#SBATCH -N 2 -n 1 --gres=gpu:1\n", 1, {"": 1}, None),  # fewer tasks than nodes lowers -N
    ("#SBATCH -N 2 --gpus-per-task=2\n", 4, {"": 4}, None),  # one task per node implied
    ("#SBATCH --gpus-per-task=0 --gres=gpu:3\n", 3, {"": 3}, None),
    ("#SBATCH -N 1 --tasks-per-node=2 --gpus-per-task=1\n", 2, {"": 2}, None),  # ntasks-per-node's other name
    ("#SBATCH -N 1 --tasks-per-node 2 --gpus-per-task=1\n", 2, {"": 2}, None),
    ("#SBATCH --ntasks-per-tres=2 -G 2\n", 2, {"": 2}, None),  # ntasks-per-gpu's other name
    ("#SBATCH -B 1 --gpus-per-socket=1\n", 1, {"": 1}, None),  # -B's first field: sockets per node
    ("#SBATCH -B 2 --gpus-per-socket=1 -N 1\n", 2, {"": 2}, None),
    ("#SBATCH -B 2:1 --gpus-per-socket=a100:2\n", 4, {"a100": 4}, "a100"),
])
def test_slurm_combination_rules(body: str, total: int, by_type: dict[str, int], gtype: str | None) -> None:
    r = req(body)
    assert (r.gpus_total, r.to_json()["gpus_by_type"], r.gpu_type) == (total, by_type, gtype)


def test_memory_from_the_environment_gives_way_to_an_explicit_one() -> None:
    """As sbatch 22.05 did on the local cluster: SBATCH_MEM_PER_CPU=1G with '#SBATCH --mem=4G' is
    accepted with mem=4G; two from the environment are refused, naming the variables."""
    r = req("#SBATCH --mem=4G\n", env={"SBATCH_MEM_PER_CPU": "1G"})
    assert (r.main.mem_mb, r.main.mem_per_cpu_mb) == (4096, None) and "mem-per-cpu" not in r.main.options
    r = req("#SBATCH -G 1\n", cli=["--mem-per-gpu=2G"], env={"SBATCH_MEM_PER_CPU": "1G"})
    assert (r.main.mem_per_gpu_mb, r.main.mem_per_cpu_mb) == (2048, None)
    with pytest.raises(InputError, match="^SBATCH_MEM_PER_NODE and SBATCH_MEM_PER_CPU are mutually exclusive$"):
        req("#SBATCH -G 1\n", env={"SBATCH_MEM_PER_CPU": "1G", "SBATCH_MEM_PER_NODE": "2G"})
    with pytest.raises(InputError, match="--mem and --mem-per-cpu are mutually exclusive"):
        req("#SBATCH --mem=4G\n", cli=["--mem-per-cpu=1G"])


def test_gpus_per_socket_from_the_environment() -> None:
    r = req("#SBATCH --sockets-per-node=1\n", env={"SBATCH_GPUS_PER_SOCKET": "t4:1"})
    assert (r.gpus_total, r.gpu_type) == (1, "t4")


@pytest.mark.parametrize(("body", "blocked"), [
    ("#SBATCH --gres=gpu:2\n", False),
    ("#SBATCH --gres=gpu:1 --gpus-per-task=1 -n 1\n", True),
    ("#SBATCH --gres=gpu:a100:1,gpu:v100:1\n", True),
    ("#SBATCH --gres=gpu:2,gpu:1\n", True),
])
def test_rewrite_blocker(body: str, blocked: bool) -> None:
    assert (req(body).main.rewrite_blocker is not None) is blocked


@pytest.mark.parametrize(("body", "fragment", "line"), [
    ("#SBATCH --gres=gpu:a100:x\n", "--gres: malformed count 'x'", 2),
    ("#SBATCH -N 1\n#SBATCH --gpus=-1\n", "--gpus: negative GPU count '-1'", 3),
    ("#SBATCH --gres=gpu:a100:1\n#SBATCH --gpus=1\n", "--gpus: Invalid GRES specification (with and without type", 3),
    ("#SBATCH --gpus-per-task=2 --gpus-per-node=2\n", "without either --gpus or -n/--ntasks", 2),
    ("#SBATCH -N 1 -c 2\n#SBATCH --gpus-per-task=1\n", "without either --gpus or -n/--ntasks", 3),
    ("#SBATCH -G 2 --gpus-per-node=3\n", "--gpus: Failed to ensure --gpus >= --gres=gpu/--gpus-per-node", 2),
    ("#SBATCH -G 3 --gpus-per-node=2\n", "--gpus is not multiple of --gres=gpu/--gpus-per-node", 2),
    ("#SBATCH --gres=gpu:1 -n 2 --gpus-per-task=2\n", "--gres: Failed to ensure --gpus >= --gpus-per-task", 2),
    ("#SBATCH -n 3 -G 2 --gpus-per-task=1\n", "number of requested tasks differ from -n/--ntasks", 2),
    ("#SBATCH --gpus-per-socket=1\n", "--gpus-per-socket option requires --sockets-per-node", 2),
    ("#SBATCH --mem=4G --mem-per-cpu=1G\n", "mutually exclusive", 2),
    ("#SBATCH --time=soon\n", "invalid time limit", 2),
    ("#SBATCH --nodes=two\n", "invalid node count", 2),  # -N 0 is accepted (sbatch 22.05)
])
def test_bad_values_name_file_line_and_option(body: str, fragment: str, line: int) -> None:
    with pytest.raises(InputError) as err:
        req(body)
    assert str(err.value).startswith(f"job.sh:{line}: ")
    assert fragment in str(err.value)


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("5:30", 330), ("1:00:00", 3600), ("2-0", 172800), ("1-2:3", 93780), ("1-2:3:4", 93784),
    ("UNLIMITED", None),
])
def test_time_formats(text: str, seconds: int | None) -> None:
    assert parse_time(text) == seconds


def _job(body: str, cli: list[str] | None = None, env: dict[str, str] | None = None) -> JobRequest:
    return build_request(parse_script(("#!/bin/bash\n" + body + "true\n").encode(), "job.sh"), cli or [], env or {})


@pytest.mark.parametrize(("body", "field", "want"), [
    ("#SBATCH -p gpu\n#PBS -q gpu-small\n", "partition", "gpu-small"),  # #PBS after #SBATCH
    ("#PBS -q gpu-small\n#SBATCH -p gpu\n", "partition", "gpu-small"),
    ("echo x\n#PBS -q gpu-small\n", "partition", "gpu-small"),  # read past the first command
    ("true\n" * 101 + "#PBS -q gpu-small\n", "partition", None),  # not past 100 other lines
    ("#BSUB -q debug\n#PBS -q gpu-small\n", "partition", "debug"),  # one kind only, #BSUB first
    ("#PBS -N pbs -l walltime=1:00:00,mem=2gb\n", "time_limit_s", 3600),
    ("#PBS -l nodes=2:ppn=3:gpus=1\n", "gpus_total", 2),
    ("#SBATCH --gres=gpu:1\n#PBS -l naccelerators=2\n", "gpus_total", 2),
    ("#SBATCH --time=1-\n", "time_limit_s", 86400),
    ("#SBATCH --gres=gpu:1k\n", "gpus_total", 1024),
    ("#SBATCH -N 0 --gres=gpu:1\n", "gpus_total", 0),
    ("#SBATCH -N 1k\n", "nodes", 1024),
    ("#SBATCH -p\n#SBATCH gpu-small\n", "partition", "gpu-small"),
])
def test_read_as_sbatch_reads(body: str, field: str, want: object) -> None:
    assert _job(body).to_json()[field] == want


def test_pbs_under_the_environment_and_command_line_and_ignored_on_request() -> None:
    body = "#PBS -q gpu-small\n"
    assert _job(body, ["-p", "debug"]).main.partition == "debug"
    assert _job(body, env={"SBATCH_PARTITION": "debug"}).main.partition == "debug"
    assert _job(body, ["--ignore-pbs"]).main.partition is None
    assert _job("#SBATCH --ignore-pbs\n" + body).main.partition is None
    assert _job(body, env={"SBATCH_IGNORE_PBS": "1"}).main.partition is None
    assert _job(body, env={"SBATCH_IGNORE_PBS": "0"}).main.partition == "gpu-small"


def test_b_and_threads_per_core_make_the_task_count() -> None:
    assert _job("#SBATCH -N 1 -B 1:2:2 --gpus-per-task=1\n").gpus_total == 4
    assert _job("#SBATCH -N 1 -B 1:2 --gpus-per-task=1\n", env={"SBATCH_THREADS_PER_CORE": "2"}).gpus_total == 4


@pytest.mark.parametrize(("body", "fragment"), [
    ("#PBS -Y\n", "invalid option"),
    ("#PBS foo -q gpu\n", "Invalid argument: foo"),
    ("#PBS -q\n", "requires an argument"),
])
def test_pbs_refusals_name_the_line(body: str, fragment: str) -> None:
    with pytest.raises(InputError) as err:
        _job(body)
    assert fragment in str(err.value) and "job.sh:2" in str(err.value) and err.value.exit_code == 1
