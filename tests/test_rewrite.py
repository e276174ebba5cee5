"""Rewrites change only what the decision changes; everything else stays byte-identical."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgpu.pipeline.policy import KEEP, ComponentChange, Decision
from slurmgpu.pipeline.request import GPU_OPTIONS, JobRequest, build_request
from slurmgpu.pipeline.rewrite import RewriteError, apply, sbatch_quote
from slurmgpu.pipeline.script import parse_script, tokenize

GPU_OR_PARTITION = set(GPU_OPTIONS) | {"partition"}

gpu_directive = st.sampled_from([
    "--gres=gpu:a100:2", "--gres gpu:4", "--gres=gpu:v100:1,nvme:1", "-G 2", "-Gt4:1", "--gpus=a100:4",
    "--gpus-per-node=2", "--gpus-per-node v100:1",
])
other_directive = st.sampled_from([
    "-N 1", "--nodes=1", "-J 'a job'", '--job-name="x # y"', "-t 1:00:00", "--mem=8G", "-c 4",
    "--output=slurm-%j.out", "--array=0-9%2", "--comment='{{ not a template }}'", "--exclusive", "-A proj",
    "--mail-type=END,FAIL",
])
partition_directive = st.sampled_from(["-p gpu", "--partition=gpu-small", "--part gpu", "-pgpu"])
free_line = st.one_of(
    st.just(""), st.just("# a comment"), st.just("## {% raw %} {{ x }}"), st.just("# ünïcödé ✓"),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=30).map(lambda t: "# " + t),
)
body_line = st.one_of(
    st.just("srun python train.py --lr {{ lr }}"), st.just("echo \"$SLURM_JOB_ID\""), st.just("{% if x %}"),
    st.just("#SBATCH --gres=gpu:8"), st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40),
)


@st.composite
def scripts(draw: st.DrawFn) -> bytes:
    header = ["#!/bin/bash" + draw(st.sampled_from(["", " -l", "\t-e"]))]
    opts = [draw(gpu_directive)] + draw(st.lists(other_directive, max_size=5))
    if draw(st.booleans()):
        opts.append(draw(partition_directive))
    opts = draw(st.permutations(opts))
    for opt in opts:
        if draw(st.booleans()):
            header.append(draw(free_line))
        header.append("#SBATCH" + draw(st.sampled_from([" ", "\t", "  "])) + opt
                      + draw(st.sampled_from(["", "  # trailing comment", " \t"])))
    body = ["python -c 'print(1)'"] + draw(st.lists(body_line, max_size=4))
    text = "\n".join(header + body) + draw(st.sampled_from(["\n", ""]))
    return text.encode()


def directives(data: bytes) -> list[tuple[str, str | None]]:
    return [(d.name, d.value) for d in parse_script(data).directives]


@settings(max_examples=300, deadline=None)
@given(scripts())
def test_keep_render_is_byte_identical(data: bytes) -> None:
    request = build_request(parse_script(data, "job.sh"))
    assert apply(request, KEEP).script_text.encode() == data


@settings(max_examples=300, deadline=None)
@given(scripts(), st.sampled_from(["a100", "v100", "t4", None]), st.sampled_from([1, 2, 4, None]),
       st.sampled_from(["gpu", "gpu-small", None]))
def test_rewrite_changes_only_gpu_and_partition_directives(data: bytes, gtype, total, partition) -> None:
    request = build_request(parse_script(data, "job.sh"))
    if gtype is None and total is None and partition is None:
        return
    decision = Decision((ComponentChange(0, gtype, total, partition),), ("because",), decider="test")
    new = apply(request, decision).script_text.encode()
    after = build_request(parse_script(new, "job.sh"))
    # Options other than GPU/partition: the same, in the same order.
    assert [d for d in directives(new) if d[0] not in GPU_OR_PARTITION] == \
           [d for d in directives(data) if d[0] not in GPU_OR_PARTITION]
    # No GPU option kind the user did not write: a rewrite never creates a combination the running
    # Slurm might refuse (from 26.05, --gres with --gpus-per-node) that the request as written did not have.
    gpu_kinds = {d[0] for d in directives(data) if d[0] in GPU_OPTIONS}
    assert {d[0] for d in directives(new) if d[0] in GPU_OPTIONS} <= gpu_kinds
    # The decided values took effect.
    assert_decided(after, gtype, total, partition)
    # Every original line is still there, in order, unless it held a GPU/partition option.
    touched = {d.line for d in request.script.directives if d.name in GPU_OR_PARTITION}
    kept = [ln for i, ln in enumerate(data.split(b"\n"), 1) if i not in touched]
    new_lines = [ln for ln in new.split(b"\n") if not ln.startswith(b"# slurmgpu: ")]
    it = iter(new_lines)
    assert all(any(ln == n for n in it) for ln in kept)


def test_provenance_and_rewritten_line() -> None:
    data = b"#!/bin/bash\n#SBATCH -J train --gres=gpu:a100:4,nvme:1 # big\n#SBATCH -p gpu\nsrun x\n"
    req = build_request(parse_script(data, "job.sh"))
    out = apply(req, Decision((ComponentChange(0, "v100", 2, "gpu-small"),), ("fits on v100",), decider="rules"))
    assert out.script_text == (
        "#!/bin/bash\n"
        "# slurmgpu: GPU request rewritten by the rules decider\n"
        "# slurmgpu: was: --gres=gpu:a100:4 in partition gpu\n"
        "# slurmgpu: now: 2 x v100 GPUs in partition gpu-small\n"
        "# slurmgpu: why: fits on v100\n"
        "#SBATCH -J train --gres=gpu:v100:2,nvme:1 # big\n"
        "#SBATCH --partition=gpu-small\n"
        "srun x\n"
    )


def test_partition_added_when_absent_and_cli_env_edited_in_place() -> None:
    data = b"#!/bin/bash\n#SBATCH -N 2\n#SBATCH --gpus-per-node=2\nsrun x\n"
    req = build_request(parse_script(data, "job.sh"), ["-t", "5", "--gpus-per-node", "a100:2"],
                        {"SBATCH_PARTITION": "gpu-small"})
    out = apply(req, Decision((ComponentChange(0, "v100", 2, "gpu"),), ("r",)))
    assert out.cli_words == ["-t", "5", "--gpus-per-node=v100:1"]
    assert out.env_overrides == {"SBATCH_PARTITION": "gpu"}
    assert b"#SBATCH --gpus-per-node=2\n" in out.script_text.encode()  # overridden there, so untouched


def test_quoting_survives_sbatch_tokenizer() -> None:
    for value in ["plain", "with space", 'q"uote', "hash#tag", "back\\slash", "it's"]:
        quoted = sbatch_quote(value)
        assert [w.text for w in tokenize(quoted, 0, len(quoted), "t", 1)] == [value]


def _rules_decision(body: str, cli: list[str]) -> Decision:
    from pathlib import Path

    from slurmgpu.pipeline.config import load_config
    from slurmgpu.pipeline.policy import RuleDecider

    config = load_config(Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml")
    request = build_request(parse_script(("#!/bin/bash\n" + body + "true\n").encode(), "job.sh"), cli, {},
                            config.gpu_features())
    return RuleDecider(config).decide(request)


def test_rules_decider_leaves_what_a_rewrite_cannot_say_and_says_so() -> None:
    """Writing the --constraint's type into one GPU entry would change what Slurm reads from the
    others; in a heterogeneous job a command-line value is every component's."""
    made_typed = _rules_decision("#SBATCH --gres=gpu:1 --constraint=v100\n", [])
    assert [c.gpu_type for c in made_typed.changes] == ["v100"]
    for body, cli, why in [
        ("#SBATCH --gres=gpu:1 --gpus-per-task=1 -n 1 --constraint=v100\n", [], "several options"),
        ("#SBATCH --gres=gpu:1,gpu:2 --constraint=v100\n", [], "several GPU entries"),
        ("#SBATCH -n 1\n#SBATCH hetjob\n#SBATCH -n 1\n", ["--gpus-per-node=1", "--constraint=v100"],
         "--gpus-per-node is set on the command line, which applies to every component"),
    ]:
        d = _rules_decision(body, cli)
        assert not any(c.gpu_type for c in d.changes) and any(why in r for r in d.reasons), (body, d.reasons)
    moved = _rules_decision("#SBATCH --gres=gpu:a100:1\n#SBATCH hetjob\n#SBATCH -n 1\n", ["-p", "gpu-small"])
    assert not moved.changes and any("--partition is set on the command line" in r for r in moved.reasons)


# Scripts at the edges of what sbatch accepts: no final newline (the last line a directive, a
# command, or the shebang alone), no directives at all (the GPU asked on the command line), a
# carriage return inside a line (sbatch refuses only "\r\n"), bytes that are not UTF-8.
edge_free_line = st.sampled_from(["", "#", "# a\rb", "# caf\udce9", "# {{ x }} {% raw %}", "# SBATCH -p nope",
                                  "#sbatch -p nope"])
edge_body_line = st.sampled_from(["srun x", "", "true\r# cr inside", "echo caf\udce9", "exit 0", "#SBATCH -p late"])
CLI_GPUS = [["--gres=gpu:2"], ["-G", "a100:2"], ["--gpus-per-node=v100:1"], ["--gpus", "4"]]


def edge_script_bytes(draw: st.DrawFn, shebang: str, opts: list[str], body_lines: int) -> bytes:
    """A script at the edges around these #SBATCH options, in any order, with free lines between
    them, a body, and a final newline or none (the live test in test_slurm_gsbatch uses it too)."""
    lines = [shebang]
    for opt in draw(st.permutations(opts)):
        if draw(st.booleans()):
            lines.append(draw(edge_free_line))
        lines.append("#SBATCH " + opt + draw(st.sampled_from(["", "  # trailing", "\t"])))
    lines += draw(st.lists(edge_body_line, max_size=body_lines))
    text = "\n".join(lines) + draw(st.sampled_from(["\n", ""]))
    return text.encode("utf-8", "surrogateescape")


def assert_decided(after: JobRequest, gtype: str | None, total: int | None, partition: str | None) -> None:
    """The decided values took effect in the rewritten request."""
    if gtype is not None:
        assert after.gpu_type == gtype
    if total is not None:
        assert after.gpus_total == total
    if partition is not None:
        assert after.main.partition == partition


@st.composite
def edge_scripts(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    shebang = "#!/bin/bash" + draw(st.sampled_from(["", " -l"]))
    opts = draw(st.lists(st.one_of(other_directive, partition_directive), max_size=3))
    cli: list[str] = []
    if draw(st.booleans()):
        opts.append(draw(gpu_directive))
    else:
        cli = draw(st.sampled_from(CLI_GPUS))
    return edge_script_bytes(draw, shebang, opts, 3), cli


def assert_only_changed_lines_differ(data: bytes, new: bytes, touched: dict[int, tuple[int, int]]) -> None:
    """``new`` is ``data`` with whole lines inserted (provenance, new directives) and, inside each
    touched line (number -> the span of its rewritten words), only that span replaced; every other
    byte, the final newline or its absence included, is the same."""
    import difflib

    assert new.endswith(b"\n") == data.endswith(b"\n")
    old_lines, new_lines = data.split(b"\n"), new.split(b"\n")
    added = (b"# slurmgpu: ", b"#SBATCH --")
    ops = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes()
    for op, i1, i2, j1, j2 in ops:
        if op == "equal":
            continue
        assert op in ("insert", "replace"), (op, old_lines[i1:i2])
        block = new_lines[j1:j2]
        assert all(line.startswith(added) or line.startswith(b"#SBATCH") for line in block), block
        for number in range(i1 + 1, i2 + 1):
            assert number in touched, f"line {number} changed but holds no rewritten option: {old_lines[number - 1]!r}"
            line, (ws, we) = old_lines[number - 1], touched[number]
            assert any(n.startswith(line[:ws]) and n.endswith(line[we:]) for n in block), (line, block)


def _touched_spans(request) -> dict[int, tuple[int, int]]:
    """Line number -> byte span, within the line, of the GPU and partition words on it."""
    script = request.script
    spans: dict[int, tuple[int, int]] = {}
    for d in script.directives:
        if d.name in GPU_OR_PARTITION:
            begin = script.line_starts[d.line - 1]
            ws = len(script.text[begin:d.start].encode("utf-8", "surrogateescape"))
            we = len(script.text[begin:d.end].encode("utf-8", "surrogateescape"))
            lo, hi = spans.get(d.line, (ws, we))
            spans[d.line] = (min(lo, ws), max(hi, we))
    return spans


@settings(max_examples=400, deadline=None)
@given(edge_scripts(), st.sampled_from(["a100", "v100", "t4", None]), st.sampled_from([2, 4, None]),
       st.sampled_from(["gpu", "gpu-small", None]))
def test_rewrite_is_byte_faithful_at_the_edges(case: tuple[bytes, list[str]], gtype, total, partition) -> None:
    data, cli = case
    if gtype is None and total is None and partition is None:
        return
    request = build_request(parse_script(data, "job.sh"), cli)
    decision = Decision((ComponentChange(0, gtype, total, partition),), ("because",), decider="test")
    sub = apply(request, decision)
    new = sub.script_text.encode("utf-8", "surrogateescape")
    assert_only_changed_lines_differ(data, new, _touched_spans(request))
    after = build_request(parse_script(new, "job.sh"), sub.cli_words, sub.env_overrides)  # sbatch-acceptable
    assert new.split(b"\n")[0] == data.split(b"\n")[0]  # the shebang line is never touched
    assert_decided(after, gtype, total, partition)


PROVENANCE = (b"# slurmgpu: GPU request rewritten by the rules decider\n"
              b"# slurmgpu: was: --gres=gpu:t4:1 in partition (default)\n"
              b"# slurmgpu: now: 1 x t4 GPU in partition gpu-small\n"
              b"# slurmgpu: why: r\n")


@pytest.mark.parametrize(("data", "cli", "expect"), [
    # The probe's script: its last line a directive, no final newline; the new directive follows it.
    (b"#!/bin/bash\n#SBATCH --gres=gpu:t4:1", [],
     b"#!/bin/bash\n" + PROVENANCE + b"#SBATCH --gres=gpu:t4:1\n#SBATCH --partition=gpu-small"),
    # The shebang alone, no newline: it was '#!/bin/bash# slurmgpu: ...' (bad interpreter).
    (b"#!/bin/bash", ["--gres=gpu:t4:1"], b"#!/bin/bash\n" + PROVENANCE + b"#SBATCH --partition=gpu-small"),
    (b"#!/bin/bash\n", ["--gres=gpu:t4:1"], b"#!/bin/bash\n" + PROVENANCE + b"#SBATCH --partition=gpu-small\n"),
    (b"#!/bin/bash\nsrun x", ["--gres=gpu:t4:1"],
     b"#!/bin/bash\n" + PROVENANCE + b"#SBATCH --partition=gpu-small\nsrun x"),
    # A lone carriage return inside a line is sbatch's whitespace: kept as it is.
    (b"#!/bin/bash\n#SBATCH --gres=gpu:t4:1\r# x\nsrun x\r", [],
     b"#!/bin/bash\n" + PROVENANCE + b"#SBATCH --gres=gpu:t4:1\r# x\n#SBATCH --partition=gpu-small\nsrun x\r"),
])
def test_no_final_newline_or_directives(data: bytes, cli: list[str], expect: bytes) -> None:
    request = build_request(parse_script(data, "job.sh"), cli)
    decision = Decision((ComponentChange(0, None, None, "gpu-small"),), ("r",), decider="rules")
    assert apply(request, decision).script_text.encode("utf-8", "surrogateescape") == expect


def test_a_line_after_a_final_carriage_return_is_not_written() -> None:
    """'\\r' then a new line would be the DOS line break sbatch refuses: the job goes as written."""
    request = build_request(parse_script(b"#!/bin/bash\n#SBATCH --gres=gpu:t4:1\r", "job.sh"))
    with pytest.raises(RewriteError, match="carriage return"):
        apply(request, Decision((ComponentChange(0, None, None, "gpu-small"),), ("r",)))


@pytest.mark.parametrize(("line", "now"), [
    ("#PBS -q gpu-small", "#PBS -q gpu"),
    ("#PBS -qgpu-small -N x", "#PBS -qgpu -N x"),
    ("#PBS --destination=gpu-small", "#PBS --destination=gpu"),
])
def test_a_pbs_queue_is_changed_where_sbatch_reads_it(line: str, now: str) -> None:
    """sbatch reads #PBS lines after #SBATCH ones, so a partition a #PBS -q sets is changed on that line."""
    data = f"#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n#SBATCH -p debug\n{line}\nsrun x\n".encode()
    req = build_request(parse_script(data, "job.sh"))
    assert req.main.partition == "gpu-small"
    out = apply(req, Decision((ComponentChange(0, None, None, "gpu"),), ("r",)))
    assert out.script_text is not None and now + "\n" in out.script_text
    assert "#SBATCH -p debug\n" in out.script_text and "--partition" not in out.script_text


def test_gpus_from_a_pbs_resource_list_are_not_rewritten() -> None:
    data = b"#!/bin/bash\n#PBS -l nodes=1:ppn=2:gpus=2\nsrun x\n"
    req = build_request(parse_script(data, "job.sh"))
    assert req.main.gpus_total == 2 and "resource list on line 2" in (req.main.rewrite_blocker or "")


def test_a_new_directive_goes_after_a_value_on_the_next_line() -> None:
    data = b"#!/bin/bash\n#SBATCH --gres=gpu:a100:1 --time\n#SBATCH 10\nsrun x\n"
    out = apply(build_request(parse_script(data, "job.sh")), Decision((ComponentChange(0, None, None, "gpu"),), ("r",)))
    assert out.script_text is not None
    assert out.script_text.endswith("--time\n#SBATCH 10\n#SBATCH --partition=gpu\nsrun x\n")
    assert build_request(parse_script(out.script_text.encode(), "job.sh")).main.time_limit_s == 600
