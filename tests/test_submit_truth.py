"""What gsbatch does and says at submit time is true (issue 28): the user's own --gpu-mem is applied
in every mode or refused, a named partition that holds the ask is kept, advice says when the job as
written cannot run, a predicted out-of-memory is said, hints never claim a fit the prediction denies,
typos are said, and errors name where the option was set.

Unit tests run gsbatch.main with a backend that records what sbatch would get; the tests marked
``slurm`` submit held jobs to the local cluster and read ``scontrol show job``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgpu.apps import gsbatch
from slurmgpu.slurm.backend import Submitted

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = Path(sys.executable).parent


class Recording:
    """A backend that records sbatch's words and the script it would read, and submits nothing."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str]] = []

    def submit(self, words: list[str], env: object, stdin: object = None) -> Submitted:
        self.calls.append((list(words), Path(words[-1]).read_text()))
        return Submitted(0, "1")


def job(*directives: str, command: str = "srun python train.py") -> str:
    return "#!/bin/bash\n" + "".join(d + "\n" for d in directives) + command + "\n"


def env_for(tmp_path: Path, config: Path | str = SAMPLE) -> dict[str, str]:
    """gsbatch's environment: this checkout's code, the config, a spool of the test's own."""
    (tmp_path / "spool").mkdir(exist_ok=True)
    return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SLURMGPU_CONFIG": str(config),
            "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path),
            "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool")}


def run(tmp_path: Path, argv: list[str], text: str, config: Path | str = SAMPLE,
        backend: Recording | None = None) -> tuple[int, list[str], Recording]:
    """gsbatch.main on a script holding TEXT: exit code, stderr lines, the recording backend."""
    script = tmp_path / "job.sh"
    script.write_text(text)
    backend = backend or Recording()
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = gsbatch.main([*argv, str(script)], env=env_for(tmp_path, config), backend=backend)
    return code, err.getvalue().splitlines(), backend


def config_with(tmp_path: Path, old: str, new: str, extra: str = "") -> Path:
    """The sample config with one line changed (and EXTRA appended)."""
    text = SAMPLE.read_text()
    assert old in text
    path = tmp_path / "slurmgpu.toml"
    path.write_text(text.replace(old, new) + extra)
    return path


# --- item 13: an error names where the option was set ---------------------------------------------


def test_a_bad_time_on_the_command_line_is_not_blamed_on_the_script(tmp_path: Path) -> None:
    code, err, backend = run(tmp_path, ["-t", "abc"], job("#SBATCH -J x", "#SBATCH -t 10", "#SBATCH --gres=gpu:1"))
    assert (code, err) == (255, ["gsbatch: error: command line: --time: invalid time limit 'abc'"])
    assert not backend.calls


def test_a_gpu_mem_refusal_names_the_command_line_or_the_line(tmp_path: Path) -> None:
    text = job("#SBATCH --gres=gpu:1", "#GSBATCH --gpu-mem=100G")
    code, err, _ = run(tmp_path, ["--gpu-mem", "120G"], text)
    assert (code, err) == (1, ["gsbatch: error: command line: --gpu-mem 120 GiB: no configured GPU type has that "
                               "much memory per GPU (largest: a100, 80 GiB)"])
    code, err, _ = run(tmp_path, [], text)
    assert code == 1 and err == [f"gsbatch: error: {tmp_path / 'job.sh'}:3: --gpu-mem 100 GiB: no configured GPU "
                                 "type has that much memory per GPU (largest: a100, 80 GiB)"]
    code, err, _ = run(tmp_path, ["--gpu-mem=12"], text)
    assert code == 1 and err[0].startswith("gsbatch: error: command line: --gpu-mem: cannot read size '12'")


# --- item 2: the user's own --gpu-mem is applied in every mode, or refused -------------------------

ADVISE = ('mode = "rewrite"', 'mode = "advise"')
MEM_JOB = job("#SBATCH -J x", "#GSBATCH --gpu-mem=24G")


def waiver_for(text: str) -> str:
    import pwd

    from slurmgpu.pipeline.features import script_features

    user, family = pwd.getpwuid(os.getuid()).pw_name, script_features(text)["family"]
    return (f'\n[[waivers]]\nuser = "{user}"\nfamily = "{family}"\n'
            'reason = "A/B test"\nowner = "hpc-admin"\nexpires = 2999-12-31\n')


@pytest.mark.parametrize("setting", ["advise", "waiver", "keep decider"])
def test_the_gpu_mem_ask_is_applied_in_advise_mode_under_a_waiver_and_with_the_keep_decider(
        tmp_path: Path, setting: str) -> None:
    """Advise mode gave 'advice: 1 x v100 instead of 0 x any GPU ...; submitted as written' and a
    GPU-less job; modes, waivers and the decider govern slurmgpu's own changes, not the user's ask."""
    config = {"advise": lambda: config_with(tmp_path, *ADVISE),
              "waiver": lambda: config_with(tmp_path, 'mode = "rewrite"', 'mode = "rewrite"', waiver_for(MEM_JOB)),
              "keep decider": lambda: config_with(tmp_path, 'decider = "rules"', 'decider = "keep"')}[setting]()
    code, err, backend = run(tmp_path, ["--hold"], MEM_JOB, config)
    (words, script), = backend.calls
    assert code == 0 and "#SBATCH --gres=gpu:v100:1\n" in script, (err, script)
    assert err == ["gsbatch: note: GPU request changed: --gpu-mem 24 GiB: v100 (32 GiB) chosen (balanced: the "
                   "smallest card that holds it); the job asked for no GPU: 1 x v100 added"]


def test_without_a_usable_config_the_gpu_mem_ask_is_refused_not_dropped(tmp_path: Path) -> None:
    """It was 'note: --gpu-mem 24 GiB not applied: keep decider', exit 0 and a GPU-less job."""
    code, err, backend = run(tmp_path, [], MEM_JOB, config=tmp_path / "missing.toml")
    assert code == 1 and not backend.calls
    assert err == [f"gsbatch: error: {tmp_path / 'job.sh'}:3: --gpu-mem 24 GiB: cannot be met without a usable "
                   f"slurmgpu config (slurmgpu config unusable ({tmp_path / 'missing.toml'}: config file not found)); "
                   "nothing submitted"]
    code, err, backend = run(tmp_path, [], job("#SBATCH --gres=gpu:1"), config=tmp_path / "missing.toml")
    assert code == 0 and len(backend.calls) == 1 and err[0].endswith("; submitting as written")


@pytest.mark.parametrize(("argv", "text", "opt_out"), [
    (["--no-rewrite"], MEM_JOB, "--no-rewrite"),
    (["--gpu-mem=24G"], job("#GSBATCH --no-rewrite"), "'#GSBATCH --no-rewrite'")])
def test_gpu_mem_with_no_rewrite_is_refused_not_dropped(tmp_path: Path, argv: list[str], text: str,
                                                        opt_out: str) -> None:
    code, err, backend = run(tmp_path, argv, text)
    assert code == 1 and not backend.calls and len(err) == 1
    assert err[0].endswith(f"--gpu-mem 24 GiB: cannot be applied: {opt_out} keeps the request as written; "
                           "drop one of them"), err


JOB_NAME = f"gstruth-{os.getpid()}"


@pytest.fixture
def held() -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], check=False, capture_output=True)


def live_gsbatch(tmp_path: Path, argv: list[str], config: Path = SAMPLE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["gsbatch", *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=env_for(tmp_path, config), timeout=60, check=False)


def show_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


@pytest.mark.slurm
def test_slurm_gets_the_gpu_mem_asked_in_advise_mode(tmp_path: Path, held: list[str]) -> None:
    (tmp_path / "mem.sh").write_text(MEM_JOB)
    res = live_gsbatch(tmp_path, ["--hold", "--parsable", "-J", JOB_NAME, "mem.sh"], config_with(tmp_path, *ADVISE))
    assert res.returncode == 0, res.stderr
    held.append(res.stdout.strip().split(";")[0])
    info = show_job(held[-1])
    assert re.fullmatch(r"(?:gres[:/])?gpu:v100:1", info.get("TresPerNode", "")), info


@pytest.mark.slurm
@pytest.mark.parametrize(("directive", "cli", "env"), [("#SBATCH -t 0:02:00\n", [], {}),
                                                    ("#SBATCH --time=9\n", ["--time=2"], {}),
                                                    ("", [], {"SBATCH_TIMELIMIT": "2"})])
def test_slurm_gets_the_longer_time_limit_of_a_move_where_the_user_wrote_theirs(
        tmp_path: Path, held: list[str], directive: str, cli: list[str], env: dict[str, str]) -> None:
    """A move to a slower card with a longer limit (ComponentChange.time_limit_s) is written where the
    limit the job has was set: in the script, on the command line or in SBATCH_TIMELIMIT."""
    from slurmgpu.pipeline.policy import ComponentChange, Decision
    from slurmgpu.pipeline.request import build_request
    from slurmgpu.pipeline.rewrite import apply
    from slurmgpu.pipeline.script import parse_script

    text = f"#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n{directive}python train.py\n"
    request = build_request(parse_script(text.encode(), "job.sh"), cli, env)
    assert request.main.time_limit_s == 120
    sub = apply(request, Decision((ComponentChange(0, gpu_type="v100", time_limit_s=300),), ("moved",), decider="t"))
    (tmp_path / "job.sh").write_text(sub.script_text or "")
    res = subprocess.run(["sbatch", "--hold", "--parsable", "-J", JOB_NAME, *sub.cli_words, "job.sh"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, **env, **sub.env_overrides}, check=False)
    assert res.returncode == 0, res.stderr
    held.append(res.stdout.strip().split(";")[0])
    info = show_job(held[-1])
    assert info["TimeLimit"] == "00:05:00", info
    assert re.fullmatch(r"(?:gres[:/])?gpu:v100:1", info.get("TresPerNode", "")), info


# --- item 10: typos are said ------------------------------------------------------------------------


def test_an_unknown_gsbatch_option_is_one_warning_with_the_name_meant(tmp_path: Path) -> None:
    """'#GSBATCH --gpu-memory=24G' was ignored with no word: the job went without the memory asked."""
    code, err, backend = run(tmp_path, [], job("#SBATCH --gres=gpu:1", "#GSBATCH --gpu-memory=24G"))
    assert code == 0 and len(backend.calls) == 1  # sbatch ignores the line: never refused
    assert err == [f"gsbatch: warning: {tmp_path / 'job.sh'}:3: unknown gsbatch option --gpu-memory=24G "
                   "(did you mean --gpu-mem?); the line is ignored"]


@pytest.mark.parametrize(("typed", "said"), [
    ("--gpu-men=24G", "unrecognized option '--gpu-men' (did you mean --gpu-mem?)"),
    ("--dryrun", "unrecognized option '--dryrun' (did you mean --dry-run?)"),
    ("-X", "invalid option -- 'X'")])
def test_dry_run_refuses_an_option_sbatch_refuses(tmp_path: Path, typed: str, said: str) -> None:
    """'gsbatch --dry-run --gpu-men=24G' exited 0 while the real submission failed with 255."""
    code, err, backend = run(tmp_path, ["--dry-run", typed], job("#SBATCH --gres=gpu:1"))
    assert (code, err) == (255, [f"gsbatch: error: command line: {said}"]) and not backend.calls


@pytest.mark.slurm
def test_slurm_refuses_the_option_dry_run_refuses_with_the_same_status(tmp_path: Path) -> None:
    (tmp_path / "job.sh").write_text(job("#SBATCH --gres=gpu:1"))
    real = subprocess.run(["sbatch", "--hold", "--gpu-men=24G", "job.sh"], capture_output=True, text=True,
                          cwd=tmp_path, check=False)
    dry = live_gsbatch(tmp_path, ["--dry-run", "--gpu-men=24G", "job.sh"])
    assert real.returncode == dry.returncode == 255 and "unrecognized option '--gpu-men" in real.stderr, real.stderr
    assert dry.stdout == "" and dry.stderr.count("\n") == 1


# --- item 4: advice that can be true -----------------------------------------------------------------

BERT = ROOT / "contrib" / "examples" / "bert_finetune.sh"
CANNOT_RUN = ("gsbatch: advice: as written the job cannot run: GPU type a100 is not in partition gpu-small; moved to "
              "gpu, which has it (1 x a100 in partition gpu instead of 1 x a100 in partition gpu-small); submitted as "
              "written")


def test_advice_says_when_the_job_as_written_cannot_run(tmp_path: Path) -> None:
    code, err, backend = run(tmp_path, [], BERT.read_text(), config_with(tmp_path, *ADVISE))
    assert code == 0 and backend.calls and CANNOT_RUN in err, err


def test_advice_with_finish_times_never_compares_with_a_job_that_cannot_start() -> None:
    """The model's advice said '1 x a100 in partition gpu would finish in ~4 min vs ~4 min as asked' for
    a job Slurm refuses ('Requested node configuration is not available'), the rule's reason dropped."""
    from slurmgpu.pipeline.modes import advice_line

    row = {"gpu_type": "a100", "gpus": 1, "expected_wait_s": 0.0, "pred_runtime_s": 240.0}
    decision = {"changes": [{"index": 0, "gpu_type": None, "gpus_total": None, "partition": "gpu"}],
                "reasons": ["GPU type a100 is not in partition gpu-small; moved to gpu, which has it",
                            "model: the request as asked is predicted best (balanced); no further change"],
                "per_type": [row]}
    original = {"gpu_type": "a100", "gpus_total": 1, "partition": "gpu-small"}
    line = advice_line(original, {**decision, "unrunnable": "GPU type a100 is not in partition gpu-small"})
    assert line.startswith("as written the job cannot run: GPU type a100 is not in partition gpu-small;")
    assert "would finish" not in line
    # a job that can run as asked: the times, and the rules' reason with them
    faster = {**decision, "per_type": [row, {**row, "gpu_type": "v100", "pred_runtime_s": 120.0}],
              "changes": [{"index": 0, "gpu_type": "v100", "gpus_total": None, "partition": None}],
              "reasons": ["GPU type a100 is not in partition gpu-small; moved to gpu, which has it", "model: faster"]}
    assert advice_line(original, faster) == ("1 x v100 would finish in ~2 min vs ~4 min as asked (50% sooner); GPU "
                                              "type a100 is not in partition gpu-small; moved to gpu, which has it; "
                                              "submitted as written")


@pytest.mark.slurm
def test_slurm_refuses_the_job_advice_calls_unrunnable(tmp_path: Path) -> None:
    """What the advice says is Slurm's answer too: the job as written is refused."""
    (tmp_path / "bert.sh").write_text(BERT.read_text())
    # not held (Slurm takes a held job it can never start), and with a memory the node has
    res = live_gsbatch(tmp_path, ["--parsable", "--mem=100M", "-c", "1", "-J", JOB_NAME, "bert.sh"],
                       config_with(tmp_path, *ADVISE))
    if res.returncode == 0:  # never expected: cancel what went in
        subprocess.run(["scancel", res.stdout.strip().split(";")[0]], check=False)
    assert res.returncode != 0 and "Requested node configuration is not available" in res.stderr, res.stderr
    assert CANNOT_RUN in res.stderr.splitlines()


# --- item 5: a predicted out-of-memory is said ---------------------------------------------------------


class Predicted:
    """A model decider's decision without a model: the request kept, its row in the table predicted
    at 24.2 GiB on a 16 GiB t4 (the job went with no word unless --explain)."""

    name = "model"

    def __init__(self, changes: tuple = ()) -> None:
        self.changes = changes

    def decide(self, request: object) -> object:
        from slurmgpu.pipeline.policy import Candidate, Decision

        table = (Candidate("t4", 1, False, 24.2 * 1024, 600.0, 0.0, 0.1),
                 Candidate("v100", 1, True, 24.2 * 1024, 300.0, 0.0, 0.1))
        return Decision(self.changes, ("model: no other candidate fits the predicted memory within the time limit; "
                                       "request kept",), decider="model", per_type=table)


T4_JOB = job("#SBATCH -p gpu-small", "#SBATCH --gres=gpu:t4:1", command="python train.py --batch-size 64")
OOM = ("gsbatch: warning: predicted to run out of GPU memory: peak 24.2 GiB per GPU (26.6 GiB with the 10% margin) "
       "does not fit 1 x t4 (16 GiB each)")


@pytest.mark.parametrize("setting", ["kept", "advised"])
def test_a_predicted_oom_where_the_job_goes_is_one_warning(tmp_path: Path, setting: str) -> None:
    from slurmgpu.pipeline.policy import ComponentChange

    script = tmp_path / "job.sh"
    script.write_text(T4_JOB)
    moved = (ComponentChange(0, gpu_type="v100", partition="gpu"),)
    decider, config = (Predicted(), SAMPLE) if setting == "kept" else \
        (Predicted(moved), config_with(tmp_path, *ADVISE))
    backend = Recording()
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = gsbatch.main([str(script)], env=env_for(tmp_path, config), backend=backend, decider=decider)
    assert code == 0 and len(backend.calls) == 1
    assert err.getvalue().splitlines().count(OOM) == 1, err.getvalue()


def test_no_warning_where_the_job_goes_to_a_card_it_fits(tmp_path: Path) -> None:
    from slurmgpu.pipeline.policy import ComponentChange

    script = tmp_path / "job.sh"
    script.write_text(T4_JOB)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = gsbatch.main([str(script)], env=env_for(tmp_path), backend=Recording(),
                            decider=Predicted((ComponentChange(0, gpu_type="v100", partition="gpu"),)))
    assert code == 0 and "run out of GPU memory" not in err.getvalue()


# --- item 6: no line claims a fit with a peak above the card ----------------------------------------


def test_a_fit_on_past_runs_says_so_and_never_reads_as_a_predicted_fit() -> None:
    """The hint said 'batch size 256 would fit 1 x a100 (predicted peak 95.4 GiB of 80 GiB)'."""
    from slurmgpu.pipeline.memory_bound import fit_evidence

    assert fit_evidence(28.2 * 1024, 0.1, 32) == "predicted peak 28.2 GiB of 32 GiB"
    words = fit_evidence(95.4 * 1024, 0.1, 80)
    assert words == ("by its family's runs, which held on 80 GiB cards at this batch or larger; the predicted peak "
                     "95.4 GiB is above the card")
    assert fit_evidence(78 * 1024, 0.1, 80, of_card=False).startswith("by its family's runs")  # with the margin
    for unusable in (math.inf, math.nan):  # a model's peak past any figure: the runs alone, no inf or nan shown
        assert fit_evidence(unusable, 0.1, 32) == ("by its family's runs, which held on 32 GiB cards at this batch "
                                                   "or larger; no usable peak is predicted")


def test_the_explain_table_tells_a_fit_on_past_runs_from_a_predicted_one(tmp_path: Path) -> None:
    """The table said 'a100 1 yes 95.4' of an 80 GiB card."""
    from slurmgpu.pipeline.policy import Candidate, Decision
    from slurmgpu.pipeline.request import build_request
    from slurmgpu.pipeline.script import parse_script

    request = build_request(parse_script(job("#SBATCH --gres=gpu:a100:1").encode()), [], {})
    table = (Candidate("a100", 1, True, 95.4 * 1024, 600.0, 0.0, 0.1), Candidate("v100", 1, True, 20 * 1024, 900.0,
                                                                                 0.0, 0.1))
    text = gsbatch.explain_text(request, Decision(per_type=table, decider="model"), {"a100": 80, "v100": 32})
    rows = [line.split()[2:5] for line in text.splitlines() if re.match(r"gsbatch: explain: +(a100|v100) ", line)]
    assert rows == [["a100", "1", "runs"], ["v100", "1", "yes"]]
    assert "the predicted peak is above it" in text
