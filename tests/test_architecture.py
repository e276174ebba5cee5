"""The package's layout is its architecture: layers hold, nothing imports in a circle, and the
submit-time path stays light (a kept request loads none of the heavy libraries)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HEAVY = ("jinja2", "sqlalchemy", "alembic", "pandas", "numpy", "catboost", "rich", "click", "pynvml", "pyarrow")


def import_cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), i.e. every import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph.find_modules_directly_imported_by(m) & modules:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return cycles


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph, {"p.a", "p.b", "p.c", "p.d"}) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles_in_the_package() -> None:
    graph = grimp.build_graph("slurmgpu")
    modules = {m for m in graph.modules if m.startswith("slurmgpu")}
    assert len(modules) > 50
    assert import_cycles(graph, modules) == []


def test_import_layer_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(BIN)) or shutil.which("lint-imports")
    assert lint, "import-linter is a dev dependency"
    res = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout[-3000:]
    assert re.search(r"Contracts: [1-9]\d* kept, 0 broken", res.stdout), res.stdout[-1000:]


def _imported_by_gsbatch(tmp_path: Path, script_text: str, config: Path) -> tuple[set[str], str]:
    """Run the installed gsbatch entry point under -X importtime against a stand-in sbatch;
    returns the top-level packages it imported and its stderr."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    (fake / "sbatch").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(script_text)
    (tmp_path / "spool").mkdir(exist_ok=True)  # a site spool exists before gsbatch writes to it
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURMGPU_CONFIG": str(config),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool"), "SLURMGPU_SOCKET": str(tmp_path / "none.sock"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-X", "importtime", str(BIN / "gsbatch"), str(script)], env=env,
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Submitted batch job 4242" in res.stdout
    names = {line.split("|")[-1].strip().split(".")[0] for line in res.stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
    return names, res.stderr


def test_a_kept_request_imports_no_heavy_library(tmp_path: Path, sample_config: Path) -> None:
    names, stderr = _imported_by_gsbatch(
        tmp_path, "#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:1\n#SBATCH -t 1\nsleep 1\n", sample_config)
    assert "gsbatch:" not in stderr  # the request was kept, and nothing went wrong
    assert "slurmgpu" in names
    assert [m for m in HEAVY if m in names] == []
    assert list((tmp_path / "spool").iterdir()), "the submission record is still written"


def test_importtime_check_sees_a_rewrite_load_jinja(tmp_path: Path, sample_config: Path) -> None:
    """The same probe on a rewritten request sees Jinja: the check above can fail."""
    names, stderr = _imported_by_gsbatch(
        tmp_path, "#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\n#SBATCH -t 1\nsleep 1\n", sample_config)
    assert "GPU request changed" in stderr
    assert "jinja2" in names  # rewrites render through the Jinja templates
