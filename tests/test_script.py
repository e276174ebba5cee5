"""Script reading: sbatch's directive rules, refusals, and byte-exact round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.script import parse_script, read_script


def names(script: bytes) -> list[tuple[int, str, str | None]]:
    return [(d.line, d.name, d.value) for d in parse_script(script, "job.sh").directives]


def test_directives_stop_at_first_command_and_later_ones_are_reported() -> None:
    s = parse_script(b"#!/bin/bash\n#SBATCH -N 2\n\n# plain comment\nmodule load cuda\n#SBATCH --gres=gpu:4\n")
    assert [(d.line, d.name, d.value) for d in s.directives] == [(2, "nodes", "2")]
    assert [(i.line, i.reason) for i in s.ignored] == [(6, "after the first command (line 5)")]
    assert s.first_command_line == 5


def test_quotes_escapes_comments_and_abbreviations() -> None:
    got = names(b'#!/bin/sh\n#SBATCH --job-name="my #1 job" --part=gpu  # trailing\n'
                b"#SBATCH\t-J\tx\\#y --comment 'a b'\n#SBATCH -pgpu-small -N2\n")
    assert got == [(2, "job-name", "my #1 job"), (2, "partition", "gpu"), (3, "job-name", "x#y"),
                   (3, "comment", "a b"), (4, "partition", "gpu-small"), (4, "nodes", "2")]


def test_lookalike_directives_are_ignored_with_a_reason() -> None:
    s = parse_script(b"#!/bin/bash\n##SBATCH --gres=gpu:8\n #SBATCH -N 3\n#sbatch -n 2\n#SBATCH -n 1\n")
    assert [i.line for i in s.ignored] == [2, 3, 4]
    assert [d.name for d in s.directives] == ["ntasks"]


def test_hetjob_components() -> None:
    s = parse_script(b"#!/bin/bash\n#SBATCH -p cpu -c 4\n#SBATCH hetjob\n#SBATCH --gpus=2\nsrun x\n")
    assert s.components == 2
    assert [(d.component, d.name) for d in s.directives] == [(0, "partition"), (0, "cpus-per-task"), (1, "gpus")]


def test_non_ascii_and_invalid_utf8_round_trip() -> None:
    data = "#!/bin/bash\n#SBATCH -J entraînement-模型\n".encode() + b"echo \xff\xfe\n"
    s = parse_script(data)
    assert s.data == data
    assert s.directives[0].value == "entraînement-模型"


@pytest.mark.parametrize(("data", "fragment"), [
    (b"", "empty"),
    (b"echo hi\n", "first line must start with #!"),
    (b"#!/bin/bash\r\n#SBATCH -N 1\r\n", "DOS line breaks"),
    (b"#!/bin/bash\n\x00\x01binary", "NULL character"),
    (b'#!/bin/bash\n#SBATCH -J "open\n', "Unmatched"),
    (b"#!/bin/bash\n#SBATCH --nodes\n", "requires an argument"),
    (b"#!/bin/bash\n#SBATCH --ntasks-per\n", "ambiguous"),
    (b"#!/bin/bash\n#SBATCH -J run\\ two\n", "Invalid directive found in batch script: two"),
])
def test_refusals_name_the_file(data: bytes, fragment: str) -> None:
    with pytest.raises(InputError) as err:
        parse_script(data, "job.sh")
    assert fragment in str(err.value)
    assert str(err.value).startswith("job.sh")


def test_unreadable_and_directory(tmp_path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        read_script(str(tmp_path / "missing.sh"))
    with pytest.raises(InputError, match="is a directory"):
        read_script(str(tmp_path))


_PIECES = ["srun x", "#SBATCH --time=5", "  #SBATCH -p gpu", "#GSBATCH --gpu-mem=8G", "# comment", "", "   ",
           "#PBS -q gpu", "# sbatch -N 2", "\t# SBATCH foo", "echo hi #SBATCH", "#SLURMGPU keep", "python t.py",
           "#GSBATCH --bogus", "\v#x", "#SBATCH\t-N 1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=100), st.sampled_from(["", "\n", "\n\n"]))
def test_every_directive_like_line_after_the_first_command_is_listed_as_ignored(lines: list[str], end: str) -> None:
    """Past the first command and #PBS's 100-line window, parse_script finds comment lines in C
    rather than line by line: what it lists must be what a line-by-line reading lists."""
    from slurmgpu.pipeline.script import _LOOKS_LIKE_DIRECTIVE, GS_MAGIC, MAGIC

    text = "#!/bin/bash\n" + "true\n" * 101 + "\n".join(lines) + end  # LINES come after the window
    script = parse_script(text.encode(), "x.sh")
    first = script.first_command_line
    assert first == 2
    every = text.split("\n")
    want = [(n, line) for n, line in enumerate(every, 1) if n > first and n <= len(text.splitlines())
            and (line.startswith((MAGIC, GS_MAGIC)) or _LOOKS_LIKE_DIRECTIVE.match(line))]
    assert [(d.line, d.text) for d in script.ignored if d.line > first] == want
