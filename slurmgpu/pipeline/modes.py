"""Advise or rewrite, and admin-granted waivers: whether a decision is applied to a job.

One module (standard library only) answers the question for gsbatch, ``slurmgpu serve`` and,
rendered into it by ``slurmgpu lua render``, the job_submit.lua hook:

- **Mode.** ``rewrite`` applies the decision (the default, and what slurmgpu always did);
  ``advise`` computes and records it, tells the user what they would have gained, and submits
  the job exactly as written. The mode comes from the most specific entry of the admin config:
  ``[policy.modes] users`` over ``accounts`` over ``partitions`` over ``[policy] mode``. A job
  asking for several partitions (``-p a,b``) takes the first of them that has an entry; a job
  naming none is in the config's default partition.
- **Waivers.** ``[[waivers]]`` let a user's or an account's jobs of one family (the 12-hex-digit
  ``family`` key that ``slurmgpu parse --json`` prints: a hash of the main command with numbers
  and paths taken out) keep their request until a date; the request then stands with the reason
  ``waiver: REASON (granted by OWNER, until DATE)``. A waiver applies through its ``expires`` day
  (the local date) and stops by itself afterwards: ``today`` is an argument, so tests freeze it.

Nothing here reads the environment: what a user can set never changes the mode or the waivers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from slurmgpu.typing_lite import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from datetime import date
    from typing import Any

REWRITE, ADVISE = "rewrite", "advise"
MODES = (REWRITE, ADVISE)
FAMILY = r"^[0-9a-f]{12}$"  # a waiver's family key; compiled on first use (re caches it), most sites have none


class Modes(NamedTuple):
    """The config's modes: the global one and per user, account and partition entries."""

    default: str = REWRITE
    partitions: Mapping[str, str] = {}
    accounts: Mapping[str, str] = {}
    users: Mapping[str, str] = {}

    @property
    def trivial(self) -> bool:
        """Every job is rewritten: nothing to resolve."""
        return self.default == REWRITE and not (self.partitions or self.accounts or self.users)


class Waiver(NamedTuple):
    """A user's or an account's jobs of one family keep their request until ``expires`` (inclusive)."""

    family: str
    reason: str
    owner: str
    expires: date
    user: str | None = None
    account: str | None = None

    def text(self) -> str:
        return f"waiver: {self.reason} (granted by {self.owner}, until {self.expires.isoformat()})"

    def active(self, today: date) -> bool:
        return today <= self.expires

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "account": self.account, "family": self.family, "reason": self.reason,
                "owner": self.owner, "expires": self.expires.isoformat()}


class Resolution(NamedTuple):
    """What happens to one job's decision: its mode, which entry set it, and a waiver if one holds."""

    mode: str = REWRITE
    source: str = "default"  # "user NAME", "account NAME", "partition NAME" or "default"
    waiver: Waiver | None = None


def resolve_mode(modes: Modes, user: str | None, account: str | None, partition: str | None,
                 default_partition: str | None = None) -> tuple[str, str]:
    """(mode, source): user over account over partition over the global mode."""
    if user is not None and user in modes.users:
        return modes.users[user], f"user {user}"
    if account is not None and account in modes.accounts:
        return modes.accounts[account], f"account {account}"
    names = [p for p in (partition or "").split(",") if p] or ([default_partition] if default_partition else [])
    for name in names:
        if name in modes.partitions:
            return modes.partitions[name], f"partition {name}"
    return modes.default, "default"


def find_waiver(waivers: Sequence[Waiver], user: str | None, account: str | None, family: str | None,
                today: date) -> Waiver | None:
    """The first active waiver for this user or account and family, else None."""
    if not family:
        return None
    for w in waivers:
        if w.family != family or not w.active(today):
            continue
        if (w.user is not None and w.user == user) or (w.account is not None and w.account == account):
            return w
    return None


def resolve(modes: Modes, waivers: Sequence[Waiver], *, user: str | None, account: str | None,
            partition: str | None, family: str | None, default_partition: str | None = None,
            today: date | None = None) -> Resolution:
    mode, source = resolve_mode(modes, user, account, partition, default_partition)
    if today is None and waivers:
        from datetime import date

        today = date.today()
    waiver = find_waiver(waivers, user, account, family, today) if today is not None else None
    return Resolution(mode, source, waiver)


def needs_account(modes: Modes, waivers: Sequence[Waiver]) -> bool:
    """Whether the job's account matters (a per-account mode or waiver exists)."""
    return bool(modes.accounts) or any(w.account is not None for w in waivers)


# --- applying a resolution to a plan (the JSON form gsbatch submits from) ---------------------


def waived(decision: Mapping[str, Any], waiver: Waiver) -> dict[str, Any]:
    """The decision with the waiver in place: no change, the waiver as the reason, and what
    would have changed kept under ``waived``."""
    out = dict(decision)
    out.update(changes=[], changed=False, reasons=[waiver.text()], waiver=waiver.to_json(),
               waived=list(decision.get("changes") or []))
    return out


def advised(decision: Mapping[str, Any], resolution: Resolution) -> dict[str, Any]:
    """The decision marked as advice: its changes are what would have changed, none applied."""
    out = dict(decision)
    out.update(mode=ADVISE, mode_source=resolution.source, advised=bool(decision.get("changes")))
    return out


def apply_resolution(plan: Mapping[str, Any], resolution: Resolution, options: Sequence[str]) -> dict[str, Any]:
    """The plan (``Plan.to_json`` form) as the resolution wants it submitted: a waiver or advise
    mode puts the submission back as written (``options``: sbatch's words as the user gave them)
    and says so in the decision and the record; rewrite mode leaves it as it is. A decision that
    carries out the user's own ask (``asked``: ``--gpu-mem``) is submitted in every mode."""
    decision = plan["decision"]
    if decision.get("asked"):
        return dict(plan)
    if decision.get("refused") is not None or not decision.get("changes"):
        if resolution.mode == ADVISE:
            return _with(plan, advised(decision, resolution), plan["submission"])
        return dict(plan)
    if resolution.waiver is not None:
        new = waived(decision, resolution.waiver)
        if resolution.mode == ADVISE:
            new = advised(new, resolution)
    elif resolution.mode == ADVISE:
        new = advised(decision, resolution)
    else:
        return dict(plan)
    as_written: dict[str, Any] = {"script_text": None, "cli_words": list(options), "env_overrides": {},
                                  "changed": False}
    return _with(plan, new, as_written)


def _with(plan: Mapping[str, Any], decision: dict[str, Any], submission: Mapping[str, Any]) -> dict[str, Any]:
    """Advice or a waiver: submitted as written, without the decision tag (the record keeps the
    decision)."""
    out = dict(plan, decision=decision, submission=dict(submission))
    out.pop("tag", None)
    record = plan.get("record")
    if isinstance(record, dict):
        kept: dict[str, Any] = record["decision"] if isinstance(record.get("decision"), dict) else {}
        out["record"] = dict(record, decision={**kept, **decision}, changed=bool(submission.get("changed")))
    return out


# --- telling the user ---------------------------------------------------------------------------


def _minutes(seconds: float) -> str:
    minutes = seconds / 60
    return f"~{minutes / 60:.1f} h" if minutes >= 120 else f"~{max(minutes, 1):.0f} min"


def advice_line(original: Mapping[str, Any] | None, decision: Mapping[str, Any]) -> str:
    """One line on what the decision would have given: the decided shape, and when the decider
    recorded its numbers, its expected finish (queue wait + runtime) against the request's."""
    original = original or {}
    changes = [c for c in decision.get("changes") or [] if c.get("index", 0) == 0]
    change = changes[0] if changes else {}
    o_type, o_gpus = original.get("gpu_type"), original.get("gpus_total")
    d_type, d_gpus = change.get("gpu_type") or o_type, change.get("gpus_total") or o_gpus
    shape = f"{d_gpus if d_gpus is not None else '?'} x {d_type or 'any GPU'}"
    where = f" in partition {change['partition']}" if change.get("partition") else ""
    if isinstance(change.get("time_limit_s"), int):
        from slurmgpu.pipeline.request import format_time  # the request module gsbatch has read the job with

        where += f" with a time limit of {format_time(change['time_limit_s'])}"
    asked = f"{o_gpus if o_gpus is not None else '?'} x {o_type or 'any GPU'}"
    reasons = [str(r) for r in decision.get("reasons") or []]
    was = f" in partition {original['partition']}" if where and original.get("partition") else ""
    if decision.get("unrunnable"):  # no finish time to compare with: the job as written never starts
        lead = str(decision["unrunnable"])
        said = reasons if any(r.startswith(lead) for r in reasons) else [lead, *reasons]
        return (f"as written the job cannot run: {'; '.join(said)} ({shape}{where} instead of {asked}{was}); "
                "submitted as written")
    rules = "".join(f"; {r}" for r in reasons[:-1])  # the rules' reasons: the model's own comes last
    per_type = [c for c in decision.get("per_type") or [] if isinstance(c, dict)]
    mine = [c for c in per_type if c.get("gpus") == o_gpus and (o_type is None or c.get("gpu_type") == o_type)]
    theirs = [c for c in per_type if c.get("gpus") == d_gpus and c.get("gpu_type") == d_type]
    try:
        base = min(mine, key=lambda c: float(c["expected_wait_s"]) + float(c["pred_runtime_s"]))
        new = theirs[0]
        t_base = float(base["expected_wait_s"]) + float(base["pred_runtime_s"])
        t_new = float(new["expected_wait_s"]) + float(new["pred_runtime_s"])
    except (ValueError, KeyError, TypeError, IndexError):
        why = f" ({reasons[-1]})" if reasons else ""
        return f"{shape}{where} instead of {asked}{was}{why}; submitted as written"
    if t_base > 0 and t_new < t_base:
        gain = f" ({(t_base - t_new) / t_base:.0%} sooner)"
    elif t_new > t_base:
        gain = " (later, on cheaper or fewer GPUs)"
    else:
        gain = ""
    return (f"{shape}{where} would finish in {_minutes(t_new)} vs {_minutes(t_base)} as asked{gain}{rules}; "
            "submitted as written")
