"""Issue 28, the admin's side: what `config check`, `config init`, `doctor`, `gsbatch --version` and the
decision tag say and do is true. Live parts run against the local cluster (marked slurm)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmgpu.apps import doctor
from slurmgpu.cli.main import main
from slurmgpu.pipeline.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
MISSPELT = """
[policy.modes]
partitions = { gpu-smal = "advise" }
accounts = { slurmgpuu = "advise" }
users = { nosuchuser28 = "rewrite" }

[[waivers]]
account = "physics28"
family = "e164288c59e6"
reason = "A/B benchmark"
owner = "hpc-admin"
expires = 2020-01-31
"""


def misspelt(tmp_path: Path) -> Path:
    path = tmp_path / "slurmgpu.toml"
    path.write_text(SAMPLE.read_text() + MISSPELT)
    return path


def test_names_and_expired_waivers_without_a_cluster(tmp_path: Path) -> None:
    config = load_config(misspelt(tmp_path))
    names = doctor.Names(frozenset({"gpu", "gpu-small", "debug"}), frozenset({"root", "sguser"}),
                         frozenset({"root", "slurmgpu"}))
    problems = doctor.name_problems(config, names)
    assert len(problems) == 4, problems
    assert problems[0].startswith("[policy.modes] partitions: partition 'gpu-smal' is not known") \
        and problems[0].endswith("did you mean 'gpu-small'?")
    assert any("user 'nosuchuser28'" in p for p in problems)
    assert any("account 'slurmgpuu'" in p and "did you mean 'slurmgpu'?" in p for p in problems)
    assert any(p.startswith("waivers[0].account: account 'physics28'") for p in problems)
    assert doctor.name_problems(config, names._replace(users=None, accounts=None)) == problems[:1]
    assert doctor.expired_waivers(config, date(2020, 1, 31)) == []  # holds through its day
    assert doctor.expired_waivers(config, date(2020, 2, 1)) == [
        "waivers[0] (physics28, family e164288c59e6) expired on 2020-01-31: it no longer applies; "
        "remove it or extend expires"]


@pytest.mark.slurm
def test_config_check_names_every_unknown_name_in_one_run(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["--config", str(misspelt(tmp_path)), "config", "check"])
    assert res.exit_code == 1, res.output
    assert "matches the live cluster" not in res.output
    lines = res.output.splitlines()
    assert sum(line.startswith("mismatch: ") for line in lines) == 4, res.output
    assert "did you mean 'gpu-small'?" in res.output and "user 'nosuchuser28'" in res.output
    assert "warning: waivers[0] (physics28, family e164288c59e6) expired on 2020-01-31" in res.output
    as_json = CliRunner().invoke(main, ["--config", str(misspelt(tmp_path)), "config", "check", "--json"])
    data = json.loads(as_json.stdout)
    assert as_json.exit_code == 1 and data["matches"] is False and len(data["errors"]) == 4
    assert len(data["warnings"]) == 1
    good = CliRunner().invoke(main, ["--config", str(SAMPLE), "config", "check", "--json"])
    assert good.exit_code == 0 and json.loads(good.stdout) == {
        "config": str(SAMPLE), "valid": True, "errors": [], "warnings": [], "matches": True}


@pytest.mark.slurm
def test_gsbatch_version_names_slurmgpu_too() -> None:
    from slurmgpu import __version__

    res = subprocess.run([sys.executable, "-c", "import sys; from slurmgpu.apps import gsbatch; "
                          "sys.exit(gsbatch.main(sys.argv[1:]))", "--version"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith("slurm")  # sbatch's own line, first and unchanged
    assert f"gsbatch (slurmgpu) {__version__}" in res.stdout.splitlines()[1:]


def test_config_init_sizes_a_card_by_its_node_feature() -> None:
    import tomllib

    from slurmgpu.apps.config_init import config_text
    from slurmgpu.slurm.backend import NodeInfo

    nodes = [NodeInfo("gpu1", ("gpu",), {"a100": 4, "v100": 4}, "idle", ("a100", "a100-80gb", "v100")),
             NodeInfo("gpu2", ("gpu",), {"a100": 4}, "idle", ("a100", "a100-40gb")),
             NodeInfo("gpu3", ("small",), {"t4": 4}, "idle", ("t4",))]
    text = config_text(nodes[:1] + nodes[2:], "gpu")
    types = tomllib.loads(text)["gpu_types"]
    assert types["a100"]["memory_gib"] == 80 and types["a100"]["features"] == ["a100", "a100-80gb"]
    assert types["v100"]["features"] == ["v100"] and types["t4"]["features"] == ["t4"]
    assert "(node feature a100-80gb)" in text
    assert text.count("half speed, half memory") == 1 and text.count("tensor peak") == 1  # said once, not per type
    mixed = config_text(nodes, "gpu")
    assert tomllib.loads(mixed)["gpu_types"]["a100"]["memory_gib"] == 40  # two sizes under one name: the smaller
    assert "say different sizes (A100-40, A100-80)" in mixed


@pytest.mark.slurm
def test_config_init_on_the_local_cluster_matches_it(tmp_path: Path) -> None:
    import tomllib

    out = tmp_path / "init.toml"
    res = CliRunner().invoke(main, ["config", "init", "--out", str(out)])
    assert res.exit_code == 0, res.output
    a100 = tomllib.loads(out.read_text())["gpu_types"]["a100"]
    assert a100["memory_gib"] == 80 and "a100-80gb" in a100["features"]  # gpu1 says Features=a100-80gb
    check = CliRunner().invoke(main, ["--config", str(out), "config", "check"])
    assert check.exit_code == 0 and check.output.endswith("matches the live cluster\n"), check.output


def scontrol_config(**fields: str) -> str:
    base = {"AccountingStorageType": "accounting_storage/slurmdbd", "AccountingStoreFlags": "job_comment",
            "JobRequeue": "1", "Prolog": "(null)", "Epilog": "(null)", "PrologFlags": "(null)"}
    return "".join(f"{k:24}= {v}\n" for k, v in {**base, **fields}.items())


def test_doctor_checks_collector_accounting_and_retry(tmp_path: Path) -> None:
    config = load_config(SAMPLE)
    retrying = config._replace(policy=config.policy._replace(oom_retry=True))
    (tmp_path / "prolog.d").mkdir()
    (tmp_path / "prolog.d" / "10-slurmgpu.sh").write_text("exec /usr/local/sbin/slurmgpu-monitor ...\n")
    (tmp_path / "epilog.sh").write_text("slurmgpu-monitor stop\n")
    bare = {c.name: c for c in doctor.check_slurm_config(lambda argv: scontrol_config(), config)}
    assert bare["collector"].status == doctor.WARN and "slurmgpu-monitor never runs" in bare["collector"].detail
    assert bare["accounting"].status == doctor.OK and "retry" not in bare
    failing = {c.name: c for c in doctor.check_slurm_config(
        lambda argv: scontrol_config(AccountingStoreFlags="(null)", JobRequeue="0"), retrying)}
    assert failing["collector"].status == doctor.FAIL  # retry depends on it
    assert failing["accounting"].status == doctor.WARN and "job_comment" in failing["accounting"].advice
    assert failing["retry"].status == doctor.FAIL and "JobRequeue=0" in failing["retry"].detail
    good = doctor.check_slurm_config(lambda argv: scontrol_config(
        Prolog=f"{tmp_path}/prolog.d/*", Epilog=f"{tmp_path}/epilog.sh", PrologFlags="Alloc"), retrying)
    assert [c.status for c in good] == [doctor.OK] * 3, good
    noalloc = doctor.check_slurm_config(lambda argv: scontrol_config(
        Prolog=f"{tmp_path}/prolog.d/*", Epilog=f"{tmp_path}/epilog.sh"), config)
    assert noalloc[0].status == doctor.WARN and "PrologFlags=Alloc" in noalloc[0].advice
    nodbd = doctor.check_slurm_config(lambda argv: scontrol_config(AccountingStorageType="(null)"), config)
    assert nodbd[1].status == doctor.FAIL


@pytest.mark.slurm
def test_doctor_says_the_local_cluster_runs_no_collector() -> None:
    res = CliRunner().invoke(main, ["--config", str(SAMPLE), "doctor", "--json"])
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["collector"]["status"] == "WARN" and "Prolog = (null)" in checks["collector"]["detail"]
    assert checks["accounting"]["status"] == "OK"  # the local cluster keeps job_comment
