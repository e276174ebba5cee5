"""The GPU usage report: what was allocated, what was used, and what slurmgpu changed.

Numbers come from the history store: jobs with GPUs that ended in the window, the collector's
measurements (else sacct's gres/gpumem and gres/gpuutil) and gsbatch's submission records.
Estimates are named as such in ``DEFINITIONS``, which every output format carries, so that an
admin can tell a measurement from a guess.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.engine import Engine

from slurmgpu.history.db import GpuUsage, Job, Submission
from slurmgpu.pipeline.config import Config

IDLE_UTIL_PCT = 5.0  # a job whose GPUs never got busier than this did no real GPU work
IDLE_PEAK_MIB = 256.0  # less than a CUDA context takes: the job never opened its GPUs
UNTYPED = "untyped"
OOM_STATE = "OUT_OF_MEMORY"

DEFINITIONS = {
    "window": "jobs with GPUs whose end time falls in [since, until), UTC; running jobs are not counted yet",
    "gpu_hours": "allocated GPUs x elapsed time",
    "measured": "a job is measured when the collector (else sacct's gres/gpumem) recorded its per-GPU peak memory",
    "mem_used_share": "per-GPU peak memory / the card's memory (config gpu_types), capped at 1, "
                      "weighted by GPU-hours over measured jobs",
    "mem_asked_gib / mem_used_gib": "GPU-hour-weighted mean card memory and peak memory per GPU over measured jobs",
    "idle_gpu_hours": f"GPU-hours of jobs whose max GPU utilisation stayed below {IDLE_UTIL_PCT:g}% or whose "
                      f"peak memory stayed below {IDLE_PEAK_MIB:g} MiB (less than a CUDA context)",
    "gpus_asked / gpus_busy": f"over jobs with per-GPU collector figures: GPUs allocated, and those that reached "
                              f"{IDLE_UTIL_PCT:g}% utilisation",
    "ooms": f"jobs that ended {OOM_STATE}",
    "changed": "jobs whose gsbatch submission record says slurmgpu changed the request",
    "gpu_hours_saved": "estimate: (GPUs originally requested - GPUs decided) x the job's elapsed time; a change of "
                       "GPU type alone saves none (the run time on the original type is unknown)",
    "queue_hours_saved": "estimate: the decider's expected queue wait for the original request minus that for the "
                         "decision, from the per-type numbers it recorded; empty where it recorded none",
    "daily": "GPU-hours by the UTC day the job ended",
}


class JobUse(NamedTuple):
    """One GPU job of the window with its measurements and, if gsbatch submitted it, its decision."""

    job_id: str
    user: str
    account: str
    gpu_type: str
    gpu_count: int
    elapsed_s: int
    state: str
    end_time: datetime
    peak_mib: float | None  # per GPU
    max_util: float | None  # percent
    gpus_busy: int | None  # GPUs that reached IDLE_UTIL_PCT; None without per-GPU figures
    original: Mapping[str, Any] | None
    decision: Mapping[str, Any] | None
    changed: bool

    @property
    def gpu_hours(self) -> float:
        return self.gpu_count * self.elapsed_s / 3600.0

    @property
    def idle(self) -> bool:
        return ((self.max_util is not None and self.max_util < IDLE_UTIL_PCT)
                or (self.peak_mib is not None and self.peak_mib < IDLE_PEAK_MIB))


class TypeRow(NamedTuple):
    gpu_type: str
    jobs: int
    gpu_hours: float
    measured_gpu_hours: float
    mem_used_share: float | None
    idle_gpu_hours: float


class UserRow(NamedTuple):
    user: str
    account: str
    jobs: int
    gpu_hours: float
    idle_gpu_hours: float
    mem_asked_gib: float | None
    mem_used_gib: float | None
    mem_used_share: float | None
    gpus_asked: int
    gpus_busy: int
    ooms: int
    changed: int
    gpu_hours_saved: float
    queue_hours_saved: float | None


class ChangeRow(NamedTuple):
    change: str
    jobs: int
    users: int
    gpu_hours_saved: float
    queue_hours_saved: float | None


class Report(NamedTuple):
    since: datetime
    until: datetime
    user: str | None  # the only user the report covers; None: everyone
    types: list[TypeRow]
    users: list[UserRow]
    changes: list[ChangeRow]
    daily: dict[date, dict[str, float]]  # day -> GPU type -> GPU-hours

    def totals(self) -> dict[str, Any]:
        gpu_h = sum(t.gpu_hours for t in self.types)
        measured = sum(t.measured_gpu_hours for t in self.types if t.mem_used_share is not None)
        queue = [u.queue_hours_saved for u in self.users if u.queue_hours_saved is not None]
        return {
            "jobs": sum(t.jobs for t in self.types),
            "gpu_hours": gpu_h,
            "idle_gpu_hours": sum(t.idle_gpu_hours for t in self.types),
            "mem_used_share": (sum(t.measured_gpu_hours * (t.mem_used_share or 0.0) for t in self.types) / measured
                               if measured else None),
            "ooms": sum(u.ooms for u in self.users),
            "changed": sum(u.changed for u in self.users),
            "gpu_hours_saved": sum(u.gpu_hours_saved for u in self.users),
            "queue_hours_saved": sum(queue) if queue else None,
        }


# --- reading the store ------------------------------------------------------------------------


def load_jobs(engine: Engine, since: datetime, until: datetime, user: str | None = None,
              account: str | None = None, cluster: str | None = None) -> list[JobUse]:
    """GPU jobs that ended in [since, until) (naive UTC), with their collector rows and submission.

    Those are matched here rather than joined in SQL: the keys are ids as text on one side and
    numbers on the other, and a cast in the join trips MariaDB's collation rules.
    """
    stmt = (select(Job.cluster, Job.job_id, Job.job_id_raw, Job.array_job_id, Job.het_job_id, Job.user, Job.account,
                   Job.gpu_type, Job.gpu_count, Job.elapsed_s, Job.state, Job.end_time, Job.sacct_gpu_mem_mib,
                   Job.sacct_gpu_util)
            .where(Job.gpu_count > 0, Job.end_time >= since, Job.end_time < until)
            .order_by(Job.end_time, Job.id))
    if user is not None:
        stmt = stmt.where(Job.user == user)
    if account is not None:
        stmt = stmt.where(Job.account == account)
    if cluster is not None:
        stmt = stmt.where(Job.cluster == cluster)
    with engine.connect() as conn:
        jobs = conn.execute(stmt).all()
        usage = _rows_by_id(conn, GpuUsage.__table__, {k for j in jobs for k in _usage_keys(j)})
        subs = _rows_by_id(conn, Submission.__table__, {k for j in jobs for k in _submission_keys(j)})
    return [_job_use(j, [u for k in _usage_keys(j) for u in usage.get(k, ())],
                     next((s for k in _submission_keys(j) for s in subs.get(k, ())), None)) for j in jobs]


def _usage_keys(job: Any) -> tuple[tuple[str, str], ...]:
    """A prolog-started collector may only know an array task's raw id."""
    raw = str(job.job_id_raw) if job.job_id_raw is not None else job.job_id
    return ((job.cluster, job.job_id),) if raw == job.job_id else ((job.cluster, job.job_id), (job.cluster, raw))


def _submission_keys(job: Any) -> tuple[tuple[str, str], ...]:
    """gsbatch records the id sbatch printed: an array's or hetjob's, shared by its tasks/components."""
    shared = job.array_job_id if job.array_job_id is not None else job.het_job_id
    return ((job.cluster, str(shared)),) if shared is not None else ((job.cluster, job.job_id),)


def _rows_by_id(conn: Any, table: Any, keys: set[tuple[str, str]],
                chunk: int = 900) -> dict[tuple[str, str], list[Any]]:
    """Rows of table whose (cluster, job_id) is one of keys, in chunks under every backend's bind limit."""
    ids = sorted({job_id for _, job_id in keys})
    out: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for start in range(0, len(ids), chunk):
        for row in conn.execute(select(table).where(table.c.job_id.in_(ids[start:start + chunk]))):
            if (row.cluster, row.job_id) in keys:
                out[(row.cluster, row.job_id)].append(row)
    return out


def _job_use(job: Any, hosts: list[Any], sub: Any) -> JobUse:
    """One job with its collector rows (one per host) folded: peaks are maxima, busy GPUs a sum."""
    if hosts:
        peak: float | None = max(h.peak_mem_mib for h in hosts)
        utils = [h.max_util for h in hosts if h.max_util is not None]
        util = max(utils) if utils else None
        busy = (sum(1 for h in hosts for g in h.detail if (g.get("max_util") or 0.0) >= IDLE_UTIL_PCT)
                if all(isinstance(h.detail, list) and h.detail for h in hosts) else None)
    else:
        peak, util, busy = job.sacct_gpu_mem_mib, job.sacct_gpu_util, None
    return JobUse(job.job_id, job.user or "?", job.account or "-", job.gpu_type or UNTYPED, job.gpu_count,
                  job.elapsed_s or 0, job.state, job.end_time, peak, util, busy,
                  sub.original_request if sub else None, sub.decision if sub else None, bool(sub and sub.changed))


# --- what slurmgpu changed --------------------------------------------------------------------


def describe_change(original: Mapping[str, Any] | None, decision: Mapping[str, Any] | None) -> str:
    """'a100 -> v100; 4 -> 2 GPUs; partition gpu -> gpu-small', from the recorded request and decision."""
    original = original or {}
    comps = original.get("components") or [original]
    parts = []
    for ch in (decision or {}).get("changes") or []:
        index = ch.get("index", 0)
        was = comps[index] if index < len(comps) else {}
        where = f"component {index}: " if index else ""
        if ch.get("gpu_type"):
            parts.append(f"{where}{was.get('gpu_type') or 'any'} -> {ch['gpu_type']}")
        if ch.get("gpus_total"):
            parts.append(f"{where}{was.get('gpus_total')} -> {ch['gpus_total']} GPUs")
        if ch.get("partition"):
            parts.append(f"{where}partition {was.get('partition') or 'default'} -> {ch['partition']}")
    return "; ".join(parts) or "changed"


def _decided(job: JobUse) -> tuple[str | None, int | None, str | None, int | None]:
    """(original type, original GPUs, decided type, decided GPUs) of component 0."""
    original = job.original or {}
    change = next((c for c in (job.decision or {}).get("changes") or [] if c.get("index", 0) == 0), {})
    o_type, o_gpus = original.get("gpu_type"), original.get("gpus_total")
    return o_type, o_gpus, change.get("gpu_type") or o_type, change.get("gpus_total") or o_gpus


def gpu_hours_saved(job: JobUse) -> float:
    """(GPUs originally requested - GPUs decided) x elapsed: see DEFINITIONS['gpu_hours_saved']."""
    _, o_gpus, _, d_gpus = _decided(job)
    if not job.changed or not o_gpus or not d_gpus:
        return 0.0
    return (o_gpus - d_gpus) * job.elapsed_s / 3600.0


def queue_seconds_saved(job: JobUse) -> float | None:
    """The decider's expected wait as asked minus as decided; None without its per-type numbers.

    'As asked' is the candidate the model decider took as its baseline: the requested count of the
    requested type (any type when untyped) with the soonest expected finish.
    """
    per_type = (job.decision or {}).get("per_type") or []
    o_type, o_gpus, d_type, d_gpus = _decided(job)
    if not job.changed or not per_type or o_gpus is None:
        return None
    asked = [c for c in per_type if c.get("gpus") == o_gpus and (o_type is None or c.get("gpu_type") == o_type)]
    chosen = [c for c in per_type if c.get("gpus") == d_gpus and c.get("gpu_type") == d_type]
    if not asked or not chosen:
        return None
    base = min(asked, key=lambda c: c["expected_wait_s"] + c["pred_runtime_s"])
    return float(base["expected_wait_s"] - chosen[0]["expected_wait_s"])


# --- the summaries ----------------------------------------------------------------------------


def _card_mib(config: Config | None, gpu_type: str) -> float | None:
    t = config.gpu_types.get(gpu_type) if config else None
    return t.memory_gib * 1024.0 if t else None


def _mem(jobs: Iterable[JobUse], config: Config | None) -> tuple[float, float | None, float | None, float | None]:
    """(measured GPU-hours, share used, mean card GiB, mean peak GiB), GPU-hour weighted."""
    hours = share = card = peak = 0.0
    for j in jobs:
        mib = _card_mib(config, j.gpu_type)
        if j.peak_mib is None or mib is None or j.gpu_hours <= 0:
            continue
        hours += j.gpu_hours
        share += j.gpu_hours * min(j.peak_mib / mib, 1.0)
        card += j.gpu_hours * mib / 1024.0
        peak += j.gpu_hours * min(j.peak_mib, mib) / 1024.0
    if not hours:
        return 0.0, None, None, None
    return hours, share / hours, card / hours, peak / hours


def _sum_optional(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _hours(seconds: float | None) -> float | None:
    return None if seconds is None else seconds / 3600.0


def build(jobs: Sequence[JobUse], config: Config | None, since: datetime, until: datetime,
          user: str | None = None) -> Report:
    by_type: dict[str, list[JobUse]] = defaultdict(list)
    by_user: dict[tuple[str, str], list[JobUse]] = defaultdict(list)
    by_change: dict[str, list[JobUse]] = defaultdict(list)
    daily: dict[date, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for j in jobs:
        by_type[j.gpu_type].append(j)
        by_user[(j.user, j.account)].append(j)
        if j.changed:
            by_change[describe_change(j.original, j.decision)].append(j)
        daily[j.end_time.date()][j.gpu_type] += j.gpu_hours
    types = []
    for name, group in by_type.items():
        measured, share, _, _ = _mem(group, config)
        types.append(TypeRow(name, len(group), sum(j.gpu_hours for j in group), measured, share,
                             sum(j.gpu_hours for j in group if j.idle)))
    users = []
    for (name, account), group in by_user.items():
        _, share, asked, used = _mem(group, config)
        detailed = [j for j in group if j.gpus_busy is not None]
        changed = [j for j in group if j.changed]
        users.append(UserRow(name, account, len(group), sum(j.gpu_hours for j in group),
                             sum(j.gpu_hours for j in group if j.idle), asked, used, share,
                             sum(j.gpu_count for j in detailed), sum(j.gpus_busy or 0 for j in detailed),
                             sum(1 for j in group if j.state == OOM_STATE), len(changed),
                             sum(gpu_hours_saved(j) for j in changed),
                             _hours(_sum_optional(queue_seconds_saved(j) for j in changed))))
    changes = [ChangeRow(what, len(group), len({j.user for j in group}), sum(gpu_hours_saved(j) for j in group),
                         _hours(_sum_optional(queue_seconds_saved(j) for j in group)))
               for what, group in by_change.items()]
    return Report(since, until, user, sorted(types, key=lambda t: -t.gpu_hours),
                  sorted(users, key=lambda u: (-u.gpu_hours, u.user, u.account)),
                  sorted(changes, key=lambda c: (-c.jobs, c.change)),
                  {d: dict(v) for d, v in sorted(daily.items())})


# --- output formats ---------------------------------------------------------------------------


def _iso(t: datetime) -> str:
    return t.isoformat(timespec="seconds") + "Z"


def _rounded(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def to_json(report: Report) -> str:
    return json.dumps({
        "window": {"since": _iso(report.since), "until": _iso(report.until)},
        "user": report.user,
        "totals": _rounded(report.totals()),
        "gpu_types": [_rounded(t._asdict()) for t in report.types],
        "users": [_rounded(u._asdict()) for u in report.users],
        "changes": [_rounded(c._asdict()) for c in report.changes],
        "daily": [{"date": d.isoformat(), "gpu_type": t, "gpu_hours": round(h, 4)}
                  for d, per in report.daily.items() for t, h in sorted(per.items())],
        "definitions": DEFINITIONS,
    }, indent=2)


CSV_COLUMNS = ("section", "gpu_type", "user", "account", "change", *(
    f for f in (*TypeRow._fields, *UserRow._fields, *ChangeRow._fields)
    if f not in ("gpu_type", "user", "account", "change")))


def to_csv(report: Report) -> str:
    """One CSV: a ``section`` column (gpu_type, user, change) and the union of the sections' columns."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(dict.fromkeys(CSV_COLUMNS)), lineterminator="\n")
    writer.writeheader()
    for section, rows in (("gpu_type", report.types), ("user", report.users), ("change", report.changes)):
        for row in rows:
            writer.writerow({"section": section, **{k: "" if v is None else v for k, v in _rounded(row._asdict())
                                                    .items()}})
    return out.getvalue()


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ratio(used: int, asked: int) -> str:
    return f"{used}/{asked}" if asked else "-"


TEXT_COLUMNS = {"GPU type", "user", "account", "change"}


def table_rows(report: Report) -> dict[str, tuple[tuple[str, ...], list[tuple[str, ...]]]]:
    """The three tables as display strings: shared by the terminal and the HTML page."""
    return {
        "GPU types": (("GPU type", "jobs", "GPU-h", "idle GPU-h", "measured GPU-h", "memory used"), [
            (t.gpu_type, str(t.jobs), _num(t.gpu_hours), _num(t.idle_gpu_hours), _num(t.measured_gpu_hours),
             _pct(t.mem_used_share)) for t in report.types]),
        "Users and accounts": (("user", "account", "jobs", "GPU-h", "idle GPU-h", "GiB/GPU asked", "GiB/GPU used",
                                "memory used", "GPUs busy/asked", "OOMs", "changed", "GPU-h saved",
                                "queue h saved"), [
            (u.user, u.account, str(u.jobs), _num(u.gpu_hours), _num(u.idle_gpu_hours), _num(u.mem_asked_gib),
             _num(u.mem_used_gib), _pct(u.mem_used_share), _ratio(u.gpus_busy, u.gpus_asked), str(u.ooms),
             str(u.changed), _num(u.gpu_hours_saved), _num(u.queue_hours_saved)) for u in report.users]),
        "Changes by slurmgpu": (("change", "jobs", "users", "GPU-h saved", "queue h saved"), [
            (c.change, str(c.jobs), str(c.users), _num(c.gpu_hours_saved), _num(c.queue_hours_saved))
            for c in report.changes]),
    }


def headline(report: Report) -> str:
    t = report.totals()
    scope = f"user {report.user}" if report.user else "all users"
    return (f"{_iso(report.since)} .. {_iso(report.until)}, {scope}: {t['jobs']} GPU jobs, "
            f"{_num(t['gpu_hours'])} GPU-h ({_num(t['idle_gpu_hours'])} idle), memory used "
            f"{_pct(t['mem_used_share'])}, {t['ooms']} OOMs, {t['changed']} changed by slurmgpu "
            f"({_num(t['gpu_hours_saved'])} GPU-h saved)")


def print_tables(report: Report, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text as RichText

    console.print(RichText(headline(report)))
    for title, (header, rows) in table_rows(report).items():
        table = Table(title=title)
        for name in header:
            table.add_column(name, justify="left" if name in TEXT_COLUMNS else "right")
        for row in rows:
            table.add_row(*(RichText(cell) for cell in row))  # names are data, never rich markup
        console.print(table)


# --- the HTML page ----------------------------------------------------------------------------

PALETTE = ("#3b6fb6", "#e08a2c", "#3c9a5f", "#c2443d", "#7c5fb0", "#8a6a4f", "#d377b4", "#6f7782")
IDLE_COLOR = "#c8cdd4"
USER_COLOR = "#52637f"


class Rect(NamedTuple):
    x: float
    y: float
    w: float
    h: float
    color: str
    tip: str


class Text(NamedTuple):
    x: float
    y: float
    text: str
    anchor: str = "start"
    css: str = ""


class Chart(NamedTuple):
    """An SVG chart as plain shapes; the template draws them, escaping every label."""

    title: str
    width: int
    height: int
    rects: list[Rect]
    texts: list[Text]
    grid: list[tuple[float, float, float, float]]
    legend: list[tuple[str, str]]


def bar_chart(title: str, rows: Sequence[tuple[str, Sequence[tuple[float, str, str]]]], unit: str,
              legend: list[tuple[str, str]]) -> Chart:
    """Horizontal stacked bars: one row per label, segments of (value, colour, tooltip)."""
    width, left, right, row_h = 560, 150, 80, 26
    height = 10 + row_h * max(len(rows), 1)
    top = max((sum(v for v, _, _ in segs) for _, segs in rows), default=0.0) or 1.0
    scale = (width - left - right) / top
    rects, texts = [], []
    for i, (label, segs) in enumerate(rows):
        y, x = 8 + i * row_h, float(left)
        texts.append(Text(left - 8, y + 15, label[:22], "end"))
        for value, color, tip in segs:
            rects.append(Rect(x, y, max(value * scale, 0.0), row_h - 8, color, tip))
            x += max(value * scale, 0.0)
        texts.append(Text(x + 6, y + 15, f"{sum(v for v, _, _ in segs):,.0f} {unit}", css="value"))
    return Chart(title, width, height, rects, texts, [], legend)


def _axis(value: float) -> tuple[float, int]:
    """A round step (1, 2, 2.5 or 5 x 10^k) and at most 5 of them reaching value: the y axis."""
    if value <= 0:
        return 1.0, 4
    magnitude = 10 ** math.floor(math.log10(value / 5))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude * 5 >= value)
    return step, math.ceil(value / step - 1e-9)


def daily_chart(report: Report, colors: Mapping[str, str]) -> Chart:
    """GPU-hours per day, stacked by GPU type, every day of the window shown."""
    first, last = report.since.date(), (report.until - timedelta(microseconds=1)).date()
    days = [first + timedelta(days=i) for i in range((last - first).days + 1)]
    width, left, bottom, height = 1100, 60, 30, 280
    plot_h = height - bottom - 12
    tick, ticks = _axis(max((sum(report.daily.get(d, {}).values()) for d in days), default=0.0))
    top = tick * ticks
    step = (width - left - 10) / len(days)
    rects, texts, grid = [], [], []
    for k in range(ticks + 1):
        value, y = tick * k, 12 + plot_h - plot_h * k / ticks
        grid.append((left, y, width - 10, y))
        texts.append(Text(left - 6, y + 4, f"{value:,.0f}", "end", "axis"))
    label_every = max(1, len(days) // 10)
    for i, d in enumerate(days):
        x, y = left + i * step, 12 + plot_h
        for gtype, hours in sorted(report.daily.get(d, {}).items()):
            h = hours / top * plot_h
            y -= h
            rects.append(Rect(x + step * 0.1, y, step * 0.8, h, colors[gtype], f"{d}: {hours:,.1f} GPU-h {gtype}"))
        if i % label_every == 0:
            texts.append(Text(x + step / 2, height - 10, d.strftime("%b %d"), "middle", "axis"))
    return Chart("GPU-hours per day by GPU type", width, height, rects, texts, grid,
                 [(t, colors[t]) for t in sorted(colors)])


def charts(report: Report) -> list[Chart]:
    colors = {t.gpu_type: PALETTE[i % len(PALETTE)] for i, t in enumerate(report.types)}
    per_type = [(t.gpu_type, [(t.gpu_hours - t.idle_gpu_hours, colors[t.gpu_type], f"{t.gpu_type}: busy"),
                              (t.idle_gpu_hours, IDLE_COLOR, f"{t.gpu_type}: idle")]) for t in report.types]
    top_users = [(f"{u.user} ({u.account})", [(u.gpu_hours - u.idle_gpu_hours, USER_COLOR, f"{u.user}: busy"),
                                              (u.idle_gpu_hours, IDLE_COLOR, f"{u.user}: idle")])
                 for u in report.users[:12]]
    idle_legend = [("busy", USER_COLOR), ("idle", IDLE_COLOR)]
    return [daily_chart(report, colors),
            bar_chart("Allocated GPU-hours by type (grey: idle)", per_type, "GPU-h", [("idle", IDLE_COLOR)]),
            bar_chart("Top users by GPU-hours", top_users, "GPU-h", idle_legend)]


def to_html(report: Report, generated: datetime) -> str:
    """A self-contained page: inline CSS and SVG, no script, no external reference."""
    import jinja2

    from slurmgpu.pipeline.rewrite import templates_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
                             autoescape=True)
    t = report.totals()
    tiles = [("GPU jobs", f"{t['jobs']:,}"), ("GPU-hours", _num(t["gpu_hours"], 0)),
             ("idle GPU-hours", f"{_num(t['idle_gpu_hours'], 0)} ({_pct(t['idle_gpu_hours'] / t['gpu_hours'])})"
              if t["gpu_hours"] else "-"),
             ("GPU memory used", _pct(t["mem_used_share"])), ("OOM jobs", str(t["ooms"])),
             ("changed by slurmgpu", str(t["changed"])), ("GPU-hours saved (est.)", _num(t["gpu_hours_saved"], 0)),
             ("queue hours saved (est.)", _num(t["queue_hours_saved"]))]
    return env.get_template("report/report.html.j2").render(
        since=_iso(report.since), until=_iso(report.until), generated=_iso(generated),
        scope=f"user {report.user}" if report.user else "all users", tiles=tiles, charts=charts(report),
        tables=table_rows(report), text_columns=TEXT_COLUMNS, definitions=DEFINITIONS)
