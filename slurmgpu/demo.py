"""The demo: gsbatch's decisions on the example scripts, without submitting anything."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurmgpu.config import load_config
from slurmgpu.errors import InputError
from slurmgpu.gsbatch import Invocation, plan
from slurmgpu.policy import make_decider
from slurmgpu.rewrite import describe

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "contrib" / "examples"
SAMPLE_CONFIG = ROOT / "contrib" / "slurmgpu.toml"


def run(examples: Path = EXAMPLES, config_path: Path = SAMPLE_CONFIG, console: Console | None = None) -> int:
    console = console or Console()
    decider = make_decider(load_config(config_path))
    table = Table(title=f"gsbatch --dry-run on {examples} (config {config_path.name})", show_lines=True)
    for col in ("script", "request", "decision", "why"):
        table.add_column(col, overflow="fold")
    shown = None
    for path in sorted(examples.glob("*.sh")):
        try:
            p = plan(Invocation(script=str(path), flags=frozenset({"--dry-run"})), {}, decider)
        except InputError as exc:
            table.add_row(path.name, "-", "[red]error[/red]", str(exc))
            continue
        assert p.request is not None
        request = "; ".join(describe(c) for c in p.request.components)
        if p.decision.refusal:
            verdict = "[red]refused[/red]"
        elif p.submission.changed:
            verdict = "[yellow]rewritten[/yellow]"
            shown = shown or (path.name, p.submission.script_text)
        else:
            verdict = "[green]kept[/green]"
        why = "\n".join([p.decision.refusal] if p.decision.refusal else p.decision.reasons)
        table.add_row(path.name, request, verdict, why)
    console.print(table)
    if shown is not None:
        console.print(f"\n[bold]gsbatch --dry-run {shown[0]}[/bold] would submit:")
        console.print(shown[1], markup=False, highlight=False, soft_wrap=True)
    return 0
