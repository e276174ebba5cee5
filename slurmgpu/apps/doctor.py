"""``slurmgpu doctor``: check the whole installation and say in plain words what to fix.

Each check is a small function that takes what it inspects (paths, a clock, a command runner,
a loader) as arguments, so the tests can hand it fakes; ``slurmgpu.cli.report.doctor_cmd`` passes the
real ones. A check never raises: whatever goes wrong becomes its FAIL or WARN line.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any, NamedTuple

from slurmgpu.pipeline.config import Config
from slurmgpu.pipeline.errors import InputError

OK, WARN, FAIL = "OK", "WARN", "FAIL"
DEFAULT_SOCKET = "/run/slurmgpu/slurmgpu.sock"
MODEL_MAX_AGE_DAYS = 14.0
SPOOL_MAX_AGE_HOURS = 48.0  # two nightly ingests missed


class Check(NamedTuple):
    name: str
    status: str  # OK, WARN or FAIL
    detail: str  # what was found
    advice: str = ""  # one line: what to do about it (empty when OK)


def run_text(argv: list[str]) -> str:
    """A Slurm command's standard output; its error line as the exception when it fails."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{argv[0]}: {exc}") from None
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip() or 'exit ' + str(res.returncode)}")
    return res.stdout


def exit_status(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def check_config(path: str | None, load: Callable[[str], Config]) -> tuple[Check, Config | None]:
    """The config file exists and validates; the loaded config feeds the later checks."""
    if path is None:
        return Check("config", FAIL, "no config file found",
                     "install /etc/slurmgpu/slurmgpu.toml (see contrib/slurmgpu.toml) or set SLURMGPU_CONFIG"), None
    try:
        config = load(path)
    except InputError as exc:
        return Check("config", FAIL, f"{path}: {exc}", "fix the file, then run `slurmgpu config check --offline`"), None
    return Check("config", OK, f"{path}: valid ({len(config.gpu_types)} GPU types, "
                               f"{len(config.partitions)} partitions)"), config


def check_cluster(config: Config | None, nodes: Callable[[], list[Any]],
                  compare: Callable[[Config, list[Any]], list[str]]) -> Check:
    """The config describes the partitions and GPU types the live cluster has."""
    if config is None:
        return Check("cluster", WARN, "not compared: no valid config", "fix the config first")
    try:
        live = nodes()
    except Exception as exc:  # noqa: BLE001 - any failure to ask Slurm is this one answer
        return Check("cluster", FAIL, f"cannot ask Slurm: {exc}",
                     "check that slurmctld is running and sinfo works on this host")
    problems = compare(config, live)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check("cluster", FAIL, f"{problems[0]}{more}",
                     "make [partitions]/[gpu_types] match sinfo; `slurmgpu config check` lists every mismatch")
    return Check("cluster", OK, f"config matches the live cluster ({len(live)} node{'' if len(live) == 1 else 's'})")


def check_backend(env: Mapping[str, str], choose: Callable[[Mapping[str, str]], Any]) -> Check:
    """Which Slurm backend the daemon and the ingest use (``slurm.backend.choose_backend``), and why."""
    asked = env.get("SLURMGPU_BACKEND", "auto")
    try:
        choice = choose(env)
    except Exception as exc:  # noqa: BLE001 - a broken pyslurm install is this one answer
        return Check("slurm backend", WARN, f"cannot choose: {exc}", "unset SLURMGPU_BACKEND or set it to cli")
    detail = f"{'pyslurm' if choice.backend.name == 'pyslurm' else 'command-line tools'} ({choice.reason})"
    if asked not in ("auto", "cli", "pyslurm"):
        return Check("slurm backend", WARN, f"{detail}; SLURMGPU_BACKEND={asked} is read as auto",
                     "set SLURMGPU_BACKEND to auto, cli or pyslurm")
    if asked == "pyslurm" and choice.backend.name != "pyslurm":
        return Check("slurm backend", WARN, detail,
                     "run `make pyslurm` for a pyslurm matching this Slurm (docs/admins/pyslurm.md)")
    return Check("slurm backend", OK, detail)


def check_database(url: str, current: Callable[[str], str | None], head: str | None,
                   sqlite_path: str | None = None) -> Check:
    """The history database answers and is migrated to the code's schema revision."""
    if sqlite_path is not None and not os.path.exists(sqlite_path):
        return Check("database", FAIL, f"{sqlite_path} does not exist", "run `slurmgpu db upgrade` to create it")
    try:
        rev = current(url)
    except Exception as exc:  # noqa: BLE001 - any driver error is the same advice
        first = str(exc).splitlines()[0] if str(exc) else ""
        return Check("database", FAIL, f"unreachable: {type(exc).__name__}: {first}",
                     "check [site] database_url / --db and that the database server is running")
    if rev is None:
        return Check("database", FAIL, "reachable but empty (no schema)", "run `slurmgpu db upgrade`")
    if rev != head:
        return Check("database", FAIL, f"at revision {rev}, code needs {head}", "run `slurmgpu db upgrade`")
    return Check("database", OK, f"reachable, at revision {rev}")


def check_model(path: str, config: Config | None, load: Callable[[str], Any], trained_at: datetime | None,
                now: datetime, max_age_days: float = MODEL_MAX_AGE_DAYS) -> Check:
    """The model file loads and is recent. Missing or broken only fails when the model decider is on.

    ``trained_at`` is the registry's time for the active version (naive UTC); without it the file's
    modification time is used.
    """
    needed = config is not None and config.policy.decider == "model"
    bad = FAIL if needed else WARN
    why = "the model decider is on" if needed else "needed before setting policy.decider = \"model\""
    if not os.path.exists(path):
        return Check("model", bad, f"no model at {path}", f"run `slurmgpu train` ({why})")
    try:
        load(path)
    except Exception as exc:  # noqa: BLE001 - unreadable, stale format, bad JSON: all mean "retrain"
        return Check("model", bad, f"{path} unusable: {exc}", f"run `slurmgpu train` ({why})")
    when = trained_at or datetime.fromtimestamp(os.stat(path).st_mtime, UTC).replace(tzinfo=None)
    age = (now - when).total_seconds() / 86400.0
    if age > max_age_days:
        return Check("model", WARN, f"{path} trained {age:.0f} days ago (limit {max_age_days:g})",
                     "the nightly retrain is not running: check `systemctl status slurmgpu-nightly.timer`")
    return Check("model", OK, f"{path} loads, trained {age:.1f} days ago")


def check_daemon(path: str, timeout: float = 2.0) -> Check:
    """The prediction daemon answers ``{"op":"health"}`` on its Unix socket with ``{"ok": true}``."""
    if not os.path.exists(path):
        return Check("daemon", WARN, f"not installed (no socket at {path})",
                     "optional: without it gsbatch decides in-process, which is slower")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(b'{"op":"health"}\n')
            reply = sock.makefile("rb").readline(65536)
    except PermissionError:
        return Check("daemon", FAIL, f"{path}: permission denied", _socket_access_advice(path))
    except TimeoutError:
        return Check("daemon", FAIL, f"{path}: no answer within {timeout:g} s", "restart the slurmgpu daemon")
    except OSError as exc:
        return Check("daemon", FAIL, f"{path}: {exc.strerror or exc}",
                     "the daemon is not running (stale socket): start it")
    try:
        answer = json.loads(reply)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        shown = reply.decode("utf-8", "replace").strip()[:120] or "nothing"
        return Check("daemon", FAIL, f"unhealthy answer: {shown}", "check the daemon's log and restart it")
    return Check("daemon", OK, f"answering on {path}")


def _socket_access_advice(path: str) -> str:
    """Who may connect is the socket's group (slurmgpu serve --group); it never becomes world-writable."""
    import grp

    try:
        gid = os.stat(path).st_gid
        group = grp.getgrgid(gid).gr_name
    except (OSError, KeyError):
        group = "the socket's group"
    return (f"add the users who run gsbatch to group {group} (or restart `slurmgpu serve --group GROUP` with "
            "the group the admin names); keep the socket owner/group only (0660), never 0666")


def _scontrol_config(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def check_lua_hook(run: Callable[[list[str]], str]) -> Check:
    """slurmctld runs the job_submit.lua hook that sends plain sbatch jobs through slurmgpu."""
    try:
        conf = _scontrol_config(run(["scontrol", "show", "config"]))
    except Exception as exc:  # noqa: BLE001 - scontrol missing or slurmctld down
        return Check("lua hook", WARN, f"cannot read the Slurm config: {exc}", "check that scontrol works on this host")
    plugins = conf.get("JobSubmitPlugins", "")
    if "lua" not in {p.strip().rsplit("/", 1)[-1] for p in plugins.split(",")}:  # "lua" or "job_submit/lua"
        return Check("lua hook", WARN, f"JobSubmitPlugins = {plugins or '(null)'}: plain sbatch jobs bypass slurmgpu",
                     "set JobSubmitPlugins=lua in slurm.conf and install slurmgpu's job_submit.lua")
    lua = os.path.join(os.path.dirname(conf.get("SLURM_CONF", "/etc/slurm/slurm.conf")), "job_submit.lua")
    try:
        with open(lua, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        return Check("lua hook", FAIL, f"JobSubmitPlugins=lua but {lua}: {exc.strerror}",
                     "install slurmgpu's job_submit.lua there (slurmctld rejects submissions without it)")
    if "slurmgpu" not in text:
        return Check("lua hook", WARN, f"{lua} is not slurmgpu's hook", "install slurmgpu's job_submit.lua")
    return Check("lua hook", OK, f"{lua} installed, JobSubmitPlugins=lua")


def _mentions(pattern: str, word: str) -> bool:
    """Whether a Prolog/Epilog setting (a path or a glob of them, as slurm.conf allows) runs a script
    that names ``word``."""
    import glob

    for path in sorted(glob.glob(pattern)) or [pattern]:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                if word in fh.read(1 << 20):
                    return True
        except OSError:
            continue
    return False


def check_slurm_config(run: Callable[[list[str]], str], config: Config | None) -> list[Check]:
    """What slurmgpu needs of slurm.conf beyond the hook: the collector in Prolog and Epilog (without it
    no GPU record, no GPU peak, no OOM is ever found), sacct keeping job comments, and, with
    ``oom_retry`` on, what retry acts on (the collector's OOM finding, requeue allowed)."""
    try:
        conf = _scontrol_config(run(["scontrol", "show", "config"]))
    except Exception as exc:  # noqa: BLE001 - scontrol missing or slurmctld down
        return [Check("collector", WARN, f"cannot read the Slurm config: {exc}", "check that scontrol works here")]
    missing = [key for key in ("Prolog", "Epilog")
               if conf.get(key, "(null)") == "(null)" or not _mentions(conf[key], "slurmgpu-monitor")]
    retry_on = config is not None and config.policy.oom_retry
    if missing:
        shown = ", ".join(f"{k} = {conf.get(k, '(null)')}" for k in missing)
        collector = Check("collector", FAIL if retry_on else WARN,
                          f"{shown}: slurmgpu-monitor never runs, so no job gets a GPU record (peak memory, OOM)",
                          "install contrib/monitor/prolog.sh and epilog.sh as Prolog/Epilog, PrologFlags=Alloc "
                          "(contrib/monitor/README.md)")
    elif "alloc" not in conf.get("PrologFlags", "").lower():
        collector = Check("collector", WARN, f"PrologFlags = {conf.get('PrologFlags', '(null)')}: the collector "
                                             "starts only with a job's first step", "set PrologFlags=Alloc")
    else:
        collector = Check("collector", OK, f"Prolog and Epilog run slurmgpu-monitor ({conf['Prolog']})")
    flags = {f.strip() for f in conf.get("AccountingStoreFlags", "").split(",")}
    storage = conf.get("AccountingStorageType", "")
    if "slurmdbd" not in storage:
        accounting = Check("accounting", FAIL, f"AccountingStorageType = {storage or '(null)'}: sacct knows no jobs, "
                                               "so the ingest stores none", "set AccountingStorageType="
                                               "accounting_storage/slurmdbd and run slurmdbd")
    elif "job_comment" not in flags:
        accounting = Check("accounting", WARN, f"AccountingStoreFlags = {conf.get('AccountingStoreFlags') or '(null)'}"
                                               ": sacct drops every job's Comment (users' and slurmgpu retry's notes)",
                           "add job_comment to AccountingStoreFlags in slurm.conf")
    else:
        accounting = Check("accounting", OK, "slurmdbd keeps jobs and their comments (job_comment)")
    checks = [collector, accounting]
    if retry_on:
        blocked = [why for ok, why in ((not missing, "the collector does not run, so no GPU OOM is ever found"),
                                       (conf.get("JobRequeue", "1") != "0", "JobRequeue=0 forbids requeueing"))
                   if not ok]
        checks.append(Check("retry", FAIL, "oom_retry is on but " + "; ".join(blocked),
                            "fix the lines above, or set [policy] oom_retry = false") if blocked else
                      Check("retry", OK, "oom_retry is on: the collector finds GPU OOMs and requeue is allowed"))
    return checks


# The modes of a site's spools (docs/security.md): users drop submission records the nightly
# account's group reads (setgid) and only its owner removes (sticky); the collector (root) writes GPU records.
SPOOL_MODES = {"submission": 0o3733, "GPU": 0o2770}


def check_spool(name: str, directory: str, now: float, max_age_hours: float = SPOOL_MAX_AGE_HOURS,
                site: bool = False) -> Check:
    """The ingest empties the spool: no record older than the limit, none rejected; a site's spool
    (``site``) is a real directory with the mode of the permission model."""
    label = f"{name} spool"
    want = SPOOL_MODES.get(name)
    if site and want is not None:
        try:
            st = os.lstat(directory)
        except OSError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            return Check(label, FAIL, f"{directory} is not a directory (a symlink or file)",
                         f"make it one: install -d -m {want:o} ... {directory} (docs/security.md)")
        if st is not None and stat.S_IMODE(st.st_mode) != want:
            why = (" (no setgid bit: records are written 0600 and the nightly account cannot read them)"
                   if name == "submission" and not st.st_mode & stat.S_ISGID else "")
            return Check(label, FAIL, f"{directory} has mode {stat.S_IMODE(st.st_mode):o}, not {want:o}{why}",
                         f"chmod {want:o} {directory}, owned as docs/security.md says")
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except FileNotFoundError:
        return Check(label, WARN, f"{directory} does not exist", "nothing was spooled yet, or the path is wrong")
    except PermissionError:
        return Check(label, WARN, f"cannot list {directory} as this user", "run `slurmgpu doctor` as root")
    records = [e for e in entries if e.name.endswith(".json")]
    rejected = [e for e in entries if e.name.endswith(".rejected")]
    ages = []
    for e in records:
        try:
            ages.append(now - e.stat().st_mtime)
        except FileNotFoundError:  # loaded by the ingest meanwhile
            continue
    oldest = max(ages, default=0.0) / 3600.0
    if oldest > max_age_hours:
        return Check(label, FAIL, f"{len(records)} records waiting in {directory}, oldest {oldest:.0f} h",
                     "the nightly ingest is not emptying it: run `slurmgpu ingest` and check the nightly timer")
    if rejected:
        return Check(label, WARN, f"{len(rejected)} rejected records in {directory}",
                     "read `slurmgpu ingest`'s messages about them, then delete the *.rejected files")
    return Check(label, OK, f"{directory}: {len(records)} waiting, oldest {oldest:.1f} h")


def render(checks: Sequence[Check], color: bool = False) -> str:
    """One line per check, its advice indented below when it is not OK."""
    styles = {OK: "\033[32m", WARN: "\033[33m", FAIL: "\033[31m"}
    lines = []
    for c in checks:
        mark = f"{styles[c.status]}{c.status:4}\033[0m" if color else f"{c.status:4}"
        lines.append(f"{mark}  {c.name:16} {c.detail}")
        if c.advice and c.status != OK:
            lines.append(f"      {'':16} -> {c.advice}")
    return "\n".join(lines)


def to_json(checks: Sequence[Check]) -> str:
    return json.dumps({"ok": exit_status(checks) == 0, "checks": [c._asdict() for c in checks]}, indent=2)


def compare_with_cluster(config: Config, nodes: list[Any]) -> list[str]:
    """Differences an admin must fix, one line each with the fix: configured partitions the
    cluster lacks, GPU types a partition's nodes do not hold or hold beyond the config's list (an
    untyped request there may get them), GPUs per node, node counts, GPU types unknown to the
    config, and node features the config reads as a GPU type on nodes without that type (a
    ``--constraint`` would be misread). Empty only when all of these agree."""
    problems: list[str] = []
    live_parts: dict[str, dict[str, int]] = {}
    gpu_nodes: dict[str, int] = {}
    for n in nodes:
        for part in n.partitions:
            offered = live_parts.setdefault(part, {})
            gpu_nodes[part] = gpu_nodes.get(part, 0) + (1 if any(n.gpus.values()) else 0)
            for gtype, count in n.gpus.items():
                offered[gtype] = max(offered.get(gtype, 0), count)
    for p in config.partitions.values():
        live = live_parts.get(p.name)
        if live is None:
            problems.append(f"partition {p.name} is configured but does not exist in the cluster: "
                            f"remove [partitions.{p.name}] or fix its name")
            continue
        held = {t: live[t] for t in p.gpu_types if t in live}
        for gtype in p.gpu_types:
            if gtype not in live:
                problems.append(f"partition {p.name}: GPU type {gtype} is configured but no node offers it: "
                                f"remove it from [partitions.{p.name}].gpu_types")
        for gtype in sorted(live):
            if gtype and gtype in config.gpu_types and gtype not in p.gpu_types:
                problems.append(f"partition {p.name}: its nodes hold {gtype} GPUs, which the config does not list "
                                f"for it: add {gtype!r} to [partitions.{p.name}].gpu_types")
        if held and max(held.values()) != p.gpus_per_node:
            counts = ", ".join(f"{c} {t}" for t, c in sorted(held.items()))
            problems.append(f"partition {p.name}: gpus_per_node = {p.gpus_per_node} but its nodes hold at most "
                            f"{counts} per node: set gpus_per_node = {max(held.values())}")
        if gpu_nodes.get(p.name, 0) != p.nodes:
            problems.append(f"partition {p.name}: nodes = {p.nodes} but it has {gpu_nodes.get(p.name, 0)} GPU "
                            f"node(s): set nodes = {gpu_nodes.get(p.name, 0)}")
    for part, offered in live_parts.items():
        for gtype in offered:
            if gtype and gtype not in config.gpu_types:
                problems.append(f"partition {part}: the cluster offers GPU type {gtype}, unknown to the config: "
                                f"add [gpu_types.{gtype}]")
    for n in nodes:
        for feature in getattr(n, "features", ()):
            gtype = config.type_for_feature(feature)
            if gtype is not None and not n.gpus.get(gtype):
                problems.append(f"node {n.name}: feature {feature} means GPU type {gtype} in the config, but the "
                                f"node holds no {gtype}: remove {feature!r} from [gpu_types.{gtype}].features "
                                f"or from the node's Features")
    return problems


class Names(NamedTuple):
    """The names the cluster knows: partitions from slurmctld; users and accounts from the accounting
    database (None when it could not be asked, with why), since that is where Slurm charges a job."""

    partitions: frozenset[str]
    users: frozenset[str] | None
    accounts: frozenset[str] | None
    unasked: str = ""


def cluster_names(run: Callable[[list[str]], str]) -> Names:
    """Ask sinfo for the partitions and sacctmgr for the users and accounts (a failure of sinfo raises:
    nothing can be compared without slurmctld)."""
    partitions = frozenset(run(["sinfo", "-h", "-o", "%R"]).split())
    try:
        users = frozenset(run(["sacctmgr", "-nP", "show", "user", "format=user"]).split())
        accounts = frozenset(run(["sacctmgr", "-nP", "show", "account", "format=account"]).split())
    except Exception as exc:  # noqa: BLE001 - no slurmdbd: the names go unchecked, and the check says so
        return Names(partitions, None, None, str(exc))
    return Names(partitions, users, accounts)


def _unknown(kind: str, where: str, name: str, known: Iterable[str], source: str) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f": did you mean {close[0]!r}?" if close else f": fix or remove it in {where}"
    return f"{where}: {kind} {name!r} is not known to {source}{hint}"


def name_problems(config: Config, names: Names) -> list[str]:
    """Every partition, user and account the modes and waivers name that the cluster does not know
    (a misspelt name silently matches no job, so its mode or waiver never applies)."""
    problems = [_unknown("partition", "[policy.modes] partitions", p, names.partitions, "Slurm (sinfo)")
                for p in config.modes.partitions if p not in names.partitions]
    for kind, known, entries in (
            ("user", names.users, [("[policy.modes] users", n) for n in config.modes.users]
             + [(f"waivers[{i}].user", w.user) for i, w in enumerate(config.waivers) if w.user]),
            ("account", names.accounts, [("[policy.modes] accounts", n) for n in config.modes.accounts]
             + [(f"waivers[{i}].account", w.account) for i, w in enumerate(config.waivers) if w.account])):
        if known is not None:
            problems += [_unknown(kind, where, name, known, "the accounting database (sacctmgr)")
                         for where, name in entries if name not in known]
    return problems


def expired_waivers(config: Config, today: date) -> list[str]:
    """Waivers past their day: harmless (they no longer apply) but no longer what the file says."""
    return [f"waivers[{i}] ({w.user or w.account}, family {w.family}) expired on {w.expires.isoformat()}: "
            "it no longer applies; remove it or extend expires" for i, w in enumerate(config.waivers)
            if w.expires < today]
