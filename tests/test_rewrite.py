"""Rewrites change only what the decision changes; everything else stays byte-identical."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgpu.pipeline.policy import KEEP, ComponentChange, Decision
from slurmgpu.pipeline.request import GPU_OPTIONS, build_request
from slurmgpu.pipeline.rewrite import apply, sbatch_quote
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
    if gtype is not None:
        assert after.gpu_type == gtype
    if total is not None:
        assert after.gpus_total == total
    if partition is not None:
        assert after.main.partition == partition
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
