"""The site install (contrib/site/install.sh, `make site-install`) as an admin runs it, then every
command an ordinary user runs, run as ``sguser`` against the live Slurm: a root-only venv (the old
README's install) gave users ``bad interpreter: Permission denied``. Installs into a temporary
prefix (never /usr/local/bin or /etc): a few minutes, the wheel's dependencies included. The install
puts pyslurm matched to the live Slurm into the venv, and the user's commands then select it."""

from __future__ import annotations

import glob
import grp
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmgpu.pipeline.config import load_config

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent
USER = "sguser"
SCRIPT = """#!/bin/bash
#SBATCH --gres=gpu:a100:1 -p gpu-small -t 5
python train.py --model resnet50 --batch-size 64
"""


def unmatched_pyslurm() -> str | None:
    """Why the install cannot give this Slurm a pyslurm (contrib/pyslurm/install.sh's order: a
    vendored wheel for this Slurm and the site's Python, else the tag's source), or None."""
    slurm = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    major, minor = slurm.split(".")[:2]
    tag = f"{major}.{int(minor)}"
    vendor = os.environ.get("PYSLURM_VENDOR", str(ROOT.parent / "shared" / "vendor" / "pyslurm"))
    python = subprocess.run(["/usr/bin/python3", "-c", 'import sys; print("cp%d%d" % sys.version_info[:2])'],
                            capture_output=True, text=True, check=True).stdout.strip()
    if glob.glob(f"{vendor}/pyslurm-{tag}.*-{python}-{python}-*.whl") or glob.glob(f"{vendor}/pyslurm-{tag}.*.tar.gz"):
        return None
    return f"no vendored pyslurm {tag}.x (wheel for {python} or source) in {vendor} for Slurm {slurm}"


def install(site: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFIX": str(site / "opt"), "BINDIR": str(site / "bin"), "CONFDIR": str(site / "etc"),
           "STATEDIR": str(site / "lib"), "SPOOLDIR": str(site / "spool"), "LOGDIR": str(site / "log"), **extra}
    return subprocess.run(["bash", str(ROOT / "contrib" / "site" / "install.sh")], env=env, capture_output=True,
                          text=True, timeout=900, check=False)


@pytest.fixture(scope="module")
def site() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("the site install runs as root")
    pwd.getpwnam(USER)
    site = Path(tempfile.mkdtemp(prefix="slurmgpu-site-"))
    site.chmod(0o755)  # mkdtemp's 0700 would hide the install from the user, as root's home did
    config = site / "slurmgpu.toml"
    text = (ROOT / "contrib" / "slurmgpu.toml").read_text()
    text = text.replace("/var/lib/slurmgpu", str(site / "lib")).replace("/var/spool/slurmgpu", str(site / "spool"))
    text = text.replace('decider = "rules"', 'decider = "model"')
    config.write_text(text.replace("[site]\n", f'[site]\nmodel_path = "{site / "lib" / "model.json"}"\n', 1))
    done = install(site, CONFIG=str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    try:
        yield site
    finally:
        shutil.rmtree(site, ignore_errors=True)


def as_user(site: Path, *argv: str, user: str = USER, **env: str) -> subprocess.CompletedProcess[str]:
    """A login shell's plain environment: the commands come from BINDIR alone."""
    home = pwd.getpwnam(user).pw_dir
    base = {"PATH": f"{site / 'bin'}:/usr/bin:/bin", "HOME": home, "USER": user, "LOGNAME": user,
            "SLURMGPU_CONFIG": str(site / "etc" / "slurmgpu.toml"), **env}
    return subprocess.run(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in base.items()), *argv],
                          capture_output=True, text=True, timeout=120, check=False, cwd="/tmp")


def mode(path: Path) -> tuple[str, str, int]:
    st = path.stat()
    return pwd.getpwuid(st.st_uid).pw_name, path.group(), stat.S_IMODE(st.st_mode)


def test_install_is_idempotent_and_sets_the_modes_the_code_expects(site: Path) -> None:
    (site / "etc" / "slurmgpu.toml").write_text((site / "etc" / "slurmgpu.toml").read_text() + "# edited\n")
    again = install(site, EXTRAS="", PYSLURM="no")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "kept the existing" in again.stdout
    assert "pyslurm skipped (PYSLURM=no)" in again.stdout and "\npyslurm: " not in again.stdout, again.stdout
    assert (site / "etc" / "slurmgpu.toml").read_text().endswith("# edited\n")
    assert mode(site / "spool" / "submissions") == ("slurmgpu", "slurmgpu", 0o3733)
    assert mode(site / "spool" / "gpu") == ("root", "slurmgpu", 0o2770)
    assert mode(site / "lib")[:2] == ("slurmgpu", "slurmgpu")
    assert stat.S_IMODE((site / "opt" / "bin" / "python").stat().st_mode) & 0o005 == 0o005
    for cmd in ("gsbatch", "slurmgpu", "slurmgpu-monitor"):
        assert os.readlink(site / "bin" / cmd) == str(site / "opt" / "bin" / cmd)
    python = str(site / "opt" / "bin" / "python")
    installed = subprocess.run([python, "-c", "import slurmgpu; print(slurmgpu.__file__)"],
                               capture_output=True, text=True, check=True, cwd="/tmp").stdout
    assert installed.startswith(str(site / "opt")), installed  # a wheel, not an editable link to the checkout


def test_a_bad_pyslurm_setting_is_one_line_before_any_change(site: Path) -> None:
    bad = install(site, PYSLURM="maybe", EXTRAS="")
    assert bad.returncode == 1 and bad.stdout == "", bad
    assert bad.stderr == "site-install: error: PYSLURM must be yes or no, not 'maybe'\n", bad.stderr


def backend_line(site: Path) -> str:
    """`slurmgpu doctor`'s slurm backend check, as the user (doctor exits 1 while any check fails)."""
    doctor = as_user(site, "slurmgpu", "doctor", "--json")
    assert doctor.returncode in (0, 1) and "Traceback" not in doctor.stderr, doctor
    checks = json.loads(doctor.stdout)["checks"]
    return "{status} {detail}".format(**next(c for c in checks if c["name"] == "slurm backend"))


def test_the_users_commands_select_the_pyslurm_the_install_matched_to_slurm(site: Path) -> None:
    """What the user's doctor says, and what ``select_backend()`` (serve's, ingest's, doctor's)
    picks in the site's interpreter as the user: the nodes it reads must be sinfo's."""
    missing = unmatched_pyslurm()
    if missing:
        pytest.skip(missing)
    slurm = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    assert re.fullmatch(rf"OK pyslurm \(pyslurm [\d.]+ matches Slurm {re.escape(slurm)}\)", backend_line(site))
    probe = ("import pyslurm\nfrom slurmgpu.slurm.backend import select_backend\nb = select_backend()\n"
             "print(b.name, pyslurm.__version__, ','.join(sorted(n.name for n in b.nodes())))")
    chosen = as_user(site, str(site / "opt" / "bin" / "python"), "-c", probe)
    assert chosen.returncode == 0, chosen.stderr
    name, version, nodes = chosen.stdout.split()
    assert name == "pyslurm" and version.split(".")[:2] == [slurm.split(".")[0], str(int(slurm.split(".")[1]))]
    live = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout
    assert nodes.split(",") == sorted(set(live.split())), (nodes, live)
    forced = as_user(site, str(site / "opt" / "bin" / "python"), "-c", probe, SLURMGPU_BACKEND="cli")
    assert forced.returncode == 0 and forced.stdout.split()[0] == "cli", forced


@pytest.fixture(scope="module")
def model(site: Path) -> Path:
    """A small real bundle at the config's model_path, world-readable as `slurmgpu train` installs it."""
    from test_serve import quick_bundle

    path = site / "lib" / "model.json"
    quick_bundle(load_config(site / "etc" / "slurmgpu.toml")).save(str(path))
    path.chmod(0o644)
    return path


@pytest.fixture
def script(site: Path) -> Path:
    path = site / "job.sh"
    path.write_text(SCRIPT)
    path.chmod(0o644)
    return path


def test_a_user_tests_and_submits_through_the_site_install(site: Path, model: Path, script: Path,
                                                           submitted: list[str]) -> None:
    version = as_user(site, "gsbatch", "--version")
    assert version.returncode == 0 and "gsbatch (slurmgpu) 0.1.0" in version.stdout, version
    test_only = as_user(site, "gsbatch", "--test-only", str(script))
    assert test_only.returncode == 0, test_only.stderr
    assert re.search(r"sbatch: Job \d+ to start at .* in partition gpu\b", test_only.stderr), test_only.stderr
    before = set(os.listdir(site / "spool" / "submissions"))
    held = as_user(site, "gsbatch", "--hold", "--parsable", str(script))
    assert held.returncode == 0, held.stderr
    job = held.stdout.strip().split(";")[0]
    submitted.append(job)
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"UserId={USER}\(", shown) and "Partition=gpu " in shown and "gres/gpu:a100=1" in shown, shown
    records = set(os.listdir(site / "spool" / "submissions")) - before
    assert len(records) == 1  # the user could drop a record into the 3733 spool
    record = site / "spool" / "submissions" / records.pop()
    assert mode(record) == (USER, "slurmgpu", 0o640)


def test_a_user_predicts_with_the_site_model(site: Path, model: Path, script: Path) -> None:
    done = as_user(site, "slurmgpu", "predict", str(script))
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    decision = answer["decision"]  # gpu-small has no a100: the job moves to gpu, which has
    assert (decision["gpu_type"], decision["partition"], decision["changed"]) == ("a100", "gpu", True), answer
    assert all(c["pred_peak_mem_mib"] > 0 for c in answer["per_type"]), answer


def test_a_user_reads_seff_of_their_job_through_the_daemon(site: Path, script: Path, submitted: list[str]) -> None:
    """The database is 0600 to the nightly account, so a user's seff goes to `slurmgpu serve`."""
    env = {**os.environ, "SLURMGPU_CONFIG": str(site / "etc" / "slurmgpu.toml")}
    upgraded = subprocess.run(["runuser", "-u", "slurmgpu", "--", str(site / "bin" / "slurmgpu"), "db", "upgrade"],
                              env=env, capture_output=True, text=True, timeout=120, check=False, cwd="/tmp")
    assert upgraded.returncode == 0, upgraded.stderr
    quick = site / "quick.sh"
    quick.write_text("#!/bin/bash\n#SBATCH --gres=gpu:t4:1 -p gpu-small -t 1 -o /dev/null\ntrue\n")
    quick.chmod(0o644)
    ran = as_user(site, "gsbatch", "--wait", "--parsable", str(quick))  # seff needs a job sacct knows
    assert ran.returncode == 0, ran.stderr
    job = ran.stdout.strip().split(";")[0]
    _until_accounted(job, ended=True)
    rundir = site / "run"
    rundir.mkdir(mode=0o755)
    sock = rundir / "slurmgpu.sock"
    group = pwd.getpwnam(USER).pw_gid
    serve = subprocess.Popen([str(site / "bin" / "slurmgpu"), "serve", "--socket", str(sock), "--group",
                              grp.getgrgid(group).gr_name, "--run-as", "slurmgpu"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        own = as_user(site, "slurmgpu", "seff", job, SLURMGPU_SOCKET=str(sock))
        assert own.returncode == 0, own.stderr
        assert f"Job ID: {job}" in own.stdout and f"User/Account: {USER}/" in own.stdout, own.stdout
        other = subprocess.run(["sbatch", "--hold", "--parsable", "--wrap", "true"], capture_output=True, text=True,
                               check=True).stdout.strip()
        submitted.append(other)
        _until_accounted(other)  # else seff says accounting does not know it, true but not this test
        refused = as_user(site, "slurmgpu", "seff", other, SLURMGPU_SOCKET=str(sock))
        assert refused.returncode == 1 and "belongs to another user" in refused.stderr, refused
        assert "Traceback" not in refused.stderr
    finally:
        serve.terminate()
        serve.wait(timeout=10)


def _until_accounted(job: str, ended: bool = False) -> None:
    """Wait (60 s at most: slurmdbd lags on a loaded CI machine) until slurmdbd has the job (ENDED: and
    its end, which a job that has just finished gets a moment after its row): seff reads it from sacct.
    A job still unaccounted then fails here, not as a seff that is right to say it does not know it."""
    known = ""
    for _ in range(300):
        known = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "JobID,End"], capture_output=True,
                               text=True).stdout.strip()
        if known and (not ended or known.split("|")[-1] not in ("", "Unknown")):
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} not in Slurm's accounting after 60 s: {known!r}")


def test_without_a_matching_pyslurm_the_install_goes_on_and_the_commands_use_the_cli(site: Path, model: Path,
                                                                                      script: Path) -> None:
    """A site whose Slurm has no vendored pyslurm: one line says why, and nothing fails."""
    subprocess.run([str(site / "opt" / "bin" / "pip"), "uninstall", "-q", "-y", "pyslurm"], capture_output=True,
                   check=True)
    empty = site / "no-vendor"
    empty.mkdir()
    again = install(site, EXTRAS="", PYSLURM_VENDOR=str(empty))
    assert again.returncode == 0, again.stderr[-3000:]
    said = [ln for ln in again.stdout.splitlines() if ln.startswith("pyslurm:")]
    assert len(said) == 1 and "no wheel or source" in said[0] and str(empty) in said[0], again.stdout
    assert backend_line(site) == ("OK command-line tools (pyslurm is not importable (No module named 'pyslurm'); "
                                  "make pyslurm installs it in a checkout, make site-install in a site)")
    test_only = as_user(site, "gsbatch", "--test-only", str(script))
    assert test_only.returncode == 0 and re.search(r"sbatch: Job \d+ to start at", test_only.stderr), test_only
