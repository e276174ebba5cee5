"""The package's layout is its architecture: layers hold, nothing imports in a circle, and the
submit-time path stays light (a kept request loads none of the heavy libraries; with the daemon,
gsbatch loads none of the decision code)."""

from __future__ import annotations

import grp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

from slurmgpu.apps.daemon_client import call

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HEAVY = ("jinja2", "sqlalchemy", "alembic", "pandas", "numpy", "catboost", "rich", "click", "pynvml", "pyarrow")
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
KEPT = "#!/bin/bash\n#SBATCH -p gpu --gres=gpu:a100:1\n#SBATCH -t 1\nsleep 1\n"
REWRITTEN = "#!/bin/bash\n#SBATCH -p gpu-small --gres=gpu:a100:1\n#SBATCH -t 1\nsleep 1\n"
# What gsbatch must not load when `slurmgpu serve` made the plan: it checks, reports and submits
# the daemon's answer, so none of the decision code (the plan maker, the policy, the model bundle,
# script features, the rewrite and its Jinja templates) is needed; typing, tempfile, datetime and
# contextlib cost a submission milliseconds of start-up and have light stand-ins on this path
# (typing's: slurmgpu.typing_lite, whose NamedTuple classes are made without it); the translation
# of #PBS and #BSUB lines loads only for a script that has some.
DAEMON_PATH_NEVER = ("slurmgpu.pipeline.plan", "slurmgpu.pipeline.policy", "slurmgpu.pipeline.bundle",
                     "slurmgpu.pipeline.features", "slurmgpu.pipeline.rewrite", "jinja2", "typing", "tempfile",
                     "datetime", "contextlib", "slurmgpu.pipeline.wrapper")


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


def _gsbatch(tmp_path: Path, script_text: str, config: Path, socket_path: str | None,
             python_args: list[str]) -> str:
    """Run gsbatch (``python PYTHON_ARGS job.sh``) against a stand-in sbatch, with the daemon at
    SOCKET_PATH (None: no daemon); returns its stderr."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    (fake / "sbatch").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(script_text)
    (tmp_path / "spool").mkdir(exist_ok=True)  # a site spool exists before gsbatch writes to it
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURMGPU_CONFIG": str(config),
           "SLURMGPU_SUBMISSION_SPOOL": str(tmp_path / "spool"),
           "SLURMGPU_SOCKET": socket_path or str(tmp_path / "none.sock"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, *python_args, str(script)], env=env,
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Submitted batch job 4242" in res.stdout
    return res.stderr


def _imported_by_gsbatch(tmp_path: Path, script_text: str, config: Path,
                         socket_path: str | None = None) -> tuple[set[str], str]:
    """The installed gsbatch entry point under -X importtime (see _gsbatch): the modules it
    imported and its stderr."""
    stderr = _gsbatch(tmp_path, script_text, config, socket_path, ["-X", "importtime", str(BIN / "gsbatch")])
    names = {line.split("|")[-1].strip() for line in stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
    return names, stderr


# gsbatch's entry point with every compile() call counted: the module each came from (past typing's
# frames), on stderr as the process leaves (it leaves by os._exit). The import system's own compiles
# of a module without its byte code (an edited tree under PYTHONDONTWRITEBYTECODE) are not counted:
# an installed package is byte-compiled.
COMPILE_PROBE = """
import builtins, os, sys
compiled, real_compile, real_exit = [], builtins.compile, os._exit
def counted(*args, **kwargs):
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.endswith("typing.py"):
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "?")
    if not name.startswith(("_frozen_importlib", "importlib")):
        compiled.append(name)
    return real_compile(*args, **kwargs)
def leave(code):
    print("compiled:", sorted(set(compiled)), file=sys.stderr, flush=True)
    real_exit(code)
builtins.compile, os._exit = counted, leave
from slurmgpu.apps.gsbatch import entry
entry()
"""


def _compiled_by_gsbatch(tmp_path: Path, script_text: str, config: Path, socket_path: str | None) -> list[str]:
    """The modules whose code called compile() while gsbatch ran (see _gsbatch)."""
    stderr = _gsbatch(tmp_path, script_text, config, socket_path, ["-c", COMPILE_PROBE])
    line = next(x for x in stderr.splitlines() if x.startswith("compiled: "))
    return eval(line.removeprefix("compiled: "))  # noqa: S307 - a list of module names the probe printed


def _packages(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_a_kept_request_imports_no_heavy_library(tmp_path: Path, sample_config: Path) -> None:
    modules, stderr = _imported_by_gsbatch(tmp_path, KEPT, sample_config)
    names = _packages(modules)
    assert "gsbatch:" not in stderr  # the request was kept, and nothing went wrong
    assert "slurmgpu" in names
    assert [m for m in HEAVY if m in names] == []
    assert list((tmp_path / "spool").iterdir()), "the submission record is still written"


def test_importtime_check_sees_a_rewrite_load_jinja(tmp_path: Path, sample_config: Path) -> None:
    """The same probe on a rewritten request sees Jinja: the check above can fail."""
    modules, stderr = _imported_by_gsbatch(tmp_path, REWRITTEN, sample_config)
    assert "GPU request changed" in stderr
    assert "jinja2" in _packages(modules)  # rewrites render through the Jinja templates
    # planned in this process (no daemon): the probe below sees the decision code when it is loaded
    assert {"slurmgpu.pipeline.plan", "slurmgpu.pipeline.policy", "slurmgpu.pipeline.rewrite"} <= modules
    assert "typing" in modules  # the decision modules use it; the daemon path does not (below)


@pytest.fixture(scope="module")
def serve_socket() -> Iterator[tuple[str, Path]]:
    """`slurmgpu serve` for the sample config, as a site runs it; its socket and its log."""
    directory = tempfile.mkdtemp(prefix="sg-arch-", dir="/tmp")  # AF_UNIX paths must stay short
    os.chmod(directory, 0o755)
    sock, log = os.path.join(directory, "slurmgpu.sock"), Path(directory) / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(BIN / "slurmgpu"), "--config", str(SAMPLE), "serve", "--socket", sock,
                                 "--group", grp.getgrgid(os.getgid()).gr_name], stderr=err)
    try:
        deadline = time.monotonic() + 30
        while call(sock, {"op": "health"}) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield sock, log
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("script_text", [KEPT, REWRITTEN], ids=["kept", "rewritten"])
def test_the_daemon_path_loads_no_decision_code(tmp_path: Path, serve_socket: tuple[str, Path],
                                                script_text: str) -> None:
    """With the daemon answering, gsbatch reads the script, asks once and submits: a kept decision
    costs no more than that. A loaded machine can make the daemon miss gsbatch's 250 ms deadline
    (gsbatch then plans in-process, loading all of it), so the probe has three tries; an import
    put back on the daemon path loads the modules every time."""
    sock, log = serve_socket
    for _ in range(3):
        served = log.read_text().count("slurmgpu serve: ")
        modules, stderr = _imported_by_gsbatch(tmp_path, script_text, SAMPLE, sock)
        assert log.read_text().count("slurmgpu serve: ") == served + 1, "the daemon was asked once"
        assert "gsbatch: warning" not in stderr  # the daemon's answer was applied
        assert ("GPU request changed" in stderr) == (script_text == REWRITTEN)
        assert "slurmgpu.pipeline.validate" in modules  # the answer was checked against the script
        loaded = [m for m in DAEMON_PATH_NEVER if m in modules]
        if not loaded:
            break
    assert loaded == []
    assert [m for m in HEAVY if m in _packages(modules)] == []
    assert list((tmp_path / "spool").iterdir()), "the submission record is still written"


def test_the_daemon_path_compiles_no_code(tmp_path: Path, serve_socket: tuple[str, Path]) -> None:
    """A process's first compile() builds the interpreter's AST node types (about 2 ms of gsbatch's
    start-up), and a typing.NamedTuple whose field annotations are text (``from __future__ import
    annotations``) compiles each of them when its class is made. The modules on gsbatch's daemon
    path make theirs with slurmgpu.typing_lite, which keeps the text, so nothing there compiles;
    without the daemon, the decision modules gsbatch loads do (the probe can see it). The first run
    reads the TOML config (its parser compiles) and leaves the parse in the per-user cache, as every
    later run reads it; a daemon that misses gsbatch's deadline on a loaded machine gets three
    tries, as above."""
    sock, _ = serve_socket
    _gsbatch(tmp_path, KEPT, SAMPLE, sock, [str(BIN / "gsbatch")])  # the config's parse is cached
    for _ in range(3):
        compiled = _compiled_by_gsbatch(tmp_path, KEPT, SAMPLE, sock)
        if not compiled:
            break
    assert compiled == []
    assert "slurmgpu.pipeline.policy" in _compiled_by_gsbatch(tmp_path, KEPT, SAMPLE, None)
