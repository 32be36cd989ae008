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
    "recording K=20 / engine time",
    "JSON-mode tokens/s / plain tokens/s, V=5,025",
    "JSON-mode / plain record bytes per completion token, V=5,025",
    "JSON-mode tokens/s / plain tokens/s, V=151,669",
    "JSON-mode / plain record bytes per completion token, V=151,669",
    "lean step / trainer step (speed, same tokens)",
    "Delta write / parquet write (speed)",
    "Delta write / parquet write, from dicts (speed)",
    "Delta read / parquet read (speed)",
    "environment + tokenizer + bookkeeping / lab round",
    "Delta I/O / lab round",
    "Dagster / lab round",
    "score centering (head, K=20) step / reinforce step",
    "peak memory, chunked log-probs / naive",
    *(
        f"bytes per completion token, {sampling}, V = {vocab}"
        for sampling in ("plain", "top-p 0.9")
        for vocab in ("5,025", "151,669")
    ),
    *(
        f"serving tokens/s, recording on / off, {sampling}, V = {vocab}"
        for sampling in ("plain", "top-p 0.9")
        for vocab in ("5,025", "151,669")
    ),
    "serving tokens/s, V = 151,669 / V = 5,025",
    "trainer step time, V = 151,669 / V = 5,025",
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
        if r["goal"] is None:  # a figure
            assert r["passed"] is None
        else:
            assert r["passed"] == (r["median"] >= r["goal"] if r["at_least"] else r["median"] <= r["goal"])
        assert r["name"] in done.stdout  # and printed in the table


def test_the_scaling_figures_are_written_for_every_variable(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.scaling", "--smoke", "--repeats", "1", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "scaling.json").read_text())
    assert set(figures) == {"B", "S", "L", "K"}
    assert not figures["S"]["engine"]  # the engine has no steps per round
    for variable, series in figures.items():
        for stage in ("engine", "trainer") if variable != "S" else ("trainer",):
            sizes = [size for size, _ in series[stage]]
            assert len(sizes) >= 2 and sizes == sorted(set(sizes)), (variable, stage)
            assert all(math.isfinite(s) and s > 0 for _, s in series[stage]), (variable, stage)
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG")
