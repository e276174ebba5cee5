"""Advise or rewrite, and waivers: the config, the resolution (frozen clock), gsbatch, the daemon,
and advise mode on the live cluster (byte-identical script, same TRES as plain sbatch)."""

from __future__ import annotations

import io
import json
import os
import pwd
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest

from slurmgpu.apps import gsbatch, serve
from slurmgpu.pipeline import modes
from slurmgpu.pipeline.config import load_config, parse_config
from slurmgpu.pipeline.errors import ConfigError
from slurmgpu.pipeline.features import script_features
from slurmgpu.pipeline.modes import ADVISE, REWRITE, Modes, Waiver

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "contrib" / "slurmgpu.toml"
BIN = Path(sys.executable).parent
ME = pwd.getpwuid(os.getuid()).pw_name
BODY = "python train.py --model resnet50 --batch-size 64\n"
FAMILY = script_features("#!/bin/bash\n" + BODY)["family"]


def config_text(extra: str = "", policy: str = "") -> str:
    """The sample config with lines added to [policy] and at the end."""
    text = re.sub(r"(?m)^mode = .*\n", "", SAMPLE.read_text()).replace("[policy]\n", f"[policy]\n{policy}\n", 1)
    return text + "\n" + extra


def write_config(tmp_path: Path, extra: str = "", policy: str = "") -> Path:
    p = tmp_path / "slurmgpu.toml"
    p.write_text(config_text(extra, policy))
    return p


def waiver(who: str = f'user = "{ME}"', family: str = FAMILY, expires: str = "2025-06-30") -> str:
    return (f'[[waivers]]\n{who}\nfamily = "{family}"\nreason = "a/b benchmark on a100"\n'
            f'owner = "hpc-admin"\nexpires = {expires}\n')


# --- the config ------------------------------------------------------------------------------------


def test_modes_and_waivers_are_read_and_default_to_rewrite(tmp_path: Path) -> None:
    plain = load_config(SAMPLE)
    assert plain.policy.mode == REWRITE and plain.modes == Modes() and plain.waivers == ()
    cfg = parse_config(__import__("tomllib").loads(config_text(
        '[policy.modes]\npartitions = {gpu = "advise"}\naccounts = {ml = "rewrite"}\nusers = {ann = "advise"}\n'
        + waiver() + waiver('account = "ml"', expires='"2025-07-01"'), policy='mode = "rewrite"')))
    assert cfg.modes == Modes(REWRITE, {"gpu": ADVISE}, {"ml": REWRITE}, {"ann": ADVISE})
    assert cfg.waivers == (Waiver(FAMILY, "a/b benchmark on a100", "hpc-admin", date(2025, 6, 30), user=ME),
                           Waiver(FAMILY, "a/b benchmark on a100", "hpc-admin", date(2025, 7, 1), account="ml"))


def test_a_config_with_waivers_is_cached_and_reads_back_the_same(tmp_path: Path) -> None:
    path, cache = write_config(tmp_path, waiver()), tmp_path / "cache"
    first = load_config(path, str(cache))
    assert list(cache.iterdir())  # the TOML date is kept as YYYY-MM-DD
    assert load_config(path, str(cache)) == first


def test_an_invalid_config_is_not_cached(tmp_path: Path) -> None:
    """A date where a string belongs must stay an error on the next load too (no JSON round trip)."""
    path, cache = write_config(tmp_path), tmp_path / "cache"
    path.write_text(path.read_text().replace('cluster = "slurmgpu"', "cluster = 2025-01-01"))
    for _ in range(2):
        with pytest.raises(ConfigError, match="site.cluster"):
            load_config(path, str(cache))
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize(("extra", "policy", "message"), [
    ("", 'mode = "suggest"', "policy.mode: must be one of rewrite, advise, got 'suggest'"),
    ("", "mode = true", "policy.mode: expected str, got a boolean"),
    ('[policy.modes]\npartitions = {gpu = "off"}\n', "", "policy.modes.partitions.gpu: must be one of"),
    ('[policy.modes]\ngroups = {ml = "advise"}\n', "", "policy.modes.groups: unknown key"),
    ('[policy.modes]\nusers = {"a b" = "advise"}\n', "", "policy.modes.users: invalid name 'a b'"),
    ('[policy.modes]\nusers = "ann"\n', "", "policy.modes.users: expected dict"),
    (waiver('user = "ann"\naccount = "ml"'), "", "waivers[0].user: give exactly one of user and account"),
    (waiver("# nobody"), "", "waivers[0].user: give exactly one of user and account"),
    (waiver(family="resnet50"), "", "waivers[0].family: must be a family key"),
    (waiver(expires="2025-06-30T12:00:00"), "", "waivers[0].expires: must be a date"),
    (waiver(expires='"next year"'), "", "waivers[0].expires: must be a date"),
    (waiver(expires='"2025-02-30"'), "", "waivers[0].expires: must be a date"),
    (waiver() + 'colour = "red"\n', "", "waivers[0].colour: unknown key"),
    (waiver().replace('reason = "a/b benchmark on a100"', 'reason = " "'), "", "waivers[0].reason: must be one line"),
    (waiver().replace('owner = "hpc-admin"\n', ""), "", "waivers[0].owner: missing"),
    ("[waivers]\nuser = 'ann'\n", "", "waivers: expected list"),
])
def test_bad_modes_and_waivers_are_refused_with_their_key(tmp_path: Path, extra: str, policy: str,
                                                          message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write_config(tmp_path, extra, policy))


def test_parse_prints_the_family_a_waiver_names(tmp_path: Path) -> None:
    p = tmp_path / "j.sh"
    p.write_text("#!/bin/bash\n#SBATCH --gres=gpu:a100:1\n" + BODY.replace("64", "128"))
    res = subprocess.run([str(BIN / "slurmgpu"), "parse", str(p), "--json"], capture_output=True, text=True,
                         env={"PATH": f"{BIN}:/usr/bin:/bin"}, timeout=60, check=True)
    assert json.loads(res.stdout)["family"] == FAMILY  # another batch size: the same family


# --- the resolution --------------------------------------------------------------------------------

MODES = Modes(REWRITE, partitions={"gpu": ADVISE, "debug": REWRITE}, accounts={"ml": REWRITE, "bio": ADVISE},
              users={"ann": REWRITE, "bob": ADVISE})


@pytest.mark.parametrize(("user", "account", "partition", "expected"), [
    ("ann", "bio", "gpu", (REWRITE, "user ann")),  # user over account and partition
    ("bob", "ml", "debug", (ADVISE, "user bob")),
    ("cat", "ml", "gpu", (REWRITE, "account ml")),  # account over partition
    ("cat", "bio", "debug", (ADVISE, "account bio")),
    ("cat", "physics", "gpu", (ADVISE, "partition gpu")),
    ("cat", None, "gpu-small,debug", (REWRITE, "partition debug")),  # the first listed with an entry
    ("cat", None, None, (ADVISE, "partition gpu")),  # none named: the default partition
    ("cat", None, "gpu-small", (REWRITE, "default")),
])
def test_user_over_account_over_partition_over_global(user: str, account: str | None, partition: str | None,
                                                      expected: tuple[str, str]) -> None:
    assert modes.resolve_mode(MODES, user, account, partition, "gpu") == expected
    assert modes.resolve_mode(MODES._replace(default=ADVISE), "cat", None, "gpu-small", "gpu") == (ADVISE, "default")


def test_a_waiver_applies_through_its_last_day_then_stops_by_itself() -> None:
    w = [Waiver(FAMILY, "benchmark", "hpc-admin", date(2025, 6, 30), user="ann"),
         Waiver("0123456789ab", "other family", "hpc-admin", date(2030, 1, 1), account="ml")]

    def found(today: date, user: str = "ann", account: str | None = None, family: str = FAMILY) -> Waiver | None:
        return modes.resolve(Modes(), w, user=user, account=account, partition=None, family=family,
                             today=today).waiver

    assert found(date(2025, 6, 1)) == w[0]
    assert found(date(2025, 6, 30)) == w[0]  # "until" the date: inclusive
    assert found(date(2025, 7, 1)) is None  # expired: no sleeping, no admin action
    assert found(date(2025, 6, 1), user="bob") is None  # someone else's waiver
    assert found(date(2025, 6, 1), family="fedcba987654") is None  # another family
    assert found(date(2029, 1, 1), user="bob", account="ml", family="0123456789ab") == w[1]  # by account
    assert w[0].text() == "waiver: benchmark (granted by hpc-admin, until 2025-06-30)"


PLAN = {
    "decision": {"decider": "model", "changed": True, "refused": None, "reasons": ["v100 fits; sooner"],
                 "changes": [{"index": 0, "gpu_type": "v100", "gpus_total": 1, "partition": None}],
                 "per_type": [{"gpu_type": "a100", "gpus": 2, "fits": True, "pred_peak_mem_mib": 9000.0,
                               "pred_runtime_s": 1500.0, "expected_wait_s": 4200.0},
                              {"gpu_type": "v100", "gpus": 1, "fits": True, "pred_peak_mem_mib": 9000.0,
                               "pred_runtime_s": 2100.0, "expected_wait_s": 300.0}]},
    "submission": {"script_text": "#!/bin/bash\n#SBATCH --gres=gpu:v100:1\n", "cli_words": ["-t", "60"],
                   "env_overrides": {"SBATCH_GRES": "gpu:v100:1"}, "changed": True},
    "record": {"original_request": {"gpu_type": "a100", "gpus_total": 2, "partition": "gpu"},
               "decision": {"changed": True, "d": "0123456789ab"}, "changed": True, "script_sha256": "x"},
    "notes": [],
}


def test_advise_mode_submits_as_written_and_keeps_the_decision() -> None:
    out = modes.apply_resolution(PLAN, modes.Resolution(ADVISE, "partition gpu"), ["-t", "60"])
    assert out["submission"] == {"script_text": None, "cli_words": ["-t", "60"], "env_overrides": {},
                                 "changed": False}
    decision = out["decision"]
    assert decision["changes"] == PLAN["decision"]["changes"]  # what would have changed
    assert (decision["mode"], decision["mode_source"], decision["advised"]) == (ADVISE, "partition gpu", True)
    assert out["record"]["changed"] is False and out["record"]["decision"]["advised"] is True
    assert out["record"]["decision"]["d"] == "0123456789ab"  # the record's own fields stay
    assert modes.apply_resolution(PLAN, modes.Resolution(), ["-t", "60"]) == PLAN  # rewrite: as planned
    tagged = {**PLAN, "tag": "slurmgpu:d=0123456789ab;m=model"}
    assert modes.apply_resolution(tagged, modes.Resolution(), [])["tag"] == tagged["tag"]
    assert "tag" not in modes.apply_resolution(tagged, modes.Resolution(ADVISE, "default"), [])  # no comment either
    assert modes.advice_line(PLAN["record"]["original_request"], decision) == \
        "1 x v100 would finish in ~40 min vs ~95 min as asked (58% sooner); submitted as written"
    longer = {**decision, "changes": [{**decision["changes"][0], "time_limit_s": 5400}]}  # a move's longer limit
    assert modes.advice_line(PLAN["record"]["original_request"], longer).startswith(
        "1 x v100 with a time limit of 01:30:00 would finish in ~40 min")


def test_a_waiver_keeps_the_request_with_its_reason_in_either_mode() -> None:
    w = Waiver(FAMILY, "a/b benchmark", "hpc-admin", date(2025, 6, 30), user="ann")
    for mode in (REWRITE, ADVISE):
        out = modes.apply_resolution(PLAN, modes.Resolution(mode, "default", w), ["-t", "60"])
        assert out["submission"]["changed"] is False and out["submission"]["script_text"] is None
        assert out["decision"]["reasons"] == ["waiver: a/b benchmark (granted by hpc-admin, until 2025-06-30)"]
        assert out["decision"]["changes"] == [] and out["decision"]["waived"] == PLAN["decision"]["changes"]
        assert out["decision"].get("advised", False) is False  # nothing advised: the waiver decided


# --- gsbatch ---------------------------------------------------------------------------------------


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def submit(self, words, env, stdin=None):  # type: ignore[no-untyped-def]
        script = next((w for w in words if w.endswith(".sh")), None)
        self.calls.append({"words": list(words), "env": dict(env),
                           "content": Path(script).read_bytes() if script else None})
        return gsbatch.Submitted(0, "4242")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    p = tmp_path / "train.sh"
    p.write_bytes(b"#!/bin/bash\n#SBATCH -p gpu-small\n#SBATCH --gres=gpu:a100:2\n" + BODY.encode())
    return p


def submit(tmp_path: Path, job: Path, config: Path, capsys: pytest.CaptureFixture[str],
           env: dict[str, str] | None = None) -> tuple[Recorder, dict, str]:
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    rec = Recorder()
    environ = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURMGPU_SUBMISSION_SPOOL": str(spool),
               "SLURMGPU_SOCKET": str(tmp_path / "no.sock"), **(env or {})}
    code = gsbatch.main([f"--gs-config={config}", str(job)], environ, rec)
    assert code == 0
    records = [json.loads(p.read_text()) for p in spool.iterdir()]
    assert len(records) == 1
    return rec, records[0], capsys.readouterr().err


def test_gsbatch_in_advise_mode_submits_the_script_as_written(tmp_path: Path, job: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rec, record, err = submit(tmp_path, job, write_config(tmp_path, policy='mode = "advise"'), capsys)
    assert rec.calls[0]["words"] == [str(job)] and rec.calls[0]["content"] == job.read_bytes()
    assert record["changed"] is False
    assert record["decision"]["advised"] is True and record["decision"]["mode"] == ADVISE
    assert record["decision"]["changes"][0]["partition"] == "gpu"
    assert err.splitlines() == ["gsbatch: advice: as written the job cannot run: GPU type a100 is not in partition "
                                "gpu-small; moved to gpu, which has it (2 x a100 in partition gpu instead of 2 x "
                                "a100 in partition gpu-small); submitted as written"]


def test_gsbatch_rewrites_for_a_user_the_config_puts_in_rewrite_mode(tmp_path: Path, job: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The user is whom the kernel says gsbatch runs as: $USER and $LOGNAME do not choose the entry."""
    config = write_config(tmp_path, f'[policy.modes]\nusers = {{{ME} = "rewrite", mallory = "advise"}}\n',
                          policy='mode = "advise"')
    rec, record, err = submit(tmp_path, job, config, capsys,
                              env={"USER": "mallory", "LOGNAME": "mallory", "SLURMGPU_MODE": "advise"})
    assert rec.calls[0]["words"] != [str(job)] and record["changed"] is True
    assert "advised" not in record["decision"] and "GPU request changed" in err


def test_gsbatch_keeps_a_waived_family_until_the_waiver_expires(tmp_path: Path, job: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, waiver(expires="2999-12-31"))
    rec, record, err = submit(tmp_path, job, config, capsys)
    assert rec.calls[0]["words"] == [str(job)] and rec.calls[0]["content"] == job.read_bytes()
    assert record["decision"]["reasons"] == ["waiver: a/b benchmark on a100 (granted by hpc-admin, until 2999-12-31)"]
    assert err.splitlines() == ["gsbatch: note: request kept as written: waiver: a/b benchmark on a100 "
                                "(granted by hpc-admin, until 2999-12-31)"]
    expired = write_config(tmp_path, waiver(expires="2000-01-01"))
    (tmp_path / "spool" / next(iter(os.listdir(tmp_path / "spool")))).unlink()
    rec, record, _ = submit(tmp_path, job, expired, capsys)
    assert record["changed"] is True and "waiver" not in record["decision"]


def test_a_failure_resolving_the_mode_submits_as_written(tmp_path: Path, job: Path, monkeypatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(modes, "resolve", broken)
    spool = tmp_path / "spool"
    spool.mkdir()
    rec = Recorder()
    config = write_config(tmp_path, policy='mode = "advise"')
    code = gsbatch.main([f"--gs-config={config}", str(job)],
                        {"PATH": os.environ["PATH"], "SLURMGPU_SUBMISSION_SPOOL": str(spool)}, rec)
    assert code == 0 and rec.calls[0]["words"] == [str(job)]
    assert capsys.readouterr().err.startswith("gsbatch: warning: slurmgpu failed (RuntimeError: boom)")


# --- the daemon ------------------------------------------------------------------------------------

MOVED = {"script": "#!/bin/bash\n" + BODY, "tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small",
         "user_id": 0}


def service(tmp_path: Path, extra: str = "", policy: str = "") -> serve.Service:
    return serve.Service(load_config(write_config(tmp_path, extra, policy)))


def test_the_daemon_moves_advice_out_of_apply(tmp_path: Path) -> None:
    svc = service(tmp_path, '[policy.modes]\npartitions = {gpu-small = "advise"}\n')
    reply = svc.handle(json.dumps({"op": "decide", "job": {**MOVED, "mode": "rewrite"}}).encode())
    decision = reply["decision"]
    assert decision["apply"] == {} and decision["advice"] == {"partition": "gpu"}
    assert (decision["mode"], decision["mode_source"], decision["advised"]) == (ADVISE, "partition gpu-small", True)
    assert decision["family"] == FAMILY
    plain = service(tmp_path).handle(json.dumps({"op": "decide", "job": MOVED}).encode())["decision"]
    assert plain["apply"] == {"partition": "gpu"} and plain["mode"] == REWRITE


def test_the_daemon_applies_waivers_by_its_own_clock(tmp_path: Path) -> None:
    svc = service(tmp_path, waiver('user = "root"'))
    line = json.dumps({"op": "decide", "job": MOVED}).encode()
    svc.today = lambda: date(2025, 6, 30)
    kept = svc.handle(line)["decision"]
    assert kept["apply"] == {} and kept["reasons"] == [
        "waiver: a/b benchmark on a100 (granted by hpc-admin, until 2025-06-30)"]
    svc.today = lambda: date(2025, 7, 1)
    assert svc.handle(line)["decision"]["apply"] == {"partition": "gpu"}


def test_the_daemon_logs_advised_decisions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = service(tmp_path, policy='mode = "advise"')
    with caplog.at_level("INFO", logger="slurmgpu.apps.serve"):
        svc.handle(json.dumps({"op": "decide", "job": MOVED}).encode())
    assert 'result="advised: partition=gpu"' in caplog.text and 'mode="advise"' in caplog.text


# --- the live cluster ------------------------------------------------------------------------------


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                         check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def batch_script(job_id: str) -> bytes:
    return subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True,
                          check=True).stdout


@pytest.mark.slurm
@pytest.mark.parametrize("directives", [
    "#SBATCH -p gpu-small\n#SBATCH --gres=gpu:a100:2",  # rules: moved to gpu
    "#SBATCH --gres=gpu:1\n#SBATCH --constraint=v100",  # rules: made typed
])
def test_advise_mode_on_the_live_cluster_is_plain_sbatch(tmp_path: Path, submitted: list[str], directives: str) -> None:
    """The same script submitted held with plain sbatch and with gsbatch in advise mode: slurmctld
    stores byte-identical scripts with the same TRES and partition; the record holds the decision."""
    script = tmp_path / "advise-mode.sh"
    script.write_bytes(f"#!/bin/bash\n#SBATCH -J slurmgpu-advise-test -t 10\n{directives}\n{BODY}".encode())
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "SLURMGPU_CONFIG": str(write_config(tmp_path, policy='mode = "advise"')),
           "SLURMGPU_SUBMISSION_SPOOL": str(spool), "SLURMGPU_SOCKET": str(tmp_path / "no.sock")}
    ids = []
    for argv in (["sbatch"], ["gsbatch"]):
        res = subprocess.run([*argv, "--parsable", "--hold", str(script)], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        ids.append(res.stdout.strip().split(";")[0])
        submitted.append(ids[-1])
        if argv == ["gsbatch"]:
            assert re.fullmatch(r"gsbatch: advice: .*; submitted as written\n", res.stderr), res.stderr
    plain, advised = (scontrol_job(i) for i in ids)
    assert batch_script(ids[1]) == batch_script(ids[0]) == script.read_bytes()
    for key in ("TRES", "Partition", "TresPerNode", "Features", "JobName", "NumNodes"):
        assert advised.get(key) == plain.get(key), key
    record = json.loads(next(spool.iterdir()).read_text())
    assert record["job_id"] == ids[1] and record["changed"] is False
    assert record["decision"]["advised"] is True and record["decision"]["changes"]
    # and what the decider would have done really differs from what was submitted
    rewrite_env = {**env, "SLURMGPU_CONFIG": str(SAMPLE)}
    dry = subprocess.run(["gsbatch", "--dry-run", str(script)], capture_output=True, env=rewrite_env, cwd=tmp_path,
                         timeout=60, check=True)
    assert dry.stdout != script.read_bytes()


def test_stdin_is_read_once_in_advise_mode(tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A script on stdin in advise mode reaches sbatch byte for byte on stdin."""
    data = b"#!/bin/bash\n#SBATCH -p gpu-small\n#SBATCH --gres=gpu:a100:2\n" + BODY.encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    spool = tmp_path / "spool"
    spool.mkdir()
    got: list[tuple[list[str], bytes | None]] = []

    class Stdin:
        def submit(self, words, env, stdin=None):  # type: ignore[no-untyped-def]
            got.append((list(words), stdin))
            return gsbatch.Submitted(0, "7")

    config = write_config(tmp_path, policy='mode = "advise"')
    assert gsbatch.main([f"--gs-config={config}"], {"PATH": os.environ["PATH"],
                                                    "SLURMGPU_SUBMISSION_SPOOL": str(spool)}, Stdin()) == 0
    assert got == [([], data)]
    assert "gsbatch: advice:" in capsys.readouterr().err
