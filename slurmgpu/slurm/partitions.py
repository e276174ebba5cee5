"""Slurm's partition access rules, from ``scontrol show partition -o``, and whether one admits a job.

slurmgpu may move a job to another partition (a GPU type lives elsewhere). Slurm checks the
new partition's rules at submission; a move the rules forbid turns a job plain Slurm would have
accepted into a refused one. ``PartitionRules.admits`` answers, before any move, whether
Slurm would take the job there: State, AllowGroups, AllowAccounts/DenyAccounts,
AllowQos/DenyQos, MaxTime, MaxNodes, RootOnly, DisableRootJobs and the job's node list.

What cannot be known is refused, never guessed: a job without an account (Slurm would use the
user's default account, which only slurmdbd knows) is admitted only where every account is, and
likewise for the QOS and a user whose groups cannot be looked up.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping
from typing import NamedTuple

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class PartitionRules(NamedTuple):
    """One partition's rules; ``None`` in an allow list means ALL, an empty deny list none."""

    name: str
    state: str = "UP"
    allow_groups: frozenset[str] | None = None
    allow_accounts: frozenset[str] | None = None
    deny_accounts: frozenset[str] = frozenset()
    allow_qos: frozenset[str] | None = None
    deny_qos: frozenset[str] = frozenset()
    max_time_min: int | None = None  # None: UNLIMITED
    max_nodes: int | None = None
    nodes: frozenset[str] | None = None  # None: the node list could not be expanded
    root_only: bool = False
    disable_root_jobs: bool = False
    default_time_min: int | None = None  # None: NONE (a job writing no limit gets MaxTime)

    @property
    def given_time_min(self) -> int | None:
        """The time limit Slurm gives a job that writes none here: DefaultTime, else MaxTime (None:
        unlimited)."""
        return self.default_time_min if self.default_time_min is not None else self.max_time_min

    def refusal(self, job: JobAccess) -> str | None:
        """Why Slurm would refuse ``job`` in this partition, or None when it admits it."""
        if self.state != "UP":
            return f"partition {self.name} is {self.state}"
        if self.root_only and job.uid != 0:
            return f"partition {self.name} is RootOnly"
        if self.disable_root_jobs and job.uid == 0:
            return f"partition {self.name} disables root jobs"
        if self.allow_groups is not None:
            if job.groups is None:
                return f"partition {self.name} restricts groups and the user's are unknown"
            if not self.allow_groups & job.groups:
                return f"user not in AllowGroups of partition {self.name}"
        for label, plural, value, allow, deny, field in (
                ("account", "accounts", job.account, self.allow_accounts, self.deny_accounts, "Accounts"),
                ("QOS", "QOS", job.qos, self.allow_qos, self.deny_qos, "Qos")):
            if allow is None and not deny:
                continue
            if value is None:
                return f"partition {self.name} restricts {plural} and the job names none"
            if allow is not None and value not in allow:
                return f"{label} {value} not in Allow{field} of partition {self.name}"
            if value in deny:
                return f"{label} {value} in Deny{field} of partition {self.name}"
        if job.time_limit_min is not None and self.max_time_min is not None and job.time_limit_min > self.max_time_min:
            return f"time limit {job.time_limit_min} min exceeds MaxTime {self.max_time_min} min of {self.name}"
        if job.min_nodes is not None and self.max_nodes is not None and job.min_nodes > self.max_nodes:
            return f"{job.min_nodes} nodes exceed MaxNodes {self.max_nodes} of partition {self.name}"
        if job.nodelist:
            if self.nodes is None:
                return f"the job names nodes and partition {self.name}'s node list could not be read"
            missing = sorted(set(job.nodelist) - self.nodes)
            if missing:
                return f"node {missing[0]} is not in partition {self.name}"
        return None

    def admits(self, job: JobAccess) -> bool:
        return self.refusal(job) is None


class JobAccess(NamedTuple):
    """What the rules are checked against: who submits, under which account and QOS, for how long.

    ``groups`` are the user's group names (primary included), None when unknown; ``nodelist``
    the expanded nodes the job names (``--nodelist``), empty when it names none.
    """

    uid: int | None = None
    groups: frozenset[str] | None = None
    account: str | None = None
    qos: str | None = None
    time_limit_min: int | None = None
    min_nodes: int | None = None
    nodelist: tuple[str, ...] = ()


def parse_time_min(text: str) -> int | None:
    """Slurm's ``[days-]hours:minutes:seconds`` (or minutes, or ``minutes:seconds``) in whole
    minutes, rounded up; None for UNLIMITED/INFINITE; ValueError for anything else."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"unreadable time {text!r}")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # d-h[:m[:s]]
        seconds = days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # h:m:s
        seconds = (a or 0) * 3600 + (b or 0) * 60 + c
    elif b is not None:  # m:s
        seconds = (a or 0) * 60 + b
    else:  # m
        seconds = (a or 0) * 60
    return -(-seconds // 60)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist expression to names: ``gpu[01-03,7],cpu1`` -> gpu01 gpu02 gpu03 gpu7 cpu1.
    Several bracket groups in one name are expanded too; ValueError for a malformed one."""
    names: list[str] = []
    for item in _split_top(text):
        names.extend(_expand_one(item))
    return names


def _split_top(text: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    out.append(text[start:])
    return [o for o in (s.strip() for s in out) if o]


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in {item!r}")
        width = len(low)
        end = int(high) if high else int(low)
        if end < int(low) or end - int(low) > 100000:
            raise ValueError(f"bad range {part!r} in {item!r}")
        for n in range(int(low), end + 1):
            out.extend(prefix + str(n).zfill(width) + tail for tail in _expand_one(rest))
    return out


def _names(value: str | None) -> frozenset[str] | None:
    """An allow list: None for ALL (or absent), else the names."""
    if value is None or value.upper() == "ALL":
        return None
    return frozenset(v for v in value.split(",") if v)


def _count(value: str | None) -> int | None:
    if value is None or value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    return int(value)


def parse_partition_line(line: str) -> PartitionRules:
    """One line of ``scontrol show partition -o`` (Key=Value words; values hold no spaces)."""
    fields: dict[str, str] = {}
    for word in line.split():
        key, eq, value = word.partition("=")
        if eq and key not in fields:
            fields[key] = value
    name = fields.get("PartitionName")
    if not name:
        raise ValueError(f"no PartitionName in {line[:80]!r}")
    try:
        nodes: frozenset[str] | None = frozenset(expand_hostlist(fields.get("Nodes", "")))
        if fields.get("Nodes", "").upper() == "ALL":
            nodes = None
    except ValueError:
        nodes = None
    max_time = fields.get("MaxTime", "UNLIMITED")
    return PartitionRules(
        name=name,
        state=fields.get("State", "UP").upper(),
        allow_groups=_names(fields.get("AllowGroups")),
        allow_accounts=_names(fields.get("AllowAccounts")),
        deny_accounts=_names(fields.get("DenyAccounts")) or frozenset(),
        allow_qos=_names(fields.get("AllowQos")),
        deny_qos=_names(fields.get("DenyQos")) or frozenset(),
        max_time_min=parse_time_min(max_time),
        max_nodes=_count(fields.get("MaxNodes")),
        nodes=nodes,
        root_only=fields.get("RootOnly", "NO").upper() == "YES",
        disable_root_jobs=fields.get("DisableRootJobs", "NO").upper() == "YES",
        default_time_min=None if fields.get("DefaultTime", "NONE").upper() == "NONE"
        else parse_time_min(fields["DefaultTime"]),
    )


def parse_partitions(text: str) -> dict[str, PartitionRules]:
    """Every partition of ``scontrol show partition -o`` output; ValueError for a line it cannot read."""
    rules = [parse_partition_line(line) for line in text.splitlines() if line.strip()]
    return {r.name: r for r in rules}


def read_partitions(scontrol: str = "scontrol", timeout: float = 10.0) -> dict[str, PartitionRules]:
    """The cluster's partitions now (runs ``scontrol show partition -o``); OSError/ValueError when
    it cannot be asked or answers nonsense. Never call it while slurmctld waits on the caller."""
    return parse_partitions(show_partitions(scontrol, timeout))


def show_partitions(scontrol: str = "scontrol", timeout: float = 10.0) -> str:
    """What ``scontrol show partition -o`` prints; OSError when it cannot be asked."""
    try:
        res = subprocess.run([scontrol, "show", "partition", "-o"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"{scontrol} show partition timed out") from exc
    if res.returncode != 0:
        raise OSError(f"{scontrol} show partition: {res.stderr.strip() or f'exit {res.returncode}'}")
    return res.stdout


def user_groups(user: str | None, uid: int | None) -> frozenset[str] | None:
    """The group names of a user (primary included), from the name or uid; None when unknown."""
    import grp
    import os
    import pwd

    try:
        pw = pwd.getpwnam(user) if user else pwd.getpwuid(uid) if uid is not None else None
    except (KeyError, OverflowError):
        return None
    if pw is None:
        return None
    names = set()
    for gid in os.getgrouplist(pw.pw_name, pw.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return frozenset(names)


def admitting(rules: Mapping[str, PartitionRules], names: Iterable[str], job: JobAccess) -> list[str]:
    """Those of ``names`` whose rules admit the job (a partition Slurm does not list admits nothing)."""
    return [n for n in names if n in rules and rules[n].admits(job)]


def nodelist_of(value: str | None) -> tuple[str, ...]:
    """A job's ``--nodelist`` value expanded; ValueError when malformed (a file name is not read)."""
    if not value:
        return ()
    if "/" in value:
        raise ValueError("a node list read from a file")
    return tuple(expand_hostlist(value))

