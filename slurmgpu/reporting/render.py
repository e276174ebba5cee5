"""A built report as JSON, CSV, terminal tables and a self-contained HTML page with inline SVG charts."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from slurmgpu.reporting import alerts as alerts_mod
from slurmgpu.reporting.alerts import AlertRow
from slurmgpu.reporting.report import DEFINITIONS, ChangeRow, Report, TypeRow, UserRow


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
        "advised": [_rounded(c._asdict()) for c in report.advised],
        "daily": [{"date": d.isoformat(), "gpu_type": t, "gpu_hours": round(h, 4)}
                  for d, per in report.daily.items() for t, h in sorted(per.items())],
        "alerts": alerts_mod.to_dicts(report.alerts),
        "model": {k: _iso(v) if isinstance(v, datetime) else v for k, v in report.model.items()}
        if report.model else None,
        "definitions": DEFINITIONS,
    }, indent=2)


def alerts_json(report: Report) -> str:
    """Only the alerts (``slurmgpu report --alerts --format json``)."""
    return json.dumps({
        "window": {"since": _iso(report.since), "until": _iso(report.until)},
        "user": report.user,
        "totals": alerts_mod.totals(report.alerts),
        "alerts": alerts_mod.to_dicts(report.alerts),
        "definitions": alerts_mod.DEFINITIONS,
    }, indent=2)



CSV_COLUMNS = ("section", "gpu_type", "user", "account", "change", *(
    f for f in (*TypeRow._fields, *UserRow._fields, *ChangeRow._fields, *AlertRow._fields)
    if f not in ("gpu_type", "user", "account", "change")))



def to_csv(report: Report, only_alerts: bool = False) -> str:
    """One CSV: a ``section`` column (gpu_type, user, change, alert) and the union of the sections' columns."""
    out = io.StringIO()
    columns = ("section", *AlertRow._fields) if only_alerts else CSV_COLUMNS
    writer = csv.DictWriter(out, fieldnames=list(dict.fromkeys(columns)), lineterminator="\n")
    writer.writeheader()
    sections: tuple[tuple[str, Sequence[Any]], ...] = (
        ("gpu_type", report.types), ("user", report.users), ("change", report.changes), ("alert", report.alerts),
        ("advised", report.advised))
    for section, rows in sections[3:4] if only_alerts else sections:
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



TEXT_COLUMNS = {"GPU type", "user", "account", "change", "alert", "example job", "detail", "fix", "figure", "value"}

# The columns each table keeps longest when the terminal is too narrow for all of them, in that
# order; the table's other columns go first, from its right end.
KEEP_FIRST = {
    "GPU types": ("GPU type", "GPU-h", "idle GPU-h", "memory used", "jobs"),
    "Users and accounts": ("user", "GPU-h", "idle GPU-h", "memory used", "OOMs", "account", "jobs", "changed"),
    "Changes by slurmgpu": ("change", "jobs", "GPU-h saved", "users"),
    "Advised, not applied": ("change", "jobs", "GPU-h saved", "users"),
    "Alerts": ("user", "alert", "fix", "wasted GPU-h", "jobs"),
    "Jobs": ("job", "user", "state", "GPUs", "elapsed", "peak GiB/GPU"),
    "Installed model on held-out jobs": ("figure", "value"),
}


def table_rows(report: Report) -> dict[str, tuple[tuple[str, ...], list[tuple[str, ...]]]]:
    """The three tables as display strings: shared by the terminal and the HTML page."""
    return {
        "GPU types": (("GPU type", "jobs", "GPU-h", "idle GPU-h", "measured GPU-h", "memory used"), [
            (t.gpu_type, str(t.jobs), _num(t.gpu_hours), _num(t.idle_gpu_hours), _num(t.measured_gpu_hours),
             _pct(t.mem_used_share)) for t in report.types]),
        "Users and accounts": (("user", "account", "jobs", "GPU-h", "idle GPU-h", "GiB/GPU asked", "GiB/GPU used",
                                "memory used", "GPUs busy/asked", "OOMs", "GPU OOMs", "changed",
                                "GPU-h saved",                                "queue h saved"), [
            (u.user, u.account, str(u.jobs), _num(u.gpu_hours), _num(u.idle_gpu_hours), _num(u.mem_asked_gib),
             _num(u.mem_used_gib), _pct(u.mem_used_share), _ratio(u.gpus_busy, u.gpus_asked), str(u.ooms),
             str(u.gpu_ooms), str(u.changed), _num(u.gpu_hours_saved), _num(u.queue_hours_saved))
            for u in report.users]),
        "Changes by slurmgpu": (("change", "jobs", "users", "GPU-h saved", "queue h saved"), [
            (c.change, str(c.jobs), str(c.users), _num(c.gpu_hours_saved), _num(c.queue_hours_saved))
            for c in report.changes]),
        "Alerts": alert_rows(report.alerts),
        **({"Advised, not applied": (("change", "jobs", "users", "GPU-h saved", "queue h saved"), [
            (c.change, str(c.jobs), str(c.users), _num(c.gpu_hours_saved), _num(c.queue_hours_saved))
            for c in report.advised])} if report.advised else {}),
        **({"Installed model on held-out jobs": (("figure", "value"), model_rows(report.model))}
           if report.model else {}),
    }


def model_rows(model: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The installed model's figures (``learning.registry.installed``), each as evaluate prints it;
    a figure not measured is left out."""
    from slurmgpu.learning.evaluation import PICKER_NAMES, PICKERS, picked

    end, made = (f"{t:%Y-%m-%d}" if isinstance(t, datetime) else "?" for t in (model["train_end"], model["created_at"]))
    rows: list[tuple[str, ...]] = [
        ("version", f"v{model['version']} ({model['digest']}), trained on jobs to {end}, installed {made}")]
    figures = model.get("metrics") or {}
    decided = figures.get("decider") or {}
    if not figures.get("test_jobs"):
        return [*rows, ("held-out jobs", "none: trained without a held-out window (train --test-days)")]
    rows.append(("held-out jobs", str(figures["test_jobs"])))
    if decided.get("replayed") is not None:
        rows += [("decider replayed on", f"{decided['replayed']} ({decided['changed']} changed)"),
                 ("placed where it does not fit", str(decided["placed_no_fit"])),
                 ("GPU OOM, decided / as asked", f"{decided['oom_decided']} / {decided['oom_as_asked']}")]
    rows += [(f"type within 5% of the best measured, {name} (mean of the best)", text)
             for who, name in zip(PICKERS, PICKER_NAMES, strict=True) if (text := picked(decided, who))]
    if figures.get("memory_under_prediction_rate") is not None:
        rows.append(("peak memory bound under-predicted",
                     f"{figures['memory_under_prediction_rate']:.1%} of {figures['memory_jobs']} jobs"))
    if figures.get("memory_bound_median_error") is not None:
        rows.append(("peak memory bound, median error", f"{figures['memory_bound_median_error']:.1%}"))
    if figures.get("runtime_mdape") is not None:
        rows.append(("run time median error", f"{figures['runtime_mdape']:.1%} of {figures['runtime_jobs']} jobs"))
    return rows


def alert_rows(rows: Sequence[AlertRow]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    return (("user", "account", "alert", "jobs", "GPU-h", "wasted GPU-h", "example job", "detail", "fix"), [
        (a.user, a.account, alerts_mod.KINDS[a.kind], str(a.jobs), _num(a.gpu_hours), _num(a.wasted_gpu_hours),
         a.example_job, a.detail, a.fix) for a in rows])


def _table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]], keep: list[int], wide: bool) -> Any:
    """The rich table of the columns ``keep``: text columns wrap at spaces, figures and ids never."""
    from rich.table import Table
    from rich.text import Text as RichText

    table = Table(title=title)
    for i in keep:
        text = header[i] in TEXT_COLUMNS
        table.add_column(header[i], justify="left" if text else "right", overflow="fold", no_wrap=wide or not text)
    for row in rows:
        table.add_row(*(RichText(row[i]) for i in keep))  # names are data, never rich markup
    return table


def fitted(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]], console: Any) -> list[int]:
    """The columns that fit the console: each needs what rich measures of its cells and header
    (all of a figure or id, which never wraps; the longest word of a text column, which rich wraps
    at spaces), plus padding and a border. Columns go from the right, those KEEP_FIRST does not
    name first, then those it names from its last."""
    from rich.measure import Measurement
    from rich.text import Text as RichText

    unbounded = console.options.update_width(1 << 20)

    def need(i: int) -> int:
        sizes = [Measurement.get(console, unbounded, RichText(cell)) for cell in (header[i], *(r[i] for r in rows))]
        return 3 + max(m.minimum if header[i] in TEXT_COLUMNS else m.maximum for m in sizes)

    first = [header.index(h) for h in KEEP_FIRST.get(title, ()) if h in header]
    order = first + [i for i in range(len(header)) if i not in first]  # the last one goes first
    widths = {i: need(i) for i in range(len(header))}
    keep = list(range(len(header)))
    while len(keep) > 1 and 1 + sum(widths[i] for i in keep) > console.width:
        keep.remove(max(keep, key=order.index))
    return keep


def terminal_width() -> int:
    """$COLUMNS, else the terminal's width, else 80."""
    import shutil

    return shutil.get_terminal_size((80, 24)).columns


def print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]], console: Any,
                wide: bool) -> bool:
    """One table sized to the terminal (every column when wide); True when columns were left out."""
    keep = list(range(len(header))) if wide else fitted(title, header, rows, console)
    console.print(_table(title, header, rows, keep, wide))
    return bool(rows) and len(keep) < len(header)


def console_for(wide: bool) -> Any:
    """A rich console as wide as the terminal ($COLUMNS, else 80); unbounded with --wide."""
    from rich.console import Console

    return Console(width=10_000 if wide else terminal_width(), soft_wrap=wide)



def headline(report: Report) -> str:
    t = report.totals()
    scope = f"user {report.user}" if report.user else "all users"
    return (f"{_iso(report.since)} .. {_iso(report.until)}, {scope}: {t['jobs']} GPU jobs, "
            f"{_num(t['gpu_hours'])} GPU-h ({_num(t['idle_gpu_hours'])} idle), memory used "
            f"{_pct(t['mem_used_share'])}, {t['ooms']} OOMs ({t['gpu_ooms']} GPU), {t['changed']} changed by slurmgpu "
            f"({_num(t['gpu_hours_saved'])} GPU-h saved)" + advised_line(t))


def advised_line(totals: Mapping[str, Any]) -> str:
    """'; advised, not applied: N jobs, est. X GPU-h / Y queue-h' when advise mode decided any."""
    if not totals.get("advised"):
        return ""
    return (f"; advised, not applied: {totals['advised']} jobs, est. {_num(totals['advised_gpu_hours'])} GPU-h / "
            f"{_num(totals['advised_queue_hours'])} queue-h")



def print_tables(report: Report, console: Any, wide: bool = False, only_alerts: bool = False) -> None:
    from rich.text import Text as RichText

    console.print(RichText(headline(report)))
    narrowed_any = False
    for title, (header, rows) in table_rows(report).items():
        if only_alerts and title != "Alerts":
            continue
        narrowed_any |= print_table(title, header, rows, console, wide)
    if narrowed_any:
        console.print(RichText("Some columns left out to fit the terminal: --wide shows them all, "
                               "--format json gives every figure."))



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



CHAR_EM = 0.64  # the widest digit or letter of the page's font (DejaVu Sans), in ems: labels never clip
LABEL_PX, VALUE_PX = 12, 11  # svg text and svg text.value in the template's CSS


def text_width(text: str, px: int) -> float:
    return len(text) * CHAR_EM * px


def bar_chart(title: str, rows: Sequence[tuple[str, Sequence[tuple[float, str, str]]]], unit: str,
              legend: list[tuple[str, str]], values: Sequence[str] | None = None) -> Chart:
    """Horizontal stacked bars: one row per label, segments of (value, colour, tooltip), each row's
    total (or ``values``) after its bar; the margins are as wide as the longest labels."""
    labels = [label[:22] for label, _ in rows]
    values = list(values) if values is not None else [f"{sum(v for v, _, _ in segs):,.0f} {unit}"
                                                      for _, segs in rows]
    width, row_h = 560, 26
    left = 8 + max((text_width(x, LABEL_PX) for x in labels), default=0.0) + 8
    right = 6 + max((text_width(x, VALUE_PX) for x in values), default=0.0) + 4
    height = 10 + row_h * max(len(rows), 1)
    top = max((sum(v for v, _, _ in segs) for _, segs in rows), default=0.0) or 1.0
    scale = max(width - left - right, 40.0) / top
    rects, texts = [], []
    for i, ((_, segs), label, value_text) in enumerate(zip(rows, labels, values, strict=True)):
        y, x = 8 + i * row_h, left
        texts.append(Text(left - 8, y + 15, label, "end"))
        for value, color, tip in segs:
            rects.append(Rect(x, y, max(value * scale, 0.0), row_h - 8, color, tip))
            x += max(value * scale, 0.0)
        texts.append(Text(x + 6, y + 15, value_text, css="value"))
    return Chart(title, int(max(width, left + right + 40)), height, rects, texts, [], legend)


def memory_chart(title: str, rows: Sequence[tuple[str, float | None, float | None, str]]) -> Chart:
    """Per row (label, GiB per GPU allocated, GiB used at peak, colour): the used part coloured,
    the rest of the card grey; rows without measurements are left out."""
    shown = [(label, asked, used, color) for label, asked, used, color in rows if asked and used is not None]
    return bar_chart(title, [(label, [(used, color, f"{label}: {used:,.1f} GiB used at peak"),
                                      (asked - used, IDLE_COLOR, f"{label}: {asked - used:,.1f} GiB never used")])
                             for label, asked, used, color in shown], "GiB", [("not used", IDLE_COLOR)],
                     [f"{used:,.1f} of {asked:,.0f} GiB" for _, asked, used, _ in shown])


def axis_scale(value: float) -> tuple[float, int]:
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
    tick, ticks = axis_scale(max((sum(report.daily.get(d, {}).values()) for d in days), default=0.0))
    top = tick * ticks
    step = (width - left - 10) / len(days)
    rects: list[Rect] = []
    texts: list[Text] = []
    grid: list[tuple[float, float, float, float]] = []
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
            bar_chart("Top users by GPU-hours", top_users, "GPU-h", idle_legend),
            memory_chart("GPU memory per GPU by type: peak used of allocated",
                         [(t.gpu_type, t.mem_asked_gib, t.mem_used_gib, colors[t.gpu_type]) for t in report.types]),
            memory_chart("GPU memory per GPU by user: peak used of allocated",
                         [(f"{u.user} ({u.account})", u.mem_asked_gib, u.mem_used_gib, USER_COLOR)
                          for u in report.users[:12]])]



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
             ("GPU memory used", _pct(t["mem_used_share"])),
             (f"OOM jobs ({t['gpu_ooms']} GPU, {t['ooms'] - t['gpu_ooms']} host memory)", str(t["ooms"])),
             ("changed by slurmgpu", str(t["changed"])), ("GPU-hours saved (est.)", _num(t["gpu_hours_saved"], 0)),
             ("queue hours saved (est.)", _num(t["queue_hours_saved"]))]
    if t["advised"]:
        tiles.append(("advised, not applied", f"{t['advised']} jobs, est. {_num(t['advised_gpu_hours'])} GPU-h / "
                                              f"{_num(t['advised_queue_hours'])} queue-h"))
    return env.get_template("report/report.html.j2").render(
        since=_iso(report.since), until=_iso(report.until), generated=_iso(generated),
        scope=f"user {report.user}" if report.user else "all users", tiles=tiles, charts=charts(report),
        tables=table_rows(report), text_columns=TEXT_COLUMNS, definitions=DEFINITIONS)
