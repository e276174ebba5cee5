"""Reading a script costs time linear in its size, and a script too large to read costs a bound.

Each reader of user text in pipeline/ (and each regex family in it) is run on adversarial text of
size n and 4n: a linear reader costs about 4 times as much at 4n, a quadratic one 16 times. The
costs are CPU time, the least of three rounds, so no wall-clock threshold is asserted.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurmgpu.pipeline import features, plan
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.features import script_features
from slurmgpu.pipeline.launch import launch_need
from slurmgpu.pipeline.plan import READ_BUDGET, make_plan
from slurmgpu.pipeline.policy import Decision, KeepDecider, RuleDecider
from slurmgpu.pipeline.request import JobRequest, build_request
from slurmgpu.pipeline.script import parse_script

SHEBANG = "#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:2\n"
BIN = Path(sys.executable).parent


def _cpu(fn: Callable[[Any], object], arg: Any, calls: int) -> float:
    """This thread's CPU seconds for ``calls`` calls, the least of three, with the garbage collector
    paused. The process's CPU time would count every thread an earlier test left running in this
    process (a daemon's watch loop, a fake daemon), which runs longer beside the larger input; and a
    full collection costs in proportion to the whole session's heap, not to the text. One long
    directive measured 9.5x for 4x the text late in the suite with process time, 3.7x alone."""
    best = float("inf")
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            t0 = time.thread_time()
            for _ in range(calls):
                fn(arg)
            best = min(best, time.thread_time() - t0)
    finally:
        if enabled:
            gc.enable()
    return best


def growth(fn: Callable[[Any], object], make: Callable[[int], Any], n: int) -> float:
    """Cost of fn(make(4n)) over that of fn(make(n)), each call repeated to take 20 ms or more at n."""
    small, large = make(n), make(4 * n)
    calls = 1
    while _cpu(fn, small, calls) < 0.02 and calls < 4096:
        calls *= 4
    return _cpu(fn, large, calls) / max(_cpu(fn, small, calls), 1e-9)


def _features(text: str) -> object:
    return features._script_features.__wrapped__(text)  # the reading itself, not its cache


def _parse(text: str) -> object:
    return parse_script(text.encode(), "x.sh")


def _request(text: str) -> object:
    return build_request(parse_script(text.encode(), "x.sh"), [], {}, set())


# (reader, adversarial text of size n, n): every regex family of launch.py, features.py, script.py
# and request.py meets the input that makes a backtracking pattern quadratic.
CASES: dict[str, tuple[Callable[[str], object], Callable[[int], str], int]] = {
    # launch.py: the GPU source (the 242 KB line that took 9 s), launchers, program counts, heredocs,
    # comments, assignments
    "launch: CUDA_VISIBLE_DEVICES repeated": (launch_need, lambda n: SHEBANG + "N=$CUDA_VISIBLE_DEVICES " * n, 500),
    "launch: in a launcher's count": (
        launch_need,
        lambda n: SHEBANG + "torchrun --nproc_per_node=${CUDA_VISIBLE_DEVICES" + "$CUDA_VISIBLE_DEVICES" * n + " a.py",
        500),
    "launch: launchers repeated": (launch_need, lambda n: SHEBANG + "srun " * n + "python x.py\n", 500),
    "launch: python -m and spaces": (launch_need, lambda n: SHEBANG + "python  \t " * n + "-m x\n", 500),
    "launch: program counts": (launch_need, lambda n: SHEBANG + "python x.py" + " --devices" * n + "\n", 500),
    "launch: heredocs": (launch_need, lambda n: SHEBANG + "cat <<" * n + "\n", 500),
    "launch: comments": (launch_need, lambda n: SHEBANG + "srun x #" * n + "\n", 500),
    "launch: assignment": (launch_need, lambda n: SHEBANG + "export N=" + "$N" * n + "\n", 500),
    "launch: many lines": (launch_need, lambda n: SHEBANG + "torchrun --nproc_per_node=2 x.py --bs 8\n" * n, 200),
    # features.py: words, sizes in names, numbers, size words, option values, flags
    "features: many arguments": (_features, lambda n: SHEBANG + "python t.py" + " --model x1b --bs=2" * n + "\n", 500),
    "features: digits and dots": (_features, lambda n: SHEBANG + "python t.py 1" + "1.1 " * n + "\n", 500),
    "features: size words": (_features, lambda n: SHEBANG + "python t.py --model " + "base-x" * n + "\n", 500),
    "features: spaces before a unit": (_features, lambda n: SHEBANG + "python t.py 7" + " " * n + "x\n", 2000),
    "features: quoted words": (_features, lambda n: SHEBANG + "python t.py '" + "a b " * n + "'\n", 500),
    "features: many lines": (_features, lambda n: SHEBANG + "python t.py --fp16\n" * n, 200),
    # script.py: directives, directive-like comments, quoting, the legacy marker
    "script: directive lines": (_parse, lambda n: SHEBANG + "".join(f"#SBATCH --comment=c{i}\n" for i in range(n)),
                                200),
    "script: one long directive": (_parse, lambda n: SHEBANG + "#SBATCH" + " -s" * n + "\n", 500),
    "script: quoted directive": (_parse, lambda n: SHEBANG + "#SBATCH --comment='" + "a \\b " * n + "'\n", 500),
    "script: directive-like comments": (_parse, lambda n: SHEBANG + " " * n + "#" * n + " " * n + "sbatchx\n", 500),
    "script: legacy marker": (_parse, lambda n: SHEBANG + "#SLURMGPU" + " \t" * n + "kee\n", 500),
    # request.py: times, sizes, node counts, constraints
    "request: time": (_request, lambda n: SHEBANG + "#SBATCH --time=" + "0" * n + "1\n", 1000),
    "request: memory": (_request, lambda n: SHEBANG + "#SBATCH --mem=" + "0" * n + "1G\n", 1000),
    "request: nodes": (_request, lambda n: SHEBANG + "#SBATCH --nodes=" + "0" * n + "1-1\n", 1000),
    "request: constraint": (_request, lambda n: SHEBANG + "#SBATCH --constraint=" + "a*1&" * n + "a\n", 500),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reading_is_linear_in_the_text(case: str) -> None:
    reader, make, n = CASES[case]
    # linear: ~4; quadratic: ~16 every time. The least of three, since a busy machine (CI's other
    # work, another test's processes) can slow one measurement of the larger input.
    assert min(growth(reader, make, n) for _ in range(3)) < 6.0


def _srun_lines(size: int) -> str:
    line = "srun -n 2 python train.py --model gpt2 --batch-size 8\n"
    return SHEBANG + "#SBATCH -t 10\n" + line * (size // len(line) + 1)


class _Reads(KeepDecider):
    """Reads the script as the model's decider does, and remembers what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[JobRequest] = []

    def decide(self, request: JobRequest) -> Decision:
        self.seen.append(request)
        if request.script is not None:
            script_features(request.script.text)
        return super().decide(request)


def test_features_are_read_once_per_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decider's reading is the record's: a large script is not read twice."""
    reads: list[str] = []
    real = features.command_lines
    monkeypatch.setattr(features, "command_lines", lambda text: reads.append(text) or real(text))
    script = parse_script((SHEBANG + "torchrun --nproc_per_node=2 once.py --bs 7\n").encode(), "once.sh")
    made = make_plan(script, [], {}, _Reads(), set())
    assert made.to_json()["record"]["script_features"]["nproc"] == 2.0
    assert len(reads) == 1


def test_over_the_budget_the_directives_alone_decide() -> None:
    """Past READ_BUDGET of commands the decider gets the request without the script (every
    directive read, as sbatch reads them), one note says so, and the record has no features."""
    config = load_config(Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml")
    text = "#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\n#SBATCH -t 5\n"
    large = parse_script(_srun_lines(READ_BUDGET + 1000).replace(SHEBANG + "#SBATCH -t 10\n", text).encode(), "big.sh")
    small = parse_script(_srun_lines(READ_BUDGET - 1000).replace(SHEBANG + "#SBATCH -t 10\n", text).encode(), "s.sh")
    reads = _Reads()
    made = make_plan(large, [], {}, reads, config.gpu_features())
    assert reads.seen[-1].script is None and reads.seen[-1].main == made.request.main
    notes = plan.notes(made)
    assert len(notes) == 1 and "big.sh" in notes[0] and "#SBATCH directives alone" in notes[0]
    assert made.to_json()["record"]["script_features"] is None
    # the rules still read the directives: a100 is moved off gpu-small, and the rewrite lands in the script
    ruled = make_plan(large, [], {}, RuleDecider(config), config.gpu_features())
    assert ruled.submission.changed and "#SBATCH --partition=gpu" in (ruled.submission.script_text or "")
    made = make_plan(small, [], {}, reads, config.gpu_features())
    assert reads.seen[-1].script is small and plan.notes(made) == []
    assert made.to_json()["record"]["script_features"] is not None


@pytest.mark.slurm
def test_gsbatch_submits_a_large_script_with_one_note(tmp_path: Path, sample_config: Path) -> None:
    """A 3.9 MB script sbatch accepts: gsbatch accepts it too, saying once what it did not read."""
    path = tmp_path / "large.sh"
    path.write_text(_srun_lines(3_900_000))
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(sample_config),
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "SLURMGPU_SOCKET": str(tmp_path / "none.sock"),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path)}
    plain = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, check=False)
    res = subprocess.run([str(BIN / "gsbatch"), "--test-only", str(path)], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert plain.returncode == 0 and res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if "directives alone" in line]
    assert len(notes) == 1 and notes[0].startswith("gsbatch: note: ") and "large.sh" in notes[0], res.stderr


def _directive_heavy(lines: int) -> str:
    return "#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\n" + "#SBATCH --comment=abc\n" * lines + "srun true\n"


def test_past_the_directive_budget_the_script_is_not_read() -> None:
    from slurmgpu.pipeline.script import DIRECTIVE_BUDGET, Unread, parse_script

    parse_script(_directive_heavy(DIRECTIVE_BUDGET - 1).encode(), "ok.sh")  # read: two lines to spare
    with pytest.raises(Unread, match=r"heavy.sh: 2,002 directive lines"):
        parse_script(_directive_heavy(DIRECTIVE_BUDGET + 1).encode(), "heavy.sh")


@pytest.mark.slurm
def test_a_directive_heavy_script_goes_as_written_with_one_note(tmp_path: Path, sample_config: Path,
                                                               submitted: list[str]) -> None:
    """177k #SBATCH lines (3.9 MB) cost gsbatch seconds to read, sbatch 40 ms: submitted as written
    (the rules would move this a100 job out of gpu-small), recorded, and said once."""
    import json

    path = tmp_path / "heavy.sh"
    path.write_text(_directive_heavy(177_000))
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(sample_config),
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "SLURMGPU_SOCKET": str(tmp_path / "none.sock"),
           "SLURMGPU_SUBMISSION_SPOOL": str(spool), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    res = subprocess.run([str(BIN / "gsbatch"), "--hold", "--parsable", str(path)], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    submitted.append(job)
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
    assert "Partition=gpu-small" in shown and "gres/gpu:a100=1" in shown
    assert [line for line in res.stderr.splitlines() if line.startswith("gsbatch:")] == [
        f"gsbatch: note: {path}: 177,001 directive lines, more than gsbatch reads (2,000): not read, "
        "submitted as written"]
    [record] = [json.loads(p.read_text()) for p in spool.iterdir()]
    assert record["job_id"] == job and record["decision"]["decider"] == "keep" and not record["changed"]
