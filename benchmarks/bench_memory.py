"""Memory benchmark: the peak estimate and the bound ``predict`` shows, judged on published peaks.

Three ways a site's history falls short of the job asked about, each over several draws (the
tests in tests/test_published.py are one draw of each):

* *unseen batch*: every timm model of GPUMemNet's sweep (A100, batch 8-128) asked at batch 128
  with batches 8-64 in history;
* *unseen architectures*: every size of a fifth of the sweep's architectures left out (drawn at
  random), the rest in history;
* *every GPU generation*: DLInfBench's inference memory of 8 CNNs on six cards of three
  generations, batch 1-32 in history (each batch on 2 or 3 cards drawn at random), asked at batch
  64 and 128 on every card; beside it the same without the cards' memory offsets (one line
  through every card's runs).

Figures: median absolute error and the share under the measured peak, of the estimate and of the
figure shown (with its calibrated margin). The issue's aim for the figure shown: under 10% and
under 5% of jobs. Usage: make bench-memory [MEMORY_ARGS="--draws 0,1,2,3,4"]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from published import (  # noqa: E402
    architectures_left_out,
    by_model,
    errors,
    estimate_mib,
    generations_history,
    generations_judged,
    memory_rows,
    shown_peak,
    trained_bundle,
)

RESULTS = ROOT / "benchmarks" / "results" / "memory.json"


def unseen_batch(tmp: Path, timm: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    bundle = trained_bundle(tmp, [r for rs in timm.values() for r in rs if r["batch_size"] != "128"])
    shown, estimate, measured = {}, {}, {}
    for model, rs in timm.items():
        top = next(r for r in rs if r["batch_size"] == "128")
        shown[model] = shown_peak(bundle, model, 128, top["image_or_seq"])
        estimate[model] = estimate_mib(bundle, model, 128, top["image_or_seq"])
        measured[model] = float(top["peak_mib"])
    return {"estimate": errors(estimate, measured), "shown": errors(shown, measured)}


def unseen_architectures(tmp: Path, timm: dict[str, list[dict[str, str]]], draw: int) -> dict[str, Any]:
    held = architectures_left_out(timm, draw)
    bundle = trained_bundle(tmp, [r for m, rs in timm.items() if m not in held for r in rs])
    shown, estimate, measured = {}, {}, {}
    for model in held:
        for r in timm[model]:
            key = f"{model}@{r['batch_size']}"
            shown[key] = shown_peak(bundle, model, int(r["batch_size"]), r["image_or_seq"])
            estimate[key] = estimate_mib(bundle, model, int(r["batch_size"]), r["image_or_seq"])
            measured[key] = float(r["peak_mib"])
    return {"draw": draw, "models": len(held), "estimate": errors(estimate, measured),
            "shown": errors(shown, measured)}


def generations(tmp: Path, draw: int, cards_a_batch: int) -> dict[str, Any]:
    from slurmgpu.learning import train

    config, peaks, engine = generations_history(tmp, draw, cards_a_batch)
    rows = train.history_rows(engine)
    bundle = train.fit(rows, config, iterations=300)[0]
    estimate, shown = generations_judged(bundle, config, peaks)
    learned, train.type_offsets = train.type_offsets, lambda points: {}
    try:
        one_line = train.fit(rows, config, iterations=300)[0]
    finally:
        train.type_offsets = learned
    line_estimate, line_shown = generations_judged(one_line, config, peaks)
    return {"draw": draw, "cards_a_batch": cards_a_batch, "offsets": bundle.history.type_offsets,
            "estimate": estimate, "shown": shown, "one_line_estimate": line_estimate, "one_line_shown": line_shown}


def _pair(e: dict[str, float]) -> str:
    return f"{e['mdape']:.1%} / {e['under']:.1%}"


def table_md(result: dict[str, Any]) -> str:
    lines = ["median error / share under, of the estimate and of the figure shown", "",
             "| case | draw | estimate | shown | without card offsets: estimate | shown |", "|---|---|---|---|---|---|"]
    b = result["unseen_batch"]
    lines.append(f"| unseen batch (timm, 128 from 8-64) | - | {_pair(b['estimate'])} | {_pair(b['shown'])} | | |")
    for a in result["unseen_architectures"]:
        lines.append(f"| unseen architectures (timm, {a['models']} models) | {a['draw']} | {_pair(a['estimate'])} | "
                     f"{_pair(a['shown'])} | | |")
    for g in result["generations"]:
        lines.append(f"| every generation (DLInfBench, {g['cards_a_batch']} cards a batch) | {g['draw']} | "
                     f"{_pair(g['estimate'])} | {_pair(g['shown'])} | {_pair(g['one_line_estimate'])} | "
                     f"{_pair(g['one_line_shown'])} |")
    return "\n".join(lines)


def _integers(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--draws", type=_integers, default=[0, 1, 2, 3, 4], help="comma-separated draws (random seeds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    draws = args.draws
    timm = {m: rs for m, rs in by_model(memory_rows()).items() if len(rs) == 5}
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {"unseen_batch": unseen_batch(Path(tmp) / "batch", timm)}
        result["unseen_architectures"] = [unseen_architectures(Path(tmp) / f"arch-{d}", timm, d) for d in draws]
        result["generations"] = [generations(Path(tmp) / f"gen-{d}-{k}", d, k) for d in draws for k in (2, 3)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table_md(result))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
