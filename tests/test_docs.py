"""The documentation runs: every ```sh block in README.md and docs/**/*.md is executed (bash -e -o
pipefail, from the repository root, the venv's commands first on PATH), so a command the docs show
cannot rot unnoticed; every relative link must name a file (and heading) that exists.

A block whose first line is ``# as sguser`` runs as that unprivileged user. A block may be skipped
only with ``<!-- docs-test: skip (reason) -->`` on the line before its fence, and only when it is a
long ``make`` target or one of the few host set-ups listed in ``HOST_SETUP``. Output examples are
```text blocks, never run."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import _require

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
USER = "sguser"
BLOCK_TIMEOUT_S = 60
SKIP = re.compile(r"<!-- docs-test: skip \((?P<why>[^)]+)\) -->")
# make targets that take minutes or run the whole suite: documented, never run from here.
LONG_TARGETS = {"test", "demo", "bench", "evaluate", "evaluate-load", "replay", "test-slurm-diff", "site-install"}
# Blocks that set up the host itself (system accounts, /var): run by their own tests, not here.
HOST_SETUP = {("docs/security.md", "groupadd --system slurmgpu")}
MAX_SKIPPED = 4


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    text: str
    skip: str | None  # the reason on the marker line, if any

    @property
    def as_user(self) -> bool:
        return self.text.splitlines()[0].strip() == f"# as {USER}"

    @property
    def commands(self) -> list[str]:
        return [ln.split("#")[0].strip() for ln in self.text.splitlines() if ln.split("#")[0].strip()]


def sh_blocks(page: Path) -> list[Block]:
    """The ```sh blocks of a page; an unclosed fence is an error in the page."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: fence never closed"
        if fence.group(2) == "sh":
            marker = SKIP.fullmatch(lines[i - 1].strip()) if i > 0 else None
            blocks.append(Block(str(page.relative_to(ROOT)), i + 1, "\n".join(lines[i + 1:end]) + "\n",
                                marker.group("why") if marker else None))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in sh_blocks(page)]


def test_only_long_make_targets_and_listed_host_setups_are_skipped() -> None:
    skipped = [b for b in BLOCKS if b.skip]
    for b in skipped:
        long_make = all(re.fullmatch(r"make ([\w-]+)(\s+\w+=\S+)*", c) and c.split()[1] in LONG_TARGETS
                        for c in b.commands)
        assert long_make or (b.page, b.commands[0]) in HOST_SETUP, \
            f"{b.page}:{b.line}: only long make targets or a listed host set-up may skip ({b.commands[0]!r})"
    assert len(skipped) <= MAX_SKIPPED, [f"{b.page}:{b.line}" for b in skipped]
    # a marker line must stand right before a sh fence, never float elsewhere
    markers = [(p, n) for p in PAGES for n, ln in enumerate(p.read_text().splitlines(), 1)
               if SKIP.fullmatch(ln.strip())]
    assert len(markers) == len(skipped), markers


@pytest.fixture(scope="session")
def user_bin() -> Iterator[Path]:
    """Commands the unprivileged user can run. The checkout's venv may be built on an interpreter
    that user cannot execute (a pyenv under /root), so a venv of the system Python is made that
    reads the checkout's own packages (same Python minor version), with the project's commands."""
    if os.geteuid() != 0:
        pytest.skip(f"running a block as {USER} needs root")
    pwd.getpwnam(USER)
    readable = subprocess.run(["runuser", "-u", USER, "--", "test", "-r", str(ROOT / "pyproject.toml")], check=False)
    _require(None if readable.returncode == 0 else f"{USER} cannot read the checkout at {ROOT}")
    purelib = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    system = "/usr/bin/python3"
    minor = subprocess.run([system, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert minor == str(sys.version_info[:2]), f"{system} is {minor}, the venv {sys.version_info[:2]}"
    venv = Path(tempfile.mkdtemp(prefix="slurmgpu-docs-"))
    try:
        venv.chmod(0o755)
        subprocess.run([system, "-m", "venv", "--without-pip", str(venv / "env")], check=True)
        site = subprocess.run([str(venv / "env" / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "slurmgpu-checkout.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        for name, target in scripts.items():
            module, func = target.split(":")
            script = venv / "env" / "bin" / name
            script.write_text(f"#!{venv / 'env' / 'bin' / 'python'}\nimport sys\nfrom {module} import {func}\n"
                              f"sys.exit({func}())\n")
            script.chmod(0o755)
        yield venv / "env" / "bin"
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def run_block(block: Block, user_bin: Path | None) -> subprocess.CompletedProcess[str]:
    argv = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    if user_bin is None:
        env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    else:
        home = pwd.getpwnam(USER).pw_dir
        plain = {"PATH": f"{user_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": home, "USER": USER, "LOGNAME": USER,
                 "LANG": "C.UTF-8"}
        argv = ["runuser", "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in plain.items()), *argv]
        env = None
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          check=False)


@pytest.mark.slurm
@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.skip], ids=lambda b: f"{b.page}:{b.line}")
def test_sh_block_runs(block: Block, request: pytest.FixtureRequest) -> None:
    user_bin = request.getfixturevalue("user_bin") if block.as_user else None
    before = queue()
    try:
        done = run_block(block, user_bin)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.page}:{block.line}: ran past {BLOCK_TIMEOUT_S} s")
    finally:
        left = queue() - before
        if left:  # the queue is left as found even when the block fails
            subprocess.run(["scancel", *left], check=False)
    assert done.returncode == 0, (f"{block.page}:{block.line}: exit {done.returncode}\n--- block\n{block.text}"
                                  f"--- stdout\n{done.stdout[-3000:]}--- stderr\n{done.stderr[-3000:]}")
    assert not left, f"{block.page}:{block.line}: left jobs in the queue: {sorted(left)}"


def queue() -> set[str]:
    """Ids of queued jobs submitted from the repository root, as the blocks' are: a block must cancel
    what it submits (other checkouts' jobs on a shared cluster are not its business)."""
    res = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True, timeout=15, check=False)
    return {job for job, _, workdir in (ln.partition(" ") for ln in res.stdout.splitlines()) if workdir == str(ROOT)}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(page: Path) -> Iterator[tuple[int, str]]:
    text = page.read_text()
    in_code = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            yield n, m.group(1)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for n, target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_page_is_reachable_from_the_index() -> None:
    index = ROOT / "docs" / "index.md"
    named = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p != index and p.resolve() not in named]
    assert not missing, f"docs/index.md does not list: {missing}"
