"""A corpus of real-world-style batch scripts, each with its expected request written by hand
from sbatch's semantics (not from running the parser), checked against read_script +
build_request.

Each ``tests/corpus/NAME.sh`` has a ``NAME.json`` next to it holding either

* ``{"expect": {...}}``: a subset of the top-level keys of ``JobRequest.to_json()``, plus
  ``"components"`` (a list compared per component on the keys given) and ``"ignored_lines"``
  (the exact sorted line numbers of the directive-looking lines sbatch does not read); or
* ``{"error": "substring"}``: the script must be refused with an InputError whose message
  contains the substring and names the file; ``"error_line"`` optionally pins the line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmgpu.pipeline.errors import InputError
from slurmgpu.pipeline.request import build_request
from slurmgpu.pipeline.script import read_script

CORPUS = Path(__file__).resolve().parent / "corpus"
SCRIPTS = sorted(CORPUS.glob("*.sh"))
MIN_SCRIPTS = 40


def _spec(script: Path) -> dict:
    return json.loads(script.with_suffix(".json").read_text(encoding="utf-8"))


def _request(script: Path) -> dict:
    return build_request(read_script(str(script)), cli_options=[], env={}).to_json()


def test_corpus_is_big_enough() -> None:
    assert len(SCRIPTS) >= MIN_SCRIPTS, f"only {len(SCRIPTS)} scripts in {CORPUS}"


def test_every_script_has_an_expectation() -> None:
    missing = [s.name for s in SCRIPTS if not s.with_suffix(".json").is_file()]
    orphans = [j.name for j in CORPUS.glob("*.json") if not j.with_suffix(".sh").is_file()]
    assert not missing and not orphans, f"without .json: {missing}; without .sh: {orphans}"
    for s in SCRIPTS:
        spec = _spec(s)
        assert ("expect" in spec) != ("error" in spec), f"{s.name}: give exactly one of expect / error"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_corpus_script(script: Path) -> None:
    spec = _spec(script)
    if "error" in spec:
        with pytest.raises(InputError) as info:
            _request(script)
        err = info.value
        message = str(err)
        assert spec["error"] in message, f"expected {spec['error']!r} in {message!r}"
        assert err.file == str(script) and str(script) in message, f"error does not name the file: {message!r}"
        if "error_line" in spec:
            assert err.line == spec["error_line"], f"error at line {err.line}, expected {spec['error_line']}: {message}"
        return

    data = _request(script)
    expect = dict(spec["expect"])
    problems: list[str] = []

    components = expect.pop("components", None)
    ignored = expect.pop("ignored_lines", None)
    for key, want in expect.items():
        if key not in data:
            problems.append(f"{key}: not in the request")
        elif data[key] != want:
            problems.append(f"{key}: expected {want!r}, got {data[key]!r}")
    if components is not None:
        got = data["components"]
        if len(got) != len(components):
            problems.append(f"components: expected {len(components)}, got {len(got)}")
        for i, (want_c, got_c) in enumerate(zip(components, got, strict=False)):
            for key, want in want_c.items():
                if got_c.get(key, "<absent>") != want:
                    problems.append(f"components[{i}].{key}: expected {want!r}, got {got_c.get(key, '<absent>')!r}")
    if ignored is not None:
        got_lines = sorted(i["line"] for i in data["ignored_directives"])
        if got_lines != sorted(ignored):
            problems.append(f"ignored_lines: expected {sorted(ignored)}, got {got_lines}")
    assert not problems, f"{script.name}:\n  " + "\n  ".join(problems)
