"""gsbatch end to end against a recording backend: what reaches sbatch, and what users see."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from slurmgpu.apps import gsbatch
from slurmgpu.pipeline.config import load_config
from slurmgpu.pipeline.policy import Decision
from slurmgpu.slurm.backend import Submitted


class Recorder:
    """Stands in for sbatch: records the words, env and the script content it was given."""

    name = "recorder"

    def __init__(self, code: int = 0) -> None:
        self.calls: list[dict] = []
        self.code = code

    def version(self) -> str:
        return "0"

    def nodes(self) -> list:
        return []

    def free_gpus(self) -> dict[str, int]:
        return {"a100": 4, "v100": 4, "t4": 4}

    def submit(self, words: Sequence[str], env: Mapping[str, str], stdin: bytes | None = None) -> Submitted:
        script = next((w for w in words if w.endswith(".sh")), None)
        content = Path(script).read_bytes() if script and Path(script).exists() else None
        self.calls.append({"words": list(words), "env": dict(env), "stdin": stdin, "content": content,
                           "mode": oct(os.stat(script).st_mode & 0o777) if content is not None else None})
        return Submitted(self.code, str(100 + len(self.calls)) if self.code == 0 else None)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    p = tmp_path / "train.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH -p gpu-small\n#SBATCH --gres=gpu:a100:2\npython train.py {{ x }}\n")
    return p


@pytest.fixture(autouse=True)
def spool_dir(tmp_path: Path, monkeypatch) -> Path:
    """Submission records go to a private spool per test."""
    d = tmp_path / "spool"
    d.mkdir()
    monkeypatch.setenv("SLURMGPU_SUBMISSION_SPOOL", str(d))
    return d


def run(argv: list[str], sample_config: Path, backend: Recorder | None = None, env: dict | None = None):
    backend = backend or Recorder()
    env = {"SLURMGPU_CONFIG": str(sample_config), "SLURMGPU_SUBMISSION_SPOOL": os.environ["SLURMGPU_SUBMISSION_SPOOL"],
           **(env or {})}
    code = gsbatch.main(argv, env=env, backend=backend)
    return code, backend


def test_rule_moves_type_to_partition_that_has_it(job: Path, sample_config: Path, capsys) -> None:
    code, be = run(["--parsable", str(job), "arg1"], sample_config)
    assert code == 0
    call = be.calls[0]
    assert call["words"][0] == "--parsable" and call["words"][-1] == "arg1"
    submitted = Path(call["words"][1])
    assert submitted.name == "train.sh" and submitted != job  # same name, private copy
    assert b"#SBATCH --partition=gpu\n" in call["content"] and b"{{ x }}" in call["content"]
    assert call["mode"] == "0o600"
    # the lua hook leaves it alone: this submission's time (a job inheriting it submits later)
    assert abs(int(call["env"]["SLURMGPU_DECIDED"]) - time.time()) < 60
    assert not submitted.exists()  # cleaned up after sbatch read it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gsbatch: note: GPU request changed" in err


def test_unchanged_request_passes_original_argv(tmp_path: Path, sample_config: Path, capsys) -> None:
    p = tmp_path / "ok.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH --gres=gpu:a100:1\nsrun x\n")
    code, be = run(["-J", "n", str(p)], sample_config, Recorder(code=7))
    assert code == 7  # sbatch's exit code comes back
    assert be.calls[0]["words"] == ["-J", "n", str(p)]
    assert capsys.readouterr().err == ""


def test_dry_run_prints_exactly_the_script(job: Path, sample_config: Path, capsysbinary) -> None:
    code, be = run(["--dry-run", str(job)], sample_config)
    out = capsysbinary.readouterr().out
    assert code == 0 and be.calls == []
    assert out.startswith(b"#!/bin/bash\n# slurmgpu: ") and out.endswith(b"python train.py {{ x }}\n")


def test_diff_and_explain(job: Path, sample_config: Path, capsys) -> None:
    code, _ = run(["--diff", "--explain", str(job)], sample_config)
    cap = capsys.readouterr()
    assert code == 0
    assert "+#SBATCH --partition=gpu" in cap.out and cap.out.startswith("--- ")
    assert "gsbatch: explain: decider: rules" in cap.err and "moved to gpu" in cap.err


@pytest.mark.parametrize("optout, line", [(["--no-rewrite"], b""), ([], b"#GSBATCH --no-rewrite\n"),
                                          ([], b"#GSBATCH   --no-rewrite  # measured on purpose\n"),
                                          ([], b"#SLURMGPU keep\n")])
def test_opt_outs(job: Path, sample_config: Path, optout: list[str], line: bytes, capsys) -> None:
    job.write_bytes(job.read_bytes().replace(b"#!/bin/bash\n", b"#!/bin/bash\n" + line))
    code, be = run([*optout, str(job)], sample_config)
    assert be.calls[0]["words"] == [str(job)]
    deprecated = "'#SLURMGPU keep' is deprecated" in capsys.readouterr().err
    assert deprecated == line.startswith(b"#SLURMGPU")


def test_gsbatch_directives_are_read_like_sbatch_directives(tmp_path: Path) -> None:
    """Only before the first command; unknown ones never refuse the script (sbatch ignores them)."""
    from slurmgpu.pipeline.script import parse_script

    late = parse_script(b"#!/bin/bash\n#SBATCH -t 1\nsrun x\n#GSBATCH --no-rewrite\n")
    assert not late.keep_marker and late.ignored[0].line == 4 and "after the first command" in late.ignored[0].reason
    odd = parse_script(b"#!/bin/bash\n#GSBATCH --frobnicate 'unclosed\n#GSBATCH --gpu-memory=9\nsrun x\n")
    assert not odd.keep_marker and [i.line for i in odd.ignored] == [2, 3]
    assert "unreadable" in odd.ignored[0].reason and "unknown gsbatch option --gpu-memory=9" in odd.ignored[1].reason


def test_refusal_before_submission(tmp_path: Path, sample_config: Path, capsys) -> None:
    p = tmp_path / "big.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH --gpus-per-node=a100:8\nsrun x\n")
    code, be = run([str(p)], sample_config)
    assert code == 1 and be.calls == []
    assert "at most 4 per node" in capsys.readouterr().err


def test_bad_input_is_one_line_and_not_submitted(tmp_path: Path, sample_config: Path, capsys) -> None:
    p = tmp_path / "bad.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH -N 1\n#SBATCH --gres=gpu:a100:-2\nsrun x\n")
    code, be = run([str(p)], sample_config)
    err = capsys.readouterr().err
    assert code == 1 and be.calls == []
    assert err == f"gsbatch: error: {p}:3: --gres: negative GPU count '-2'\n"


def test_broken_config_submits_as_written(job: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[gpu_types.a100]\nmemory_gib = 'lots'\n")
    code, be = run([str(job)], bad)
    assert be.calls[0]["words"] == [str(job)]
    assert "gpu_types.a100.memory_gib" in capsys.readouterr().err


def test_internal_failure_submits_as_written(job: Path, sample_config: Path, capsys) -> None:
    class Exploding:
        name = "boom"

        def decide(self, request) -> Decision:
            raise RuntimeError("model file corrupt")

    be = Recorder()
    code = gsbatch.main([str(job)], env=dict(os.environ), backend=be, decider=Exploding())
    assert code == 0 and be.calls[0]["words"] == [str(job)]
    assert capsys.readouterr().err == ("gsbatch: warning: slurmgpu failed (RuntimeError: model file corrupt); "
                                       "submitting as written\n")


def test_stdin_script_and_wrap(sample_config: Path, monkeypatch) -> None:
    data = b"#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\nsrun x\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, be = run(["-J", "s"], sample_config)
    assert be.calls[0]["words"] == ["-J", "s"] and b"--partition=gpu" in be.calls[0]["stdin"]
    code, be = run(["-p", "gpu-small", "--gres=gpu:a100:1", "--wrap", "hostname"], sample_config)
    assert be.calls[0]["words"] == ["--partition=gpu", "--gres=gpu:a100:1", "--wrap", "hostname"]


def test_invocation_split() -> None:
    inv = gsbatch.parse_invocation(["--dry-run", "-N", "2", "--explain", "--gs-config=/x.toml", "job.sh", "-N", "5"])
    assert inv.flags == {"--dry-run", "--explain"} and inv.config == "/x.toml"
    assert inv.options == ("-N", "2") and inv.script == "job.sh" and inv.script_args == ("-N", "5")


def test_sample_config_loads(sample_config: Path) -> None:
    cfg = load_config(sample_config)
    assert cfg.default_partition == "gpu" and cfg.partitions_with("t4")[0].name == "gpu-small"


def test_submission_is_recorded_in_the_spool(job: Path, sample_config: Path, spool_dir: Path) -> None:
    code, _ = run([str(job)], sample_config)
    [rec_path] = list(spool_dir.iterdir())
    rec = json.loads(rec_path.read_text())
    assert oct(rec_path.stat().st_mode & 0o777) == "0o600"
    assert rec["job_id"] == "101" and rec["sbatch_exit"] == 0 and rec["changed"] is True
    assert rec["cluster"] == "slurmgpu" and rec["original_request"]["partition"] == "gpu-small"
    assert rec["decision"]["changes"][0]["partition"] == "gpu"
    assert rec["script_sha256"] == hashlib.sha256(job.read_bytes()).hexdigest()


def test_unwritable_spool_warns_but_submits(job: Path, sample_config: Path, tmp_path: Path, capsys) -> None:
    code, be = run([str(job)], sample_config, env={"SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "missing")})
    assert code == 0 and len(be.calls) == 1
    assert "gsbatch: warning: submission record not written" in capsys.readouterr().err


def test_a_byte_that_is_not_utf8_in_the_command_does_not_stop_the_rewrite(tmp_path: Path, sample_config: Path,
                                                                         spool_dir: Path, capsys) -> None:
    """The job goes as decided and its record keeps the script's features (the byte hashed as read)."""
    p = tmp_path / "latin1.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\necho caf\xe9\n")
    code, be = run([str(p)], sample_config)
    assert code == 0 and be.calls[0]["words"][0] != str(p)  # the rewritten private copy
    assert be.calls[0]["content"].endswith(b"--partition=gpu --gres=gpu:a100:1\necho caf\xe9\n")
    [rec] = [json.loads(r.read_text()) for r in spool_dir.iterdir()]
    assert rec["changed"] is True and len(rec["features"]["script"]["family"]) == 12
    assert "warning" not in capsys.readouterr().err
