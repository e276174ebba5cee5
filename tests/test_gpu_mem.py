"""gsbatch --gpu-mem=SIZE: a GPU type with at least that memory per GPU (issue 15, item 1).

Unit tests decide with the sample config's rules decider; the tests marked ``slurm`` submit held
jobs through gsbatch and plain sbatch to the local cluster, and ``scontrol show job`` says what
Slurm made of them.
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
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.gpu_mem import GpuMemAsk, decide_gpu_mem
from slurmgpu.pipeline.plan import make_plan
from slurmgpu.pipeline.policy import KeepDecider, RuleDecider, make_decider
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import parse_gpu_mem, parse_script
from slurmgpu.slurm.backend import Submitted

ROOT = Path(__file__).resolve().parent.parent
CONFIG = load_config(ROOT / "contrib" / "slurmgpu.toml")
MEM = {name: t.memory_gib for name, t in CONFIG.gpu_types.items()}
BIN = Path(sys.executable).parent


def plan_of(text: str, options: list[str] | None = None, gpu_mem: str | None = None, decider=None, **kw):
    script = parse_script(text.encode(), "job.sh")
    return make_plan(script, options or [], {}, decider or make_decider(CONFIG), CONFIG.gpu_features(),
                     gpu_mem=gpu_mem, **kw)


def job(*directives: str) -> str:
    return "#!/bin/bash\n" + "".join(d + "\n" for d in directives) + "srun python train.py\n"


@pytest.mark.parametrize(("spelled", "gib"), [("24G", 24.0), ("40GB", 40.0), ("80GiB", 80.0), ("24000M", 24000 / 1024),
                                              ("16g", 16.0), ("1T", 1024.0), ("0.5G", 0.5), ("  8 GiB ", 8.0)])
def test_sizes_are_read_in_powers_of_1024(spelled: str, gib: float) -> None:
    assert parse_gpu_mem(spelled) == pytest.approx(gib)


@pytest.mark.parametrize("bad", ["", "24", "G", "-4G", "0G", "24X", "24 G B", None])
def test_unreadable_sizes_are_refused_naming_the_option(bad: str | None) -> None:
    with pytest.raises(InputError) as err:
        parse_gpu_mem(bad)
    assert err.value.option == "--gpu-mem"


@pytest.mark.parametrize("argv", [["--gpu-mem=24G", "job.sh", "a"], ["--gpu-mem", "24G", "job.sh", "a"],
                                  ["-p", "gpu", "--gpu-mem", "24G", "--hold", "job.sh", "a"]])
def test_the_option_is_gsbatchs_own_and_never_reaches_sbatch(argv: list[str]) -> None:
    inv = gsbatch.parse_invocation(argv)
    assert inv.gpu_mem == "24G" and inv.script == "job.sh" and inv.script_args == ("a",)
    assert not any("gpu-mem" in w or w == "24G" for w in inv.sbatch_words())


def test_without_a_size_it_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "job.sh"
    p.write_text(job("#SBATCH --gres=gpu:1"))
    code = gsbatch.main(["--gpu-mem", "--hold", str(p)], env=_env(), backend=_NoSubmit(),
                        decider=RuleDecider(CONFIG))
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("gsbatch: error: command line: --gpu-mem: needs a size")


# (partition, size in GiB) -> the type chosen (balanced: the smallest card that holds it) and the
# partition written (None: the job's own stays).
MATRIX = {
    ("gpu", 8): ("v100", None), ("gpu", 16): ("v100", None), ("gpu", 20): ("v100", None),
    ("gpu", 40): ("a100", None), ("gpu", 80): ("a100", None),
    ("gpu-small", 8): ("t4", None), ("gpu-small", 16): ("t4", None), ("gpu-small", 20): ("v100", "gpu"),
    ("gpu-small", 40): ("a100", "gpu"), ("gpu-small", 80): ("a100", "gpu"),
    # debug is not in the config: without Slurm's node view the job goes to a configured partition
    # that has the type
    ("debug", 8): ("t4", "gpu-small"), ("debug", 16): ("t4", "gpu-small"), ("debug", 20): ("v100", "gpu"),
    ("debug", 40): ("a100", "gpu"), ("debug", 80): ("a100", "gpu"),
}
# gsbatch reads Slurm's nodes for a partition the config does not describe: debug (both nodes)
# holds every type, so the partition the user named is kept.
# One GPU, not MATRIX's two: a MIG slice of partition mig (40 GiB) is the smallest card holding 40 GiB.
LIVE = {**MATRIX, **{("debug", gib): (gtype, None) for (part, gib), (gtype, _) in MATRIX.items() if part == "gpu"},
        ("debug", 8): ("t4", None), ("debug", 16): ("t4", None), ("gpu-small", 40): ("a100_3g.40gb", "mig")}


@pytest.mark.parametrize(("partition", "gib"), sorted(MATRIX))
def test_the_smallest_type_that_holds_it_is_chosen_on_every_partition(partition: str, gib: int) -> None:
    gtype, moved = MATRIX[(partition, gib)]
    p = plan_of(job(f"#SBATCH -p {partition}", "#SBATCH --gres=gpu:2"), gpu_mem=f"{gib}G")
    change = p.decision.changes[0]
    assert (change.gpu_type, change.partition, change.gpus_total) == (gtype, moved, None)
    assert MEM[gtype] >= gib
    text = p.submission.script_text or ""
    assert f"#SBATCH --gres=gpu:{gtype}:2\n" in text  # the count stays as asked
    assert f"# slurmgpu: why: --gpu-mem {gib} GiB: " in text
    assert f"{gtype} ({MEM[gtype]:g} GiB) chosen (balanced" in text
    if moved:
        assert f"#SBATCH -p {moved}\n" in text.replace("--partition=", "-p ")


def test_the_reason_names_the_types_too_small_and_the_objective() -> None:
    p = plan_of(job("#SBATCH -p gpu-small", "#SBATCH --gres=gpu:1"), gpu_mem="24G")
    assert p.decision.reasons == ("--gpu-mem 24 GiB: t4 has 16 GiB, v100 (32 GiB) chosen (balanced: the smallest "
                                  "card that holds it); partition gpu-small has none that large, moved to gpu, "
                                  "which has v100",)


@pytest.mark.parametrize(("objective", "gtype"), [("fastest", "a100"), ("cheapest", "a100"), ("balanced", "v100")])
def test_the_objective_chooses_among_the_types_that_hold_it(objective: str, gtype: str) -> None:
    config = CONFIG._replace(policy=CONFIG.policy._replace(objective=objective))
    p = plan_of(job("#SBATCH --gres=gpu:1"), gpu_mem="24G", decider=RuleDecider(config))
    assert p.decision.changes[0].gpu_type == gtype and f"chosen ({objective}" in p.decision.reasons[0]


def test_fastest_reads_the_speed_of_the_jobs_precision() -> None:
    """An admin's l40s beside the a100: slower for 16-bit jobs, faster for 32-bit ones
    (``relative_speed_fp32``). Under ``fastest`` a --fp16 job gets the a100, a plain one the l40s."""
    from slurmgpu.pipeline.config import GpuType

    gpu = CONFIG.partitions["gpu"]
    config = CONFIG._replace(gpu_types={**CONFIG.gpu_types, "l40s": GpuType("l40s", 48, 0.7, 1.0, fp32_speed=1.5)},
                             partitions={**CONFIG.partitions, "gpu": gpu._replace(gpu_types=(*gpu.gpu_types, "l40s"))},
                             policy=CONFIG.policy._replace(objective="fastest"))
    for flag, gtype in (("", "l40s"), (" --fp16", "a100")):
        text = job("#SBATCH --gres=gpu:1").replace("train.py", "train.py" + flag)
        p = plan_of(text, gpu_mem="24G", decider=RuleDecider(config))
        assert p.decision.changes[0].gpu_type == gtype, (flag, p.decision.reasons)


def test_a_job_without_gpus_gets_one() -> None:
    p = plan_of(job("#SBATCH -J nogpu", "#SBATCH --gres=tmpfs:10G"), gpu_mem="30G")
    assert "#SBATCH --gres=tmpfs:10G,gpu:v100:1\n" in (p.submission.script_text or "")
    p = plan_of(job("#SBATCH -J nogpu"), gpu_mem="30G")
    text = p.submission.script_text or ""
    assert "#SBATCH -J nogpu\n#SBATCH --gres=gpu:v100:1\n" in text and "1 x v100 added" in text


def test_a_requested_type_that_holds_it_stays() -> None:
    p = plan_of(job("#SBATCH --gres=gpu:a100:1"), gpu_mem="24G")
    assert not p.decision.changed and p.decision.reasons == ("--gpu-mem 24 GiB: the requested a100 has 80 GiB; "
                                                             "request kept",)
    moved = plan_of(job("#SBATCH -p gpu-small", "#SBATCH --gres=gpu:v100:1"), gpu_mem="24G")
    assert moved.decision.changes[0].partition == "gpu" and moved.decision.changes[0].gpu_type is None
    small = plan_of(job("#SBATCH --gres=gpu:v100:4"), gpu_mem="40G")
    assert small.decision.changes[0].gpu_type == "a100" and "--gres=gpu:a100:4" in (small.submission.script_text or "")


def test_command_line_wins_over_the_script_and_the_script_form_works_alone() -> None:
    text = job("#SBATCH -p gpu", "#GSBATCH --gpu-mem=40G", "#SBATCH --gres=gpu:1")
    assert plan_of(text).decision.changes[0].gpu_type == "a100"
    assert plan_of(text, gpu_mem="8G").decision.changes[0].gpu_type == "v100"
    spaced = job("#GSBATCH --gpu-mem 40GB   # big model", "#SBATCH --gres=gpu:1")
    assert plan_of(spaced).decision.changes[0].gpu_type == "a100"
    assert not parse_script(spaced.encode()).ignored


def test_a_bad_size_in_the_script_names_file_and_line() -> None:
    with pytest.raises(InputError) as err:
        plan_of(job("#SBATCH --gres=gpu:1", "#GSBATCH --gpu-mem=lots"))
    assert str(err.value).startswith("job.sh:3: --gpu-mem: cannot read size 'lots'")


def test_no_type_anywhere_is_a_refusal_naming_the_option() -> None:
    p = plan_of(job("#SBATCH --gres=gpu:1"), gpu_mem="100G")
    assert p.decision.refusal == ("command line: --gpu-mem 100 GiB: no configured GPU type has that much memory "
                                  "per GPU (largest: a100, 80 GiB)")
    pinned = plan_of(job("#SBATCH --gres=gpu:1 --constraint=t4"), gpu_mem="24G")
    assert pinned.decision.refusal == "command line: --gpu-mem 24 GiB: --constraint pins t4 (16 GiB)"


def test_a_partition_that_does_not_admit_the_job_is_not_used() -> None:
    def admits(partition: str, comp: object) -> str | None:
        return "account proj-x may not use it" if partition == "gpu" else None

    # two GPUs: partition mig's 40 GiB slices, which admit the job, are no GPUs of a multi-GPU job
    p = plan_of(job("#SBATCH -p gpu-small", "#SBATCH --gres=gpu:2"), gpu_mem="24G",
                decider=RuleDecider(CONFIG, admits))
    assert p.decision.refusal and "no partition that has one admits the job (gpu: account proj-x may not use it)" \
        in p.decision.refusal


def test_opt_outs_refuse_and_keep_deciders_apply_it_by_the_config() -> None:
    """Issue 28 item 2: the user's own ask is never dropped (it once went with a note, GPU-less)."""
    text = job("#SBATCH --gres=gpu:1")
    for p in (plan_of(text, gpu_mem="24G", no_rewrite=True),
              plan_of(job("#GSBATCH --no-rewrite", "#SBATCH --gres=gpu:1"), gpu_mem="24G"),
              plan_of(text, gpu_mem="24G", decider=KeepDecider("policy.decider = keep"))):
        assert not p.decision.changed and p.decision.refusal and "cannot be" in p.decision.refusal
    kept = plan_of(text, gpu_mem="24G", decider=KeepDecider("policy.decider = keep"), config=CONFIG)
    assert kept.decision.changes[0].gpu_type == "v100" and kept.decision.asked == "--gpu-mem 24 GiB"


def test_a_request_that_cannot_be_rewritten_is_refused() -> None:
    p = plan_of(job("#SBATCH --gres=gpu:1 --gpus=2"), gpu_mem="24G")
    assert p.decision.refusal
    assert p.decision.refusal.startswith("command line: --gpu-mem 24 GiB: the GPU request cannot be rewritten")


def test_decision_is_explained_and_shown_by_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "job.sh"
    p.write_text(job("#SBATCH -p gpu-small", "#SBATCH --gres=gpu:1"))
    code = gsbatch.main(["--dry-run", "--explain", "--gpu-mem=20G", str(p)], env=_env(), backend=_NoSubmit(),
                        decider=RuleDecider(CONFIG))
    out, err = capsys.readouterr()
    assert code == 0 and "#SBATCH --gres=gpu:v100:1\n" in out and "#SBATCH --partition=gpu\n" in out
    assert "gsbatch: explain: change (component 0): gpu_type=v100, partition=gpu" in err
    assert "gsbatch: note: GPU request changed: --gpu-mem 20 GiB: t4 has 16 GiB, v100 (32 GiB) chosen" in err


def test_sbatch_gets_the_rewrite_and_never_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backend = _Recording()
    p = tmp_path / "job.sh"
    p.write_text(job("#SBATCH --gres=gpu:1"))
    assert gsbatch.main(["--gpu-mem", "40G", "--hold", str(p)], env=_env(), backend=backend,
                        decider=RuleDecider(CONFIG)) == 0
    (words, script), = backend.calls
    assert words[0] == "--hold" and words[1:] and not any("gpu-mem" in w for w in words)
    assert "#SBATCH --gres=gpu:a100:1\n" in script
    refused = gsbatch.main(["--gpu-mem=100G", str(p)], env=_env(), backend=backend, decider=RuleDecider(CONFIG))
    err = capsys.readouterr().err.splitlines()
    assert refused == 1 and len(backend.calls) == 1
    assert err[-1] == ("gsbatch: error: command line: --gpu-mem 100 GiB: no configured GPU type has that much memory "
                       "per GPU (largest: a100, 80 GiB)")


def test_an_internal_failure_still_submits_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import slurmgpu.pipeline.plan as plan_module

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(plan_module, "decide_gpu_mem", broken)
    backend = _Recording()
    p = tmp_path / "job.sh"
    p.write_text(job("#SBATCH --gres=gpu:1"))
    assert gsbatch.main(["--gpu-mem=40G", str(p)], env=_env(), backend=backend, decider=RuleDecider(CONFIG)) == 0
    (words, script), = backend.calls
    assert words == [str(p)] and script is None  # the job as written, gsbatch's own option left out
    assert capsys.readouterr().err.count("warning: slurmgpu failed (RuntimeError: boom)") == 1


def test_an_option_cluster_on_the_command_line_keeps_its_flags(tmp_path: Path) -> None:
    """'-HG1': the count is rewritten and -H kept (the job once went as written, on a 16 GiB t4)."""
    backend = _Recording()
    p = tmp_path / "job.sh"
    p.write_text(job())
    assert gsbatch.main(["--gpu-mem=20G", "-HG1", "-p", "gpu-small", str(p)], env=_env(), backend=backend,
                        decider=RuleDecider(CONFIG)) == 0
    (words, _), = backend.calls
    assert words[:3] == ["-H", "--gpus=v100:1", "--partition=gpu"] and words[3].endswith("/job.sh"), words


def test_a_rewrite_that_cannot_be_written_refuses_rather_than_ignore_the_memory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import slurmgpu.pipeline.plan as plan_module
    from slurmgpu.pipeline.rewrite import RewriteError, apply

    def unwritable(request, decision):
        if decision.changed:
            raise RewriteError("no way to write it")
        return apply(request, decision)

    monkeypatch.setattr(plan_module, "apply", unwritable)
    backend = _Recording()
    p = tmp_path / "job.sh"
    p.write_text(job("#SBATCH --gres=gpu:1 -p gpu-small"))
    assert gsbatch.main(["--gpu-mem=20G", str(p)], env=_env(), backend=backend, decider=RuleDecider(CONFIG)) == 1
    assert not backend.calls
    assert capsys.readouterr().err == ("gsbatch: error: command line: --gpu-mem 20 GiB: the GPU request cannot be "
                                       "rewritten (no way to write it)\n")


def test_decide_gpu_mem_keeps_the_count_on_several_nodes() -> None:
    text = job("#SBATCH -N 1 --gpus-per-node=3")
    request = build_request(parse_script(text.encode()), [], {}, CONFIG.gpu_features())
    d = decide_gpu_mem(RuleDecider(CONFIG), request, GpuMemAsk(24.0, "24G", "command line"))
    assert d.changes[0].gpu_type == "v100" and d.changes[0].gpus_total is None


class _NoSubmit:
    name = "no-submit"

    def submit(self, *args: object, **kwargs: object) -> Submitted:
        raise AssertionError("must not submit")


class _Recording:
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str | None]] = []

    def submit(self, words: list[str], env: object, stdin: object = None) -> Submitted:
        script = Path(words[-1]).read_text() if "gsbatch-" in words[-1] else None
        self.calls.append((list(words), script))
        return Submitted(0, "1")


def _env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "SLURMGPU_SUBMISSION_SPOOL": os.devnull + ".d", "HOME": "/nonexistent"}


# --- the live cluster -------------------------------------------------------------------------------

JOB_NAME = f"gsmem-test-{os.getpid()}"


@pytest.fixture
def held() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    subprocess.run(["scancel", *ids], check=False, capture_output=True) if ids else None
    subprocess.run(["scancel", "-n", JOB_NAME], check=False, capture_output=True)


def _gsbatch(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(ROOT / "contrib" / "slurmgpu.toml"),
           "SLURMGPU_SUBMISSION_SPOOL": str(cwd / "spool"), "HOME": str(cwd), "XDG_CACHE_HOME": str(cwd)}
    return subprocess.run(["gsbatch", *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=60,
                          check=False)


def _tres_type(job_id: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                         check=True).stdout
    info = dict(re.findall(r"(\w+)=(\S*)", out))
    m = re.fullmatch(r"(?:gres[:/])?gpu:([\w.]+):(\d+)", info.get("TresPerNode", ""))
    assert m, out
    return m.group(1), info["Partition"]


@pytest.mark.slurm
@pytest.mark.parametrize("partition", ["gpu", "gpu-small", "debug"])
def test_slurm_allocates_a_type_with_at_least_the_asked_memory(partition: str, tmp_path: Path,
                                                                held: list[str]) -> None:
    """Sizes 8G, 16G, 20G, 40G, 80G on every partition of the local cluster, submitted held through
    gsbatch: scontrol's TRES type has at least that memory (per the config); 100G is one error
    line and no job."""
    p = tmp_path / "mem.sh"
    p.write_text(job(f"#SBATCH -p {partition}", "#SBATCH --gres=gpu:1"))
    for size in (8, 16, 20, 40, 80):
        res = _gsbatch(["--hold", "--parsable", "-J", JOB_NAME, f"--gpu-mem={size}G", str(p)], tmp_path)
        assert res.returncode == 0, res.stderr
        held.append(res.stdout.strip().split(";")[0])
        gtype, where = _tres_type(held[-1])
        assert MEM[gtype] >= size, (size, gtype, res.stderr)
        assert (gtype, None if where == partition else where) == LIVE[(partition, size)], (size, res.stderr)
    before = subprocess.run(["squeue", "-h", "-n", JOB_NAME, "-o", "%i"], capture_output=True, text=True).stdout
    res = _gsbatch(["--hold", "--parsable", "-J", JOB_NAME, "--gpu-mem=100G", str(p)], tmp_path)
    after = subprocess.run(["squeue", "-h", "-n", JOB_NAME, "-o", "%i"], capture_output=True, text=True).stdout
    assert res.returncode == 1 and res.stdout == "" and res.stderr.count("\n") == 1, res.stderr
    assert "--gpu-mem 100 GiB: no configured GPU type" in res.stderr and before == after


@pytest.mark.slurm
def test_plain_sbatch_accepts_the_documented_gsbatch_gpu_mem_line(tmp_path: Path, held: list[str]) -> None:
    """README documents '#GSBATCH --gpu-mem=24G': plain sbatch must take the script as it is, and
    gsbatch reads it (the script form alone picks the type)."""
    p = tmp_path / "doc.sh"
    p.write_text(job("#SBATCH --gres=gpu:1", "#GSBATCH --gpu-mem=24G"))
    res = subprocess.run(["sbatch", "--hold", "--parsable", "-J", JOB_NAME, str(p)], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stderr
    held.append(res.stdout.strip().split(";")[0])
    res = _gsbatch(["--hold", "--parsable", "-J", JOB_NAME, str(p)], tmp_path)
    assert res.returncode == 0, res.stderr
    held.append(res.stdout.strip().split(";")[0])
    assert _tres_type(held[-1]) == ("v100", "gpu")
