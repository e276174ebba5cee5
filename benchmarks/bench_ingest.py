"""Ingest speed and memory: a 1,000,000-row sacct dump into SQLite.

The dump repeats the rows of a sacct capture from the local cluster (tests/fixtures/sacct),
renumbering job ids, so every value format is a real one. Targets: the whole million in under
60 s on the 2-core machine, peak memory under 2 GiB. Usage: make bench [ROWS=1000000]
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "fixtures" / "sacct" / "jobs_parsable2.txt"
BIN = Path(sys.executable).parent
_ID = re.compile(r"^(\d+)")


def _shift_id(job_id: str, shift: int) -> str:
    return _ID.sub(lambda m: str(int(m.group(1)) + shift), job_id)


def write_dump(path: Path, rows: int) -> None:
    """Repeat the template, shifting every job id by a block offset, until ``rows`` rows."""
    template = [line for line in TEMPLATE.read_text().splitlines() if line]
    top = max(int(_ID.match(line).group(1)) for line in template)
    written = 0
    with path.open("w") as out:
        block = 0
        while written < rows:
            shift = block * (top + 1)
            for line in template:
                job_id, raw, rest = line.split("|", 2)
                out.write(f"{_shift_id(job_id, shift)}|{_shift_id(raw, shift)}|{rest}\n")
                written += 1
                if written == rows:
                    break
            block += 1


def main(rows: int) -> dict[str, float]:
    fields = ",".join(__import__("slurmgpu.slurm.sacct", fromlist=["FIELDS"]).FIELDS)
    with tempfile.TemporaryDirectory() as tmp:
        dump, db = Path(tmp) / "dump.txt", f"sqlite:///{tmp}/bench.db"
        write_dump(dump, rows)
        subprocess.run([str(BIN / "slurmgpu"), "--db", db, "db", "upgrade"], check=True, capture_output=True)
        t0 = time.perf_counter()
        res = subprocess.run([str(BIN / "slurmgpu"), "--db", db, "ingest", "--from-file", str(dump), "--format", fields,
                              "--cluster", "bench", "--no-spool"], capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
        if res.returncode != 0:
            raise SystemExit(f"ingest failed: {res.stderr[-2000:]}")
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "peak_rss_mib": peak_mib,
                "dump_mib": dump.stat().st_size / 2**20, "summary": res.stdout.strip()}


if __name__ == "__main__":
    result = main(int(os.environ.get("ROWS", "1000000")))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "ingest.json").write_text(json.dumps(result, indent=2))
    print(f"ingest of {result['rows']:,} sacct rows ({result['dump_mib']:.0f} MiB) into SQLite: "
          f"{result['seconds']:.1f} s, {result['rows_per_s']:,.0f} rows/s, peak RSS {result['peak_rss_mib']:.0f} MiB")
    print(result["summary"])
