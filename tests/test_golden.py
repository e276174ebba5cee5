"""Golden files: byte for byte what gsbatch would submit, what it tells the user, and job_submit.lua.

Property tests prove rewrites are local; these pin the exact bytes, so any change to the
provenance comment, a note or the hook shows up as a reviewable diff. Regenerate with
``SLURMGPU_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py``: every test then
rewrites its file and fails, so a regeneration never passes unnoticed; review ``git diff tests/golden``.
"""

from __future__ import annotations

import difflib
import os
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmgpu.apps import gsbatch
from slurmgpu.cli.serve import lua_group
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.policy import make_decider

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
CONFIG = ROOT / "contrib" / "slurmgpu.toml"
SOURCES = {"examples": ROOT / "contrib" / "examples", "inputs": GOLDEN / "inputs"}
CASES = sorted(f"{group}/{p.name}" for group, d in SOURCES.items() for p in d.glob("*.sh"))
UPDATE = os.environ.get("SLURMGPU_UPDATE_GOLDEN") == "1"  # read before the environment is scrubbed
# Inputs whose request is also set on the command line or in SBATCH_* variables: (sbatch words, env).
INVOCATIONS: dict[str, tuple[list[str], dict[str, str]]] = {
    "inputs/cli_partition_override.sh": (["--partition=gpu-small"], {}),
    "inputs/env_partition_override.sh": ([], {"SBATCH_PARTITION": "gpu-small"}),
    "inputs/export_directive_and_cli.sh": (["--export=ALL,LR=0.001", "-J", "lr-sweep"], {}),
    "inputs/gpu_mem_cli_move.sh": (["--gpu-mem", "24G"], {}),
    "inputs/gpu_mem_too_large.sh": (["--gpu-mem=100G"], {}),
}
LUA_FIXED = ["--socket", "/run/slurmgpu/slurmgpu.sock", "--timeout-ms", "200", "--backoff-s", "10"]
# The default render's golden is the shipped sample, contrib/lua/job_submit.lua (test_serve.py
# compares it byte for byte); here a render with every switch set.
LUA = {"job_submit.dry-run.lua": ["--dry-run", "--partitions", "gpu,gpu-small", "--accounts", "proj-a,proj-b",
                                  "--users", "ann,1001", "--timeout-ms", "150", "--backoff-s", "0"]}


class NoSbatch:
    """A dry run must never reach sbatch."""

    name = "no-sbatch"

    def submit(self, *args: object, **kwargs: object) -> object:
        raise AssertionError(f"dry run tried to submit: {args}")


def check(*goldens: tuple[Path, bytes]) -> None:
    """Compare bytes exactly; the diff shows lines as repr() so CR and a missing last newline are visible."""
    problems = []
    for path, actual in goldens:
        rel = path.relative_to(ROOT)
        if UPDATE:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(actual)
            problems.append(f"golden file regenerated: {rel}")
        elif not path.exists():
            problems.append(f"missing golden file {rel}; create it with SLURMGPU_UPDATE_GOLDEN=1")
        elif (expected := path.read_bytes()) != actual:
            def lines(b: bytes) -> list[str]:
                return [repr(line) for line in b.decode("utf-8", "surrogateescape").splitlines(True)]
            diff = difflib.unified_diff(lines(expected), lines(actual), str(rel), "actual", lineterm="")
            problems.append("golden mismatch (SLURMGPU_UPDATE_GOLDEN=1 regenerates):\n" + "\n".join(diff))
    if problems:
        pytest.fail("\n".join(problems))


def golden(case: str, suffix: str) -> Path:
    return GOLDEN / "expected" / Path(case).with_suffix(suffix)


@pytest.mark.parametrize("case", CASES)
def test_dry_run_golden(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    """Runs gsbatch --dry-run in-process with the sample config's rules decider, from the script's own
    directory with a relative path and a clean environment, so no user, time or tmp path can leak in."""
    group, name = case.split("/")
    for var in [v for v in os.environ if v.startswith(("SBATCH_", "SLURM_", "SLURMGPU_"))]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(SOURCES[group])
    words, extra_env = INVOCATIONS.get(case, ([], {}))
    env = {"SLURMGPU_CONFIG": os.path.relpath(CONFIG), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool"), "USER": "golden", "LANG": "C.UTF-8", **extra_env}
    decider = make_decider(load_config(CONFIG))
    argv = ["--dry-run", *words, name]
    code = gsbatch.main(argv, env=env, backend=NoSbatch(), decider=decider)  # type: ignore[arg-type]
    cap = capsysbinary.readouterr()
    # A fault of slurmgpu itself is never a golden answer (nor may a regeneration record one).
    assert b"slurmgpu failed" not in cap.err and b"config unusable" not in cap.err, cap.err.decode()
    shown_env = "".join(f"{k}={shlex.quote(v)} " for k, v in extra_env.items())
    notes = f"$ {shown_env}gsbatch {shlex.join(argv)}\nexit: {code}\n"
    if code == 0:  # what sbatch would be handed besides the script: words and environment changes
        inv = gsbatch.parse_invocation(argv)
        sub = gsbatch.plan(inv, env, decider).submission
        notes += f"sbatch: {shlex.join(inv.sbatch_words(sub.cli_words))}\n"
        notes += "".join(f"sbatch env: {k}={v}\n" for k, v in sub.env_overrides.items())
    check((golden(case, ".out"), cap.out), (golden(case, ".notes"), notes.encode() + cap.err))


@pytest.mark.parametrize("name", sorted(LUA))
def test_lua_hook_golden(name: str, tmp_path: Path) -> None:
    """The hook slurmctld runs is generated; pin it so template edits are reviewed as Lua."""
    res = CliRunner().invoke(lua_group, ["render", "--out", str(tmp_path / name), *LUA_FIXED, *LUA[name]])
    assert res.exit_code == 0, res.output
    check((GOLDEN / name, (tmp_path / name).read_bytes()))


def test_goldens_match_inputs() -> None:
    """A golden without an input is stale and one missing means an input is never checked."""
    want = {golden(c, s) for c in CASES for s in (".out", ".notes")} | {GOLDEN / n for n in LUA}
    have = {p for p in (GOLDEN / "expected").rglob("*") if p.is_file()} | set(GOLDEN.glob("*.lua"))
    stale, missing = (sorted(str(p.relative_to(ROOT)) for p in s) for s in (have - want, want - have))
    assert not stale, f"stale golden files (no input): {stale}"
    assert not missing, f"inputs without golden files (SLURMGPU_UPDATE_GOLDEN=1 creates them): {missing}"
    assert set(INVOCATIONS) <= set(CASES), f"invocations for missing inputs: {set(INVOCATIONS) - set(CASES)}"
