"""A tiny run of `python -m bench` (every side-by-side benchmark behind `make bench`'s table): it
runs to the end and writes one JSON record per ratio, each consistent with its own samples and goal
(the figures themselves are not judged here: tiny sizes say nothing about speed)."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RATIOS = {
    "engine decode tokens/s / transformers generate",
    "engine recording K=20 / recording stubbed out",
    "lean step / trainer step (speed, same tokens)",
    "Delta write / parquet write (speed)",
    "Delta write from dicts / parquet write (speed)",
    "Delta read / parquet read (speed)",
    "environment + tokenizer + bookkeeping / lab round",
    "lab round through Dagster / its asset bodies",
    "score centering (head, K=20) step / reinforce step",
    "peak memory, chunked log-probs / naive",
}


def test_every_benchmark_runs_and_the_table_is_written(tmp_path):
    out = tmp_path / "ratios.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["name"] for r in rows} == RATIOS
    for r in rows:
        assert r["samples"] and all(math.isfinite(x) and x > 0 for x in r["samples"]), r
        assert r["median"] == statistics.median(r["samples"])
        assert r["passed"] == (r["median"] >= r["goal"] if r["at_least"] else r["median"] <= r["goal"])
        assert r["name"] in done.stdout  # and printed in the table
